"""The batch-invariant CPU attention's torch float64 path (the C++ kernel's is tests/test_cpu_ops.py): a
row's output does not depend on its batch, and a batch of very different KV lengths (run in length
groups) gives the same bits as each request alone."""
from __future__ import annotations

import pytest
import torch

from specjet.kernels import attention as A
from specjet.kernels.attention_metadata import build_attention_metadata


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """These tests are about the torch path: keep the C++ kernel out even where it is built."""
    monkeypatch.setattr(A, "native_attention_available", lambda *args: False)


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
                             max_total_tokens=512, random_seed=0, dtype="float32", device="cpu")
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


def shared_prefix_batch(dtype, q_lens, custom_mask=False, seed=2):
    """Rows 0-3 share 100 cached slots, rows 4-5 share 80 others, row 6 shares nothing; each row then
    has its own 3..60 positions (its new tokens last)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 6, 2, 16
    own = [int(n) for n in torch.randint(3, 60, (7,), generator=gen)]
    own = [max(n, q) for n, q in zip(own, q_lens)]
    prefixes = {r: 100 for r in range(4)} | {4: 80, 5: 80, 6: 0}
    num_slots = 1 + 100 + 80 + sum(own)
    k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    kv_lens = [prefixes[r] + own[r] for r in range(7)]
    table = torch.zeros(7, max(kv_lens), dtype=torch.int64)
    first, second = torch.randperm(100, generator=gen) + 1, torch.randperm(80, generator=gen) + 101
    start = 181
    for r in range(7):
        shared = first if prefixes[r] == 100 else second if prefixes[r] == 80 else first[:0]
        table[r, :len(shared)] = shared
        table[r, len(shared):kv_lens[r]] = torch.arange(start, start + own[r])
        start += own[r]
    mask = None
    if custom_mask:  # tree-like: each new token sees itself and a random subset of the earlier ones
        mq = max(q_lens)
        mask = torch.rand(7, mq, mq, generator=gen) < 0.5
        mask = (mask.tril(-1) | torch.eye(mq, dtype=torch.bool)).expand(7, mq, mq).clone()
    meta_args = (table, torch.arange(7), torch.tensor(kv_lens), torch.tensor(q_lens), mask)
    return q, k, v, meta_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,custom_mask", [([1] * 7, False), ([1, 3, 2, 1, 4, 1, 2], False),
                                                ([4] * 7, True), ([3, 1, 4, 2, 4, 1, 3], True)],
                         ids=["decode", "extend", "dense-tree", "padded-tree"])
def test_rows_sharing_cached_slots_run_as_a_cascade_with_the_same_bits(dtype, q_lens, custom_mask, monkeypatch):
    """Rows sharing a cached prefix gather it once (the plan finds both groups, the loner runs alone),
    and every output equals the plain invariant path's and each request's alone."""
    from specjet.kernels import shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 16)
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_POSITIONS", 16)
    q, k, v, meta_args = shared_prefix_batch(dtype, q_lens, custom_mask)
    meta = build_attention_metadata(*meta_args)
    out = A.paged_attention_invariant(q, k, v, meta, 0.25)
    plans = shared_prefix.find_shared_prefixes(meta, A.INVARIANT_Q_CHUNK)
    assert sorted((p.rows.tolist(), p.slots.numel()) for p in plans) == [([0, 1, 2, 3], 100), ([4, 5], 80)]
    assert sum(shared is not None for _, _, shared in meta.parts) >= 2

    plain = build_attention_metadata(*meta_args)
    plain.parts = [(tokens, group, None) for tokens, group in A._length_groups(plain)]
    assert torch.equal(out, A.paged_attention_invariant(q, k, v, plain, 0.25))
    expected = A.paged_attention_reference(q, k, v, meta, 0.25)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)
    table, _, kv_lens, _, mask = meta_args
    offset = 0
    for r in range(7):  # alone: no cascade
        alone = build_attention_metadata(table, torch.tensor([r]), kv_lens[r:r + 1], torch.tensor(q_lens[r:r + 1]),
                                         None if mask is None else mask[r:r + 1, :q_lens[r], :q_lens[r]])
        got = A.paged_attention_invariant(q[offset:offset + q_lens[r]], k, v, alone, 0.25)
        assert all(shared is None for _, _, shared in alone.parts)
        assert torch.equal(out[offset:offset + q_lens[r]], got), f"request {r} differs in the cascade"
        offset += q_lens[r]


def test_no_cascade_for_short_shared_prefixes_small_savings_long_queries_or_uncached_slots(monkeypatch):
    from specjet.kernels import shared_prefix

    def plans(*args):
        return sorted((p.rows.tolist(), p.slots.numel())
                      for p in shared_prefix.find_shared_prefixes(build_attention_metadata(*args), A.INVARIANT_Q_CHUNK))

    q, k, v, meta_args = shared_prefix_batch(torch.float32, [1] * 7)
    table, rows, kv_lens, q_lens, _ = meta_args
    # The defaults: 3 x 100 and 1 x 80 saved positions are not worth a cascade.
    assert plans(*meta_args) == []
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_POSITIONS", 100)  # the 4 rows save 300, the pair 80
    assert plans(*meta_args) == [([0, 1, 2, 3], 100)]
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_POSITIONS", 16)
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 90)  # only the 100-slot group is long enough
    assert plans(*meta_args) == [([0, 1, 2, 3], 100)]
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 16)
    # A prefill chunk (more new tokens than one query chunk) is compute-bound: no cascade.
    long_q = kv_lens.clamp(max=A.INVARIANT_Q_CHUNK + 1)
    assert plans(table, rows, kv_lens, long_q) == []
    # Shared slots that are some row's new tokens (not cached for it) are not part of the prefix.
    q_lens = torch.ones(7, dtype=torch.int64)
    q_lens[0] = 60
    cached = int(kv_lens[0]) - 60
    assert cached < 100
    assert plans(table, rows, kv_lens, q_lens) == [([0, 1, 2, 3], cached), ([4, 5], 80)]


@pytest.mark.parametrize("custom", [False, True])
def test_a_pieces_mask_is_the_full_masks_rows_and_built_only_when_read(custom):
    """select(rows): the piece's mask, built from its own rows' inputs when a torch path reads it,
    equals the batch's full mask at those rows (cut to the piece's own padding); selecting does not
    build the batch's mask (the C++ kernel never reads one)."""
    kv_lens, q_lens = [30, 9, 17, 4], [3, 1, 4, 2]
    _, _, _, table = make_batch(kv_lens, q_lens, torch.float32)
    gen = torch.Generator().manual_seed(7)
    custom_mask = torch.rand(4, 4, 4, generator=gen) < 0.6 if custom else None
    args = (table, torch.arange(4), torch.tensor(kv_lens), torch.tensor(q_lens), custom_mask)
    meta = build_attention_metadata(*args)
    for rows in ([1, 3], [0, 2], [2]):
        piece = meta.select(torch.tensor(rows))
        assert meta.mask_inputs is not None and piece.mask_inputs is not None  # nothing built yet
        expected = build_attention_metadata(*args).mask[rows, :, :piece.max_q, :piece.max_kv]
        assert torch.equal(piece.mask, expected), rows
    built = build_attention_metadata(*args)
    full = built.mask  # once the batch's mask exists, a piece takes its rows
    piece = built.select(torch.tensor([1, 3]))
    assert (piece.max_q, piece.max_kv) == (2, 9) and torch.equal(piece.mask, full[[1, 3], :, :2, :9])
