"""A prefill's, a decode step's or a verify's forward from host lists as one C++ call
(``LlamaForCausalLM.forward_lists``, csrc/layer_stack.cpp's ``LayerStack.forward_lists``) against the batch the
general path builds from the same lists (``host_token_tensors`` + ``ForwardBatch.from_host`` / ``build`` +
``forward``): the same logits, normed rows, captured features and KV slots written, bit for bit; bad lists refused
before anything is written; ``ModelRunner.forward_lists`` falling back to the general path where the C++ call
stands aside; the engine's outputs the same with and without the C++ call, plain and speculative."""
from __future__ import annotations

import pytest
import torch

from test_layer_stack import make_runner, tree_mask

from specjet.kernels import cpu_ops
from specjet.models.forward_batch import FeatureLayers, ForwardBatch, ForwardMode, host_token_tensors
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


def cpp_forward(runner, ids, positions, slot_cols, rows, q_lens, kv_lens, table, **kwargs):
    """The C++ call alone (None where it stands aside), on the runner's KV cache."""
    return runner.model.forward_lists(ids, positions, slot_cols, rows, q_lens, kv_lens, table, runner.kv_cache,
                                      **kwargs)


def decode_lists(runner, table, tokens, positions, rows, **kwargs):
    """A decode step: request i's token at position positions[i], in its table row's column of that position."""
    n = len(rows)
    return cpp_forward(runner, tokens, positions, positions, rows, [1] * n, [p + 1 for p in positions], table,
                       **kwargs)


def general_forward(runner, table, tokens, positions, slot_cols, rows, q_lens, kv_lens, mask=None, **kwargs):
    flat_rows = [r for r, q in zip(rows, q_lens) for _ in range(q)]
    ids, pos, slots = host_token_tensors(table, tokens, positions, flat_rows, slot_cols)
    mode = ForwardMode.DECODE if max(q_lens) == 1 and mask is None else ForwardMode.VERIFY
    return runner.forward(ForwardBatch.from_host(mode, ids, pos, slots, table, rows, q_lens, kv_lens, mask, **kwargs))


def assert_same_output(fast, ref):
    assert fast is not None, "the C++ forward stood aside"
    for name in ("logits", "hidden"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), f"{name}: max |d| {(a.float() - b.float()).abs().max().item()}"


class KVSnapshot:
    """The pools as they were, restored before each of the two forwards compared."""

    def __init__(self, runner):
        self.runner, self.k, self.v = runner, runner.kv_cache.k.clone(), runner.kv_cache.v.clone()

    def restore(self) -> None:
        self.runner.kv_cache.k.copy_(self.k)
        self.runner.kv_cache.v.copy_(self.v)

    def written(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.kv_cache.k.clone(), self.runner.kv_cache.v.clone()


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
    kv = KVSnapshot(runner)
    tokens = torch.randint(0, vocab, (len(lengths),), generator=gen).tolist()
    for defer in (False, True):
        kv.restore()
        fast = decode_lists(runner, table, tokens, lengths, rows, defer_logits=defer)
        fast_kv = kv.written()
        kv.restore()
        ref = general_forward(runner, table, tokens, lengths, lengths, rows, [1] * len(rows),
                              [n + 1 for n in lengths], defer_logits=defer)
        assert_same_output(fast, ref)
        assert (fast.logits is None) == defer
        assert torch.equal(fast_kv[0], runner.kv_cache.k) and torch.equal(fast_kv[1], runner.kv_cache.v)
        assert not torch.equal(fast_kv[0], kv.k), "the step wrote no KV"
    # The head applied to the deferred rows gives the logits the undeferred step returned.
    kv.restore()
    deferred = decode_lists(runner, table, tokens, lengths, rows, defer_logits=True).hidden
    kv.restore()
    assert torch.equal(runner.head(deferred), decode_lists(runner, table, tokens, lengths, rows).logits)


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")])
@pytest.mark.parametrize("capture", [None, "last", FeatureLayers((1, 0, 1, 99))], ids=["none", "last", "features"])
def test_a_verify_from_lists_gives_the_general_paths_bits(tiny_model_dir, dtype, quantization, capture):
    """Trees of different sizes under their masks (one request a lone root), slots in table columns after the
    committed ones, RoPE positions by depth, grammar-masked rows (a sparse mask, a dense one, none), captures."""
    runner = make_runner(tiny_model_dir, dtype, quantization)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    table = scattered_table(6, 48)
    rows, committed, q_lens = [3, 0, 5], [20, 9, 30], [5, 1, 4]
    ids = torch.randint(0, vocab, (6, 48), generator=gen)
    prefill(runner, table, ids, rows, committed)
    mask = tree_mask(3, 5, gen)
    depths = [c + int(mask[b, i, :q].sum()) - 1 for b, (c, q) in enumerate(zip(committed, q_lens)) for i in range(q)]
    slot_cols = [c + i for c, q in zip(committed, q_lens) for i in range(q)]
    tokens = torch.randint(0, vocab, (sum(q_lens),), generator=gen).tolist()
    kv_lens = [c + q for c, q in zip(committed, q_lens)]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(tokens), words, dtype=torch.int32)
    bitmask[0, :2] = -1  # 64 tokens allowed
    bitmask[3] = -1  # every token
    masked = torch.zeros(len(tokens), dtype=torch.bool)
    masked[[0, 3]] = True
    kv = KVSnapshot(runner)
    for logits_mask in (None, (bitmask, masked)):
        kv.restore()
        fast = cpp_forward(runner, tokens, depths, slot_cols, rows, q_lens, kv_lens, table, custom_mask=mask,
                                    capture_hidden=capture, logits_mask=logits_mask)
        fast_kv = kv.written()
        kv.restore()
        ref = general_forward(runner, table, tokens, depths, slot_cols, rows, q_lens, kv_lens, mask,
                              capture_hidden=capture, logits_mask=logits_mask)
        assert_same_output(fast, ref)
        assert torch.equal(fast_kv[0], runner.kv_cache.k) and torch.equal(fast_kv[1], runner.kv_cache.v)
    if capture is not None:  # the features: each listed layer's residual stream once, then the normed rows
        width = runner.config.hidden_size * (1 if capture == "last" else 3)
        assert fast.hidden.shape == (len(tokens), width)


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")])
@pytest.mark.parametrize("capture", [None, "last", FeatureLayers((1, 0))], ids=["none", "last", "features"])
def test_a_prefill_from_lists_gives_the_general_paths_bits(tiny_model_dir, dtype, quantization, capture):
    """Prefills of several requests (one after a cached prefix, one a single token) with each request's last
    row's logits, as ``ForwardBatch.build(..., logits="last")`` gives them: the same logits, features and KV."""
    runner = make_runner(tiny_model_dir, dtype, quantization)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    table = scattered_table(6, 48)
    ids = torch.randint(0, vocab, (6, 48), generator=gen)
    rows, cached, ends = [2, 4, 0], [0, 11, 6], [17, 30, 7]
    prefill(runner, table, ids, [4, 0], [11, 6])  # the cached prefixes
    tokens = [int(ids[r, p]) for r, c, e in zip(rows, cached, ends) for p in range(c, e)]
    positions = [p for c, e in zip(cached, ends) for p in range(c, e)]
    q_lens = [e - c for c, e in zip(cached, ends)]
    kv = KVSnapshot(runner)
    fast = cpp_forward(runner, tokens, positions, positions, rows, q_lens, ends, table, capture_hidden=capture,
                                last_logits=True)
    written = kv.written()
    kv.restore()
    flat_rows = torch.tensor([r for r, q in zip(rows, q_lens) for _ in range(q)])
    ref = runner.forward(ForwardBatch.build(
        ForwardMode.EXTEND, input_ids=torch.tensor(tokens), positions=torch.tensor(positions),
        out_cache_loc=table[flat_rows, torch.tensor(positions)], req_to_token=table, req_pool_indices=torch.tensor(rows),
        kv_lens=torch.tensor(ends), q_lens=torch.tensor(q_lens), logits="last", capture_hidden=capture))
    assert_same_output(fast, ref)
    assert fast.logits.shape[0] == len(rows)
    assert torch.equal(written[0], runner.kv_cache.k) and torch.equal(written[1], runner.kv_cache.v)


def test_per_layer_captures_stand_aside(tiny_model_dir):
    """A tuple of layers (``ModelOutput.layer_hidden``, for tests) is the general forward's alone."""
    runner = make_runner(tiny_model_dir, "float32", None)
    assert cpp_forward(runner, [1], [0], [0], [0], [1], [1], scattered_table(1, 8), capture_hidden=(0,)) is None


def test_forward_from_lists_grows_the_rope_table_past_its_blocks(tiny_model_dir, monkeypatch):
    """A position past the RoPE table's rows grows it (as ``cos_sin`` does); the rows match the general path's."""
    monkeypatch.setattr(Rotary, "TABLE_BLOCK", 8)
    runner = make_runner(tiny_model_dir, "float32", None)
    table = scattered_table(2, 64)
    ids = torch.randint(0, runner.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    prefill(runner, table, ids, [0, 1], [5, 5])
    rows, tokens = [0, 1], [3, 4]
    for step in range(5, 40):  # the table grows by 8 rows at a time while the requests advance
        positions = [step, min(step + 17, 63)]
        kv = KVSnapshot(runner)
        fast = decode_lists(runner, table, tokens, positions, rows)
        written = kv.written()
        kv.restore()
        ref = general_forward(runner, table, tokens, positions, positions, rows, [1, 1], [p + 1 for p in positions])
        assert torch.equal(fast.logits, ref.logits) and torch.equal(written[0], runner.kv_cache.k), step
        tokens = fast.logits.argmax(-1).tolist()
    assert runner.model.rotary._tables[torch.float32][0].shape[0] >= 64


def _lists(**change):
    """A good one-request verify's lists (3 tokens after 5 committed in table row 2), with ``change`` applied."""
    lists = dict(ids=[5, 6, 7], positions=[5, 6, 7], slot_cols=[5, 6, 7], rows=[2], q_lens=[3], kv_lens=[8])
    lists.update(change)
    return lists


@pytest.mark.parametrize("change, match", [
    ({"ids": [5, 10 ** 6, 7]}, "token id"),
    ({"ids": [5, -1, 7]}, "token id"),
    ({"positions": [5, 6, -1]}, "position"),
    ({"positions": [5, 6, 10 ** 6]}, "position"),
    ({"slot_cols": [5, 6, 40]}, "slot column"),
    ({"slot_cols": [-1, 6, 7]}, "slot column"),
    ({"rows": [6]}, "table row"),
    ({"rows": [-2]}, "table row"),
    ({"q_lens": [0], "kv_lens": [8]}, "q_len"),
    ({"q_lens": [3], "kv_lens": [2]}, "q_len"),
    ({"q_lens": [3], "kv_lens": [41]}, "q_len"),
    ({"q_lens": [2]}, "the requests bring"),
    ({"positions": [5, 6]}, "one length"),
    ({"kv_lens": [8, 9]}, "one length"),
    ({"ids": [], "positions": [], "slot_cols": []}, "non-empty"),
    ({"rows": [], "q_lens": [], "kv_lens": []}, "non-empty"),
    ({"mask": torch.ones(1, 2, 2, dtype=torch.bool)}, "mask"),
    ({"mask": torch.ones(2, 3, 3, dtype=torch.bool)}, "mask"),
    ({"mask": torch.ones(1, 3, 3)}, "mask"),
    ({"capture": [1, 0]}, "capture"),
])
def test_forward_from_lists_refuses_bad_lists_before_writing_anything(tiny_model_dir, change, match):
    runner = make_runner(tiny_model_dir, "float32", None)
    model = runner.model
    runner.kv_cache.k.zero_()
    runner.kv_cache.v.zero_()
    lists = _lists(**change)
    mask, capture = lists.pop("mask", None), lists.pop("capture", [])
    with pytest.raises(RuntimeError, match=match):
        model.layer_stack.forward_lists(*lists.values(), scattered_table(6, 40), model.embed_tokens.weight,
                                        *model.rotary.table(torch.float32, 64), runner.kv_cache.k, runner.kv_cache.v,
                                        mask, *model._native_norm, cpu_ops.isa(), capture)
    assert runner.kv_cache.k.abs().sum() == 0 and runner.kv_cache.v.abs().sum() == 0, "a refused call wrote the KV"
    # The good lists run (and write).
    model.layer_stack.forward_lists(*_lists().values(), scattered_table(6, 40), model.embed_tokens.weight,
                                    *model.rotary.table(torch.float32, 64), runner.kv_cache.k, runner.kv_cache.v,
                                    None, *model._native_norm, cpu_ops.isa(), [])
    assert runner.kv_cache.k.abs().sum() > 0


@pytest.mark.parametrize("change, match", [
    ({"x": "two rows"}, "positions and slot_cols T long"),
    ({"x": "strided"}, "contiguous"),
    ({"positions": [5, 6, 10 ** 6]}, "position"),
    ({"rows": [6]}, "table row"),
    ({"skip": 3}, "keep a row"),
    ({"skip": -1}, "skip"),
])
def test_forward_from_given_rows_refuses_bad_arguments_before_writing_anything(tiny_model_dir, change, match):
    """``LayerStack.forward_rows`` (a draft block's rows given, not ids) shares forward_lists' checks, and
    refuses rows that do not fit the lists or a skip that would leave a request without a row."""
    runner = make_runner(tiny_model_dir, "float32", None)
    model = runner.model
    runner.kv_cache.k.zero_()
    runner.kv_cache.v.zero_()
    hidden = runner.config.hidden_size
    xs = {"good": torch.randn(3, hidden), "two rows": torch.randn(2, hidden),
          "strided": torch.randn(hidden, 3).t()}

    def call(x="good", positions=(5, 6, 7), rows=(2,), skip=1):
        return model.layer_stack.forward_rows(xs[x], list(positions), [5, 6, 7], list(rows), [3], [8],
                                              scattered_table(6, 40), *model.rotary.table(torch.float32, 64),
                                              runner.kv_cache.k, runner.kv_cache.v, None, *model._native_norm,
                                              cpu_ops.isa(), skip)

    with pytest.raises(RuntimeError, match=match):
        call(**change)
    assert runner.kv_cache.k.abs().sum() == 0 and runner.kv_cache.v.abs().sum() == 0, "a refused call wrote the KV"
    assert call().shape == (2, hidden) and runner.kv_cache.k.abs().sum() > 0


def test_forward_from_given_rows_is_forward_lists_on_the_embedded_ids(tiny_model_dir):
    """Rows given as the ids' embeddings give forward_lists' normed rows and KV, less the skipped rows of each
    request (two requests, a verify's tree mask)."""
    runner = make_runner(tiny_model_dir, "float32", None)
    model = runner.model
    gen = torch.Generator().manual_seed(7)
    table = scattered_table(2, 64)
    prefill(runner, table, torch.randint(0, runner.config.vocab_size, (2, 64), generator=gen), [0, 1], [9, 12])
    ids = torch.randint(0, runner.config.vocab_size, (7,), generator=gen).tolist()
    positions = [9, 10, 11, 12, 13, 14, 15]
    rows, q_lens, kv_lens = [0, 1], [3, 4], [12, 16]
    mask = torch.tril(torch.ones(2, 4, 4, dtype=torch.bool))
    mask[1, 3, 2] = False  # a tree: node 3 of the second request hangs on node 1
    cos, sin = model.rotary.table(torch.float32, 64)
    kv = KVSnapshot(runner)
    whole, _ = model.layer_stack.forward_lists(ids, positions, positions, rows, q_lens, kv_lens, table,
                                               model.embed_tokens.weight, cos, sin, runner.kv_cache.k,
                                               runner.kv_cache.v, mask, *model._native_norm, cpu_ops.isa(), [])
    written = kv.written()
    kv.restore()
    x = model.embed_tokens.weight[ids].contiguous()
    kept = model.layer_stack.forward_rows(x, positions, positions, rows, q_lens, kv_lens, table, cos, sin,
                                          runner.kv_cache.k, runner.kv_cache.v, mask, *model._native_norm,
                                          cpu_ops.isa(), 1)
    assert torch.equal(kept, whole[[1, 2, 4, 5, 6]])
    assert torch.equal(runner.kv_cache.k, written[0]) and torch.equal(runner.kv_cache.v, written[1])


@pytest.mark.parametrize("kind", ["prefill", "verify"])
def test_the_runner_falls_back_to_the_general_path_where_the_cpp_call_stands_aside(tiny_model_dir, kind):
    """Without the layer stack the C++ call stands aside and ``ModelRunner.forward_lists`` gives the general
    path's output from the same lists (the Python loop over the same kernels: the same bits)."""
    runner = make_runner(tiny_model_dir, "float32", None)
    gen = torch.Generator().manual_seed(4)
    table = scattered_table(3, 40)
    tokens = torch.randint(0, runner.config.vocab_size, (12,), generator=gen).tolist()
    if kind == "prefill":
        lists = dict(positions=list(range(7)) + list(range(5)), rows=[2, 0], q_lens=[7, 5], kv_lens=[7, 5])
        lists["slot_cols"], kwargs = lists["positions"], {"last_logits": True}
    else:
        prefill(runner, table, torch.randint(0, runner.config.vocab_size, (3, 40), generator=gen), [1], [9])
        chain = [9 + i for i in range(12)]  # a chain of 12 nodes after 9 cached tokens
        lists = dict(positions=chain, slot_cols=chain, rows=[1], q_lens=[12], kv_lens=[21])
        kwargs = {"custom_mask": torch.tril(torch.ones(1, 12, 12, dtype=torch.bool)),
                  "capture_hidden": FeatureLayers((0,))}
    args = (tokens, lists["positions"], lists["slot_cols"], lists["rows"], lists["q_lens"], lists["kv_lens"], table)
    kv = KVSnapshot(runner)
    fast = cpp_forward(runner, *args, **kwargs)
    fast_kv = kv.written()
    kv.restore()
    stack, runner.model.layer_stack = runner.model.layer_stack, None
    assert cpp_forward(runner, *args, **kwargs) is None
    kv.restore()
    fallback = runner.forward_lists(*args, **kwargs)
    runner.model.layer_stack = stack
    assert_same_output(fast, fallback)
    assert torch.equal(fast_kv[0], runner.kv_cache.k) and torch.equal(fast_kv[1], runner.kv_cache.v)


@pytest.mark.parametrize("kwargs", [{}, {"speculative_algorithm": "NGRAM"}, {"speculative_algorithm": "NGRAM",
                                    "disable_overlap_schedule": False}], ids=["plain", "ngram", "ngram-overlap"])
def test_the_engine_gives_the_same_outputs_with_and_without_the_cpp_forward(tiny_model_dir, monkeypatch, kwargs):
    """Greedy, seeded sampling and grammar-constrained requests in one batch (plain decoding's head deferred
    under the grammar; n-gram trees verified under their masks): the ids with the C++ forward from lists equal
    those of the general path, which it replaced (counted); the KV invariant after each."""
    import specjet
    from specjet.models.llama import LlamaForCausalLM

    prompts = [[1, 9, 42, 42, 7, 100 + i, 42, 7] * (2 + i) for i in range(4)]
    params = [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
              {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 20, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 20, "json_schema": {"type": "object", "properties": {
                  "a": {"type": "integer"}}, "required": ["a"]}},
              {"temperature": 0.7, "seed": 3, "max_new_tokens": 20, "regex": "[a-z]{3,12}"}]
    real = LlamaForCausalLM.forward_lists
    calls = {"ran": 0, "aside": 0}

    def counted(self, *args, **kw):
        out = real(self, *args, **kw)
        calls["ran" if out is not None else "aside"] += 1
        return out

    def run(fast: bool):
        with monkeypatch.context() as m:
            m.setattr(LlamaForCausalLM, "forward_lists", counted if fast else (lambda self, *a, **k: None))
            with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, **kwargs) as eng:
                outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
                eng.check_kv_invariant()
        return outs

    general = run(False)
    assert calls == {"ran": 0, "aside": 0}
    assert run(True) == general
    assert calls["ran"] > 10 and calls["aside"] == 0


def feature_driven_head(tmp_path, model_dir, expected):
    """An EAGLE-3 head whose drafts hang on the target's fused features (fc: the token embedding plus a strong
    random map of the features), so features that differ in any way draft other tokens."""
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.eagle import EagleDraftModel, save_eagle

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    hot = torch.tensor(sorted({t for ids in expected for t in ids} | {0, 1, 2}))
    head = EagleDraftModel(config, hot_token_ids=hot, feature_layers=(0,))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("weight_t") or name.endswith("bias"):
                p.zero_()
        h = config.hidden_size
        head.fuse.weight_t.normal_(0.0, 0.1, generator=gen)
        head.fc.weight_t[:h] = torch.eye(h)
        head.fc.weight_t[h:].normal_(0.0, 1.0, generator=gen)
    return save_eagle(head, tmp_path, dtype=torch.float32)


def test_an_eagle3_engine_drafts_the_same_from_the_features_of_either_path(tiny_model_dir, tmp_path, monkeypatch):
    """EAGLE-3 drafts from the target layers' features that each verify captures: with the C++ forward from
    lists the ids and every request's accepted lengths equal the general path's (the same features, so the same
    drafts), under a grammar and without; the KV invariant after each."""
    import specjet

    from specjet.models.llama import LlamaForCausalLM

    prompts = [[1, 9, 42, 42, 7, 100 + i, 42, 7] * (2 + i) for i in range(3)]
    params = [{"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 32, "regex": "[a-z ]{4,60}"},
              {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, disable_guided_drafting=True) as eng:
        expected = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    head = feature_driven_head(tmp_path, tiny_model_dir, expected)

    def run(fast: bool):
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(LlamaForCausalLM, "forward_lists", lambda self, *a, **k: None)
            with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, speculative_algorithm="EAGLE",
                                speculative_draft_model_path=str(head)) as eng:
                outs = eng.generate(input_ids=prompts, sampling_params=params)
                eng.check_kv_invariant()
        return [o["output_ids"] for o in outs], [o["meta_info"]["spec_accept_histogram"] for o in outs]

    ids, accepted = run(True)
    assert ids == expected
    assert (ids, accepted) == run(False)


def test_logits_of_given_rows_are_those_rows_of_every_rows_logits(tiny_model_dir):
    """``logit_rows`` (a prefill scoring some prompt positions): the LM head over those flat rows alone, in
    their order, the bits of every row's logits picked after, from the C++ call and the general path."""
    runner = make_runner(tiny_model_dir, "float32", None)
    gen = torch.Generator().manual_seed(5)
    table = scattered_table(3, 40)
    tokens = torch.randint(0, runner.config.vocab_size, (12,), generator=gen).tolist()
    positions = list(range(7)) + list(range(5))
    args = (tokens, positions, positions, [2, 0], [7, 5], [7, 5], table)
    picked_rows = [6, 0, 11, 3]
    kv = KVSnapshot(runner)
    every = cpp_forward(runner, *args)
    kv.restore()
    picked = cpp_forward(runner, *args, logit_rows=picked_rows)
    kv.restore()
    assert torch.equal(picked.logits, every.logits[picked_rows])
    stack, runner.model.layer_stack = runner.model.layer_stack, None
    fallback = runner.forward_lists(*args, logit_rows=picked_rows)
    runner.model.layer_stack = stack
    assert torch.equal(fallback.logits, picked.logits)
