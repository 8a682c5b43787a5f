"""The batch-invariant CPU attention: a row's output does not depend on its batch, and a batch of
very different KV lengths (run in length groups) gives the same bits as each request alone."""
from __future__ import annotations

import pytest
import torch

from specjet.kernels import attention as A
from specjet.kernels.attention_metadata import build_attention_metadata


def make_batch(kv_lens: list[int], q_lens: list[int], dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 6, 2, 16
    num_slots = sum(kv_lens) + 1
    k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int64)
    start = 1
    for b, n in enumerate(kv_lens):  # request b's positions in scattered slots
        table[b, :n] = torch.randperm(n, generator=gen) + start
        start += n
    return q, k, v, table


def run(q, k, v, table, kv_lens, q_lens, rows=None):
    rows = list(range(len(kv_lens))) if rows is None else rows
    meta = build_attention_metadata(table, torch.tensor(rows), torch.tensor([kv_lens[r] for r in rows]),
                                    torch.tensor([q_lens[r] for r in rows]))
    starts = [sum(q_lens[:r]) for r in range(len(q_lens))]
    tokens = torch.cat([torch.arange(starts[r], starts[r] + q_lens[r]) for r in rows])
    return A.paged_attention_invariant(q[tokens], k, v, meta, 0.25), meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1, 1], [1, 3, 2, 1, 4]])
def test_mixed_lengths_run_in_groups_and_match_each_request_alone(dtype, q_lens):
    kv_lens = [900, 12, 40, 870, 7]
    q, k, v, table = make_batch(kv_lens, q_lens, dtype)
    together, meta = run(q, k, v, table, kv_lens, q_lens)
    assert len(meta.length_groups) >= 2, "this batch's padding should have split it"
    offset = 0
    for r in range(len(kv_lens)):
        alone, alone_meta = run(q, k, v, table, kv_lens, q_lens, rows=[r])
        assert len(alone_meta.length_groups) == 1
        assert torch.equal(together[offset:offset + q_lens[r]], alone), f"request {r} differs in the batch"
        offset += q_lens[r]


@pytest.mark.parametrize("q_lens", [[2, 1, 3, 1], [3, 3, 3, 3]], ids=["padded", "dense"])
def test_grouping_matches_the_reference_attention(q_lens):
    """Against the reference: padded rows (gathered and ungathered) and rows that all bring max_q
    tokens (equal trees: the dense path, no gathers)."""
    kv_lens = [300, 5, 280, 9]
    q, k, v, table = make_batch(kv_lens, q_lens, torch.float32, seed=1)
    out, meta = run(q, k, v, table, kv_lens, q_lens)
    assert len(meta.length_groups) >= 2
    expected = A.paged_attention_reference(q, k, v, meta, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_engine_flag_switches_cpu_attention_to_sdpa(tiny_model_dir, monkeypatch):
    """enable_deterministic_inference=False reaches every attention layer and runs SDPA; greedy
    text of a short request matches the invariant engine's (fp32: the two agree to ~1e-6)."""
    import specjet

    calls = {"reference": 0, "invariant": 0}
    for name in calls:
        real = getattr(A, f"paged_attention_{name}")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(A, f"paged_attention_{name}", spy)
    params = {"max_new_tokens": 8, "temperature": 0}
    outputs = {}
    for flag in (True, False):
        eng = specjet.Engine(model_path=str(tiny_model_dir), enable_deterministic_inference=flag,
                             max_total_tokens=512, random_seed=0, dtype="float32")
        try:
            layers = [m for m in eng.worker.runner.model.modules() if hasattr(m, "batch_invariant")]
            assert layers and all(m.batch_invariant is flag for m in layers)
            before = dict(calls)
            outputs[flag] = eng.generate("Hello there", params)["output_ids"]
            used = "invariant" if flag else "reference"
            assert calls[used] > before[used]
            assert calls["reference" if flag else "invariant"] == before["reference" if flag else "invariant"]
            eng.check_kv_invariant()
        finally:
            eng.shutdown()
    assert outputs[True] == outputs[False]
