"""A decode step from host lists as one C++ call (``ModelRunner.decode_lists``, csrc/layer_stack.cpp's
``LayerStack.decode``) against the batch the general path builds from the same lists
(``host_token_tensors`` + ``ForwardBatch.from_host`` + ``forward``): the same logits or normed rows and the
same KV slots written, bit for bit; bad lists refused before anything is written; the engine's outputs the
same with and without it."""
from __future__ import annotations

import pytest
import torch

from test_layer_stack import make_runner

from specjet.kernels import cpu_ops
from specjet.models.forward_batch import ForwardBatch, ForwardMode, host_token_tensors
from specjet.models.llama import Rotary

pytestmark = pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")


def scattered_table(rows: int, width: int, seed: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(rows * width, generator=gen) + 1).view(rows, width)  # slot 0 is the padding slot


def prefill(runner, table: torch.Tensor, ids: torch.Tensor, rows: list[int], lengths: list[int]) -> None:
    """Positions 0 .. length - 1 of each request into its table row's slots."""
    positions = torch.cat([torch.arange(n) for n in lengths])
    flat_rows = torch.cat([torch.full((n,), r) for r, n in zip(rows, lengths)])
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, input_ids=ids[flat_rows, positions], positions=positions,
        out_cache_loc=table[flat_rows, positions], req_to_token=table, req_pool_indices=torch.tensor(rows),
        kv_lens=torch.tensor(lengths), q_lens=torch.tensor(lengths), logits="last")
    runner.forward(batch)


def general_decode(runner, table, tokens: list[int], positions: list[int], rows: list[int], defer: bool):
    ids, pos, slots = host_token_tensors(table, tokens, positions, rows, positions)
    return runner.forward(ForwardBatch.from_host(ForwardMode.DECODE, ids, pos, slots, table, rows, [1] * len(rows),
                                                 [p + 1 for p in positions], defer_logits=defer))


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                                ("float32", "int4")])
@pytest.mark.parametrize("lengths", [[9], [12, 12, 12], [17, 4, 30]], ids=["one", "uniform", "ragged"])
def test_decode_from_lists_gives_the_general_paths_bits(tiny_model_dir, dtype, quantization, lengths):
    runner = make_runner(tiny_model_dir, dtype, quantization)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(len(lengths))
    table = scattered_table(6, 40)
    rows = [4, 1, 5][:len(lengths)]
    ids = torch.randint(0, vocab, (6, 40), generator=gen)
    prefill(runner, table, ids, rows, lengths)
    k0, v0 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    tokens = torch.randint(0, vocab, (len(lengths),), generator=gen).tolist()
    for defer in (False, True):
        runner.kv_cache.k.copy_(k0)
        runner.kv_cache.v.copy_(v0)
        fast = runner.decode_lists(tokens, lengths, rows, table, defer)
        assert fast is not None, "the C++ decode stood aside"
        fast_kv = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
        runner.kv_cache.k.copy_(k0)
        runner.kv_cache.v.copy_(v0)
        ref = general_decode(runner, table, tokens, lengths, rows, defer)
        got, want = (fast.hidden, ref.hidden) if defer else (fast.logits, ref.logits)
        assert (fast.logits is None) == defer and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"max |d| {(got.float() - want.float()).abs().max().item()}"
        assert torch.equal(fast_kv[0], runner.kv_cache.k) and torch.equal(fast_kv[1], runner.kv_cache.v)
        assert not torch.equal(fast_kv[0], k0), "the step wrote no KV"
    # The head applied to the deferred rows gives the logits the undeferred step returned.
    runner.kv_cache.k.copy_(k0)
    runner.kv_cache.v.copy_(v0)
    assert torch.equal(runner.head(runner.decode_lists(tokens, lengths, rows, table, True).hidden),
                       runner.decode_lists(tokens, lengths, rows, table, False).logits)


def test_decode_from_lists_grows_the_rope_table_past_its_blocks(tiny_model_dir, monkeypatch):
    """A position past the RoPE table's rows grows it (as ``cos_sin`` does); the rows match the general path's."""
    monkeypatch.setattr(Rotary, "TABLE_BLOCK", 8)
    runner = make_runner(tiny_model_dir, "float32", None)
    table = scattered_table(2, 64)
    ids = torch.randint(0, runner.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    prefill(runner, table, ids, [0, 1], [5, 5])
    k0, v0 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    rows, tokens = [0, 1], [3, 4]
    for step in range(5, 40):  # the table grows by 8 rows at a time while the requests advance
        positions = [step, min(step + 17, 63)]
        fast = runner.decode_lists(tokens, positions, rows, table)
        kv = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
        runner.kv_cache.k.copy_(k0)
        runner.kv_cache.v.copy_(v0)
        ref = general_decode(runner, table, tokens, positions, rows, False)
        assert torch.equal(fast.logits, ref.logits) and torch.equal(kv[0], runner.kv_cache.k), step
        k0, v0 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
        tokens = fast.logits.argmax(-1).tolist()
    assert runner.model.rotary._tables[torch.float32][0].shape[0] >= 64


@pytest.mark.parametrize("tokens, positions, rows, match", [
    ([10 ** 6], [3], [0], "token id"),
    ([-1], [3], [0], "token id"),
    ([5], [-1], [0], "position"),
    ([5], [40], [0], "position"),
    ([5], [3], [6], "table row"),
    ([5], [3], [-2], "table row"),
    ([5, 6], [3], [0, 1], "one length"),
    ([], [], [], "non-empty"),
])
def test_decode_from_lists_refuses_bad_lists_before_writing_anything(tiny_model_dir, tokens, positions, rows, match):
    runner = make_runner(tiny_model_dir, "float32", None)
    runner.kv_cache.k.zero_()
    runner.kv_cache.v.zero_()
    with pytest.raises(RuntimeError, match=match):
        runner.model.layer_stack.decode(tokens, positions, rows, scattered_table(6, 40), runner.model.embed_tokens.weight,
                                        *runner.model.rotary.table(torch.float32, 64), runner.kv_cache.k,
                                        runner.kv_cache.v, *runner.model._native_norm, cpu_ops.isa())
    assert runner.kv_cache.k.abs().sum() == 0 and runner.kv_cache.v.abs().sum() == 0, "a refused call wrote the KV"


def test_decode_from_lists_stands_aside_where_the_stack_does_not_run(tiny_model_dir):
    runner = make_runner(tiny_model_dir, "float32", None)
    runner.model.layer_stack = None
    assert runner.decode_lists([1], [0], [0], scattered_table(1, 8)) is None


def test_the_engine_gives_the_same_outputs_with_and_without_the_cpp_decode(tiny_model_dir, monkeypatch):
    """Greedy, seeded sampling and grammar-constrained requests in one batch (the head deferred under the
    grammar): the ids with the C++ decode equal those of the general path, which it replaced (counted)."""
    import specjet
    from specjet.models.runner import ModelRunner

    prompts = [[1, 9, 42, 42, 7, 100 + i, 42, 7] * (2 + i) for i in range(4)]
    params = [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
              {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 20, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 20, "json_schema": {"type": "object", "properties": {
                  "a": {"type": "integer"}}, "required": ["a"]}},
              {"temperature": 0.7, "seed": 3, "max_new_tokens": 20, "regex": "[a-z]{3,12}"}]
    real = ModelRunner.decode_lists
    calls = {"ran": 0, "aside": 0}

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["ran" if out is not None else "aside"] += 1
        return out

    def run(fast: bool):
        with monkeypatch.context() as m:
            m.setattr(ModelRunner, "decode_lists", counted if fast else (lambda self, *a, **k: None))
            with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048) as eng:
                outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
                eng.check_kv_invariant()
        return outs

    general = run(False)
    assert calls == {"ran": 0, "aside": 0}
    assert run(True) == general
    assert calls["ran"] > 10 and calls["aside"] == 0
