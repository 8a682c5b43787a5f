"""The target's decode and verify forwards through padded batch buckets (models/target_graphs.py):
the same logits and hidden states, bit for bit, as the eager forwards of the same batch; padding
writes the padding slot alone; and an engine whose target runs that way decodes exactly as one that
does not (greedy ids, seeded sampling), with no KV leaked. On CUDA the buckets are captured CUDA
graphs and replayed (the GPU runs of scripts/gpu_check.sh); on the CPU the same buffers run eagerly."""
from __future__ import annotations

import pytest
import torch

import specjet
from model_harness import load_runner, tree_mask
from specjet.models.forward_batch import FeatureLayers, ForwardBatch, ForwardMode
from specjet.models.graph_runner import BATCH_BUCKETS
from specjet.models.target_graphs import VERIFY_BUCKETS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PREFIXES = [[1, 520, 3303, 28, 2185, 16, 4785], [1, 77, 1200, 5, 9000], [1, 4000, 12, 812, 7, 7, 19, 2222, 301],
            [1, 9, 9, 9], [1, 30, 31, 32, 33, 34]]
MAX_LEN = 48


@pytest.fixture(scope="module", params=DEVICES)
def runner(request, tiny_model_dir):
    return load_runner(tiny_model_dir, dtype="bfloat16", device=request.param)


def prefilled(runner, count: int) -> torch.Tensor:
    """A table whose rows 0..count-1 hold PREFIXES' KV (row r owns slots 1 + r*MAX_LEN ...)."""
    on = runner.device
    table = (1 + torch.arange(len(PREFIXES) * MAX_LEN)).view(len(PREFIXES), MAX_LEN).to(on)
    for r, ids in enumerate(PREFIXES[:count]):
        n = len(ids)
        runner.forward(ForwardBatch.build(
            ForwardMode.EXTEND, input_ids=torch.tensor(ids, device=on), positions=torch.arange(n, device=on),
            out_cache_loc=table[r, :n], req_to_token=table, req_pool_indices=torch.tensor([r], device=on),
            kv_lens=torch.tensor([n], device=on), q_lens=torch.tensor([n], device=on), logits="last"))
    return table


def eager_forward(runner, table, mode, ids, positions, slots, rows, q_lens, kv_lens, mask=None, capture=None):
    return runner.forward(ForwardBatch.build(
        mode, input_ids=ids, positions=positions, out_cache_loc=slots, req_to_token=table, req_pool_indices=rows,
        kv_lens=kv_lens, q_lens=q_lens, custom_mask=mask, logits="all", capture_hidden=capture))


@pytest.mark.parametrize("count", [1, 3, 5])  # buckets 1, 4 and 8: none, one and three padded rows
def test_decode_equals_the_eager_decode(runner, count):
    table = prefilled(runner, count)
    on = runner.device
    graphs = runner.enable_graphs(table)
    try:
        rows = torch.arange(count, device=on)
        positions = torch.tensor([len(p) for p in PREFIXES[:count]], device=on)
        ids = torch.tensor([700 + r for r in range(count)], device=on)
        eager = eager_forward(runner, table, ForwardMode.DECODE, ids, positions, table[rows, positions], rows,
                              torch.ones_like(positions), positions + 1).logits
        k_before = runner.kv_cache.k.clone()
        requests = torch.stack([ids, positions, rows], 1)
        static = graphs.decode(requests.cpu()).logits  # from the host, as the worker hands them
        again = graphs.decode(requests).logits  # from the device; a replay on CUDA
        assert torch.equal(static, eager) and torch.equal(again, eager)
        # The padded rows wrote the padding slot 0 and nothing else (the real rows rewrote their own
        # slots with the same values).
        assert torch.equal(runner.kv_cache.k[:, 1:], k_before[:, 1:])
        assert graphs.stats()["decode"]["captures"] == (1 if on.type == "cuda" else 0)
    finally:
        runner.graphs = None


def test_verify_equals_the_eager_verify_with_hidden_states(runner):
    table = prefilled(runner, 3)
    on = runner.device
    graphs = runner.enable_graphs(table)
    try:
        trees = [[-1, 0, 0, 1, 2, 3], [-1], [-1, 0, 1, 1]]  # 6, 1 and 4 nodes: padded to 8 nodes a request
        masks = [tree_mask(p) for p in trees]
        width = max(len(p) for p in trees)
        mask = torch.zeros(3, width, width, dtype=torch.bool)
        for b, m in enumerate(masks):
            mask[b, :len(m), :len(m)] = m
        mask = mask.to(on)
        starts = [len(p) for p in PREFIXES[:3]]
        ids = torch.tensor([600 + i for p in trees for i in range(len(p))], device=on)
        positions = torch.cat([s + m.sum(-1) - 1 for s, m in zip(starts, masks)]).to(on)
        rows = torch.arange(3, device=on)
        slots = torch.cat([table[b, s:s + len(p)] for b, (s, p) in enumerate(zip(starts, trees))])
        q_lens = torch.tensor([len(p) for p in trees], device=on)
        kv_lens = torch.tensor(starts, device=on) + q_lens
        capture = FeatureLayers((0, 1))
        eager = eager_forward(runner, table, ForwardMode.VERIFY, ids, positions, slots, rows, q_lens, kv_lens,
                              mask, capture)
        for _ in range(2):  # capture, then replay on CUDA
            static = graphs.verify(ids, positions, slots, rows, q_lens, kv_lens, mask, 8, capture)
            assert torch.equal(static.logits, eager.logits)
            assert torch.equal(static.hidden, eager.hidden)
        with pytest.raises(ValueError, match="does not fit 4 nodes"):
            graphs.verify(ids, positions, slots, rows, q_lens, kv_lens, mask, 4, capture)
    finally:
        runner.graphs = None


PROMPTS = ["a b c a b c a b c a b", "The cat sat on the mat. The cat sat on the mat. The cat", "Hello",
           "1 2 3 4 1 2 3 4 1 2"]


def outputs(model_dir, static: bool, params, **kw) -> list[list[int]]:
    with specjet.Engine(model_path=str(model_dir), max_total_tokens=4096, **kw) as eng:
        if static:
            eng.worker.runner.enable_graphs(eng.worker.req_to_token, capture=False)
        outs = [o["output_ids"] for o in eng.generate(PROMPTS, params)]
        eng.check_kv_invariant()
        if static:
            # The decodes (plain) or the verifies (speculative) went through the graphs' buckets.
            stats = eng.worker.runner.graphs.stats()
            verifies = sum(s["calls"] for name, s in stats.items() if name.startswith("verify"))
            assert (verifies if "speculative_algorithm" in kw else stats["decode"]["calls"]) > 0
        return outs


@pytest.mark.parametrize("kw", [{}, {"speculative_algorithm": "NGRAM", "page_size": 16}],
                         ids=["plain", "ngram-page16"])
def test_engine_outputs_are_unchanged(tiny_model_dir, kw):
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    assert outputs(tiny_model_dir, True, greedy, **kw) == outputs(tiny_model_dir, False, greedy, **kw)
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True, "seed": 5}
    assert outputs(tiny_model_dir, True, sampled, **kw) == outputs(tiny_model_dir, False, sampled, **kw)


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_buckets_captured_at_start_touch_only_the_padding_slot(runner, verify):
    """``capture_buckets`` (what an engine on CUDA runs before serving) runs each bucket on padding
    alone: only slot 0's K/V change and stay finite (a padded request's token sees itself; seeing
    nothing gave NaN there on an AMX CPU, which the next batch's padded key positions read), every
    bucket is run once, and the forwards after it still give the eager forward's logits."""
    table = prefilled(runner, 2)
    graphs = runner.enable_graphs(table)
    try:
        k_before, v_before = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
        capture = FeatureLayers((0,)) if verify else None
        graphs.capture_buckets(5 if verify else None, capture)
        assert torch.equal(runner.kv_cache.k[:, 1:], k_before[:, 1:])
        assert torch.equal(runner.kv_cache.v[:, 1:], v_before[:, 1:])
        # Finite there too: a later batch's padded key positions read slot 0 (weighted by zero).
        assert torch.isfinite(runner.kv_cache.k[:, 0]).all() and torch.isfinite(runner.kv_cache.v[:, 0]).all()
        name = f"verify {capture!r}" if verify else "decode"
        stats = graphs.stats()[name]
        assert stats["calls"] == len(VERIFY_BUCKETS if verify else BATCH_BUCKETS) and stats["eager_calls"] == 0
        on = runner.device
        rows = torch.arange(2, device=on)
        positions = torch.tensor([len(p) for p in PREFIXES[:2]], device=on)
        ids = torch.tensor([701, 702], device=on)
        eager = eager_forward(runner, table, ForwardMode.DECODE, ids, positions, table[rows, positions], rows,
                              torch.ones_like(positions), positions + 1).logits
        assert torch.equal(graphs.decode(torch.stack([ids, positions, rows], 1)).logits, eager)
    finally:
        runner.graphs = None
