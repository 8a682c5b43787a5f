"""The EAGLE draft head: paged inference forward vs whole-sequence training forward, the hot token
head, checkpoints, and the head shipped for the default model."""
from __future__ import annotations

import json

import pytest
import torch

from model_harness import count_stack_runs, load_runner
from specjet.models.eagle import EagleDraftModel, default_eagle_path, load_eagle, read_eagle_config, save_eagle
from specjet.models.forward_batch import FeatureLayers, ForwardBatch, ForwardMode
from specjet.models.kv_cache import KVCache


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return load_runner(tiny_model_dir, tokens=512)


def make_head(runner, hot=None, seed=0, feature_layers=()) -> EagleDraftModel:
    torch.manual_seed(seed)
    head = EagleDraftModel(runner.config, hot_token_ids=hot, feature_layers=feature_layers)
    head.reset_parameters(std=0.1)  # larger than the training init, so the layer visibly matters
    if feature_layers:
        with torch.no_grad():  # every fused part matters (the training init reads f^last only)
            head.fuse.weight_t.normal_(0.0, 0.1)
            for norm in head.feature_norms:
                norm.weight.uniform_(0.5, 1.5)
    return head.bind_target(runner.model).eval()


# EAGLE-1 (final hidden state) and EAGLE-3 (plus the residual after layer 0 of the 2-layer target).
HEAD_KINDS = pytest.mark.parametrize("feature_layers", [(), (0,)], ids=["eagle1", "eagle3"])


def paged_forward(head, ids: list[torch.Tensor], feats: list[torch.Tensor], chunks: list[int]):
    """Run the head over several requests through a 1-layer paged KV cache, each request fed in
    pieces of ``chunks`` tokens (an extend, then more extends/decodes), slots scattered in reverse
    order so that no request's slots are contiguous. Returns each request's hidden [L, h] and the
    logits of its last token."""
    cfg = head.config
    lens = [len(x) for x in ids]
    kv = KVCache(1, 1 + sum(lens), cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.zeros(len(ids), max(lens), dtype=torch.int64)
    free = list(range(sum(lens), 0, -1))
    for r, n in enumerate(lens):
        table[r, :n] = torch.tensor([free.pop(0) for _ in range(n)])
    hidden = [[] for _ in ids]
    last_logits = [None] * len(ids)
    done = [0] * len(ids)
    for chunk in chunks:
        rows = [r for r in range(len(ids)) if done[r] < lens[r]]
        q = [min(chunk, lens[r] - done[r]) for r in rows]
        batch = ForwardBatch.build(
            ForwardMode.EXTEND if max(q) > 1 else ForwardMode.DECODE,
            input_ids=torch.cat([ids[r][done[r]:done[r] + n] for r, n in zip(rows, q)]),
            positions=torch.cat([torch.arange(done[r], done[r] + n) for r, n in zip(rows, q)]),
            out_cache_loc=torch.cat([table[r, done[r]:done[r] + n] for r, n in zip(rows, q)]),
            req_to_token=table,
            req_pool_indices=torch.tensor(rows),
            kv_lens=torch.tensor([done[r] + n for r, n in zip(rows, q)]),
            q_lens=torch.tensor(q),
            logits="last",
        )
        features = torch.cat([feats[r][done[r]:done[r] + n] for r, n in zip(rows, q)])
        h, logits = head(batch, features, kv, from_target=True)
        for (r, n), part, lg in zip(zip(rows, q), h.split(q), logits):
            hidden[r].append(part)
            done[r] += n
            if done[r] == lens[r]:
                last_logits[r] = lg
    return [torch.cat(h) for h in hidden], torch.stack(last_logits)


@HEAD_KINDS
def test_paged_forward_matches_training_forward(runner, feature_layers):
    head = make_head(runner, feature_layers=feature_layers)
    h = head.feature_width
    g = torch.Generator().manual_seed(1)
    lens = [11, 7]
    ids = [torch.randint(0, runner.config.vocab_size, (n,), generator=g) for n in lens]
    feats = [torch.randn(n, h, generator=g) for n in lens]

    hidden, last_logits = paged_forward(head, ids, feats, chunks=[5, 3, 1, 1, 1])

    padded_ids = torch.zeros(2, max(lens), dtype=torch.int64)
    padded_feats = torch.zeros(2, max(lens), h)
    for r, n in enumerate(lens):
        padded_ids[r, :n], padded_feats[r, :n] = ids[r], feats[r]
    with torch.no_grad():
        train_hidden = head.forward_train(padded_ids, padded_feats)
        for r, n in enumerate(lens):
            torch.testing.assert_close(hidden[r], train_hidden[r, :n], rtol=1e-4, atol=1e-4)
        expected_logits = torch.stack([head.logits(train_hidden[r, n - 1]) for r, n in enumerate(lens)])
    torch.testing.assert_close(last_logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert last_logits.dtype == torch.float32 and last_logits.shape == (2, runner.config.vocab_size)


def chain_hidden(head, ids: torch.Tensor, feats: torch.Tensor, root: int, depth: int) -> torch.Tensor:
    """The head's hidden state at draft step ``depth`` of a chain rooted at position ``root``, run the
    way the drafter runs it: an extend over the verified positions 0..root (target features), then
    one decode per step at position root + j reading the real next token and the previous step's
    hidden state, attending to the verified KV and its own chain's slots."""
    cfg = head.config
    n = root + 1
    kv = KVCache(1, 2 + n + depth, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.arange(1, n + depth + 1)[None] + 0  # positions 0..root+depth -> slots 1..
    table[0, n:] = torch.arange(n + 1, n + depth + 1).flip(0)  # chain slots elsewhere in the pool
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids[1:n + 1], torch.arange(n), table[0, :n], table,
                               torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), logits="none")
    hidden, _ = head(batch, feats[:n], kv, from_target=True)
    h = hidden[-1:]
    for j in range(1, depth + 1):
        pos = torch.tensor([root + j])
        batch = ForwardBatch.build(ForwardMode.DECODE, ids[root + j + 1:root + j + 2], pos, table[0, pos], table,
                                   torch.tensor([0]), pos + 1, torch.tensor([1]), logits="all")
        h, _ = head(batch, h, kv)
    return h[0]


@HEAD_KINDS
def test_unrolled_training_forward_is_chain_drafting(runner, feature_layers):
    """Training-time test: depth d of the unrolled forward at position t is the d-th draft step of
    the chain rooted at t - d, exactly as drafting computes it."""
    head = make_head(runner, seed=4, feature_layers=feature_layers)
    g = torch.Generator().manual_seed(5)
    n = 12
    ids = torch.randint(0, runner.config.vocab_size, (n,), generator=g)
    feats = torch.randn(n, head.feature_width, generator=g)
    with torch.no_grad():
        unrolled = head.forward_train_unrolled(ids[None, 1:], feats[None, :-1], depths=3)
        torch.testing.assert_close(unrolled[0], head.forward_train(ids[None, 1:], feats[None, :-1]))
        for depth in (1, 2):
            for t in (depth, depth + 2, n - 2):
                expected = chain_hidden(head, ids, feats, t - depth, depth)
                torch.testing.assert_close(unrolled[depth][0, t], expected, rtol=1e-4, atol=1e-4)
        # Depth 1 differs from teacher forcing: it reads the head's guess, not the target's feature.
        assert not torch.allclose(unrolled[1][0, 3:], unrolled[0][0, 3:], atol=1e-3)


def test_forward_without_logits(runner):
    """A draft extend whose rows only fill the KV cache asks for no logits."""
    head = make_head(runner, hot=torch.arange(10))
    cfg = runner.config
    kv = KVCache(1, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.arange(1, 5)[None]
    batch = ForwardBatch.build(ForwardMode.EXTEND, torch.tensor([3, 4, 5, 6]), torch.arange(4), table[0], table,
                               torch.tensor([0]), torch.tensor([4]), torch.tensor([4]), logits="none")
    hidden, logits = head(batch, torch.randn(4, cfg.hidden_size), kv)
    assert hidden.shape == (4, cfg.hidden_size) and logits.shape == (0, 10)
    assert kv.k[0, 1:5].abs().sum() > 0 and kv.k[0, 5:].abs().sum() == 0  # wrote exactly its slots


def test_hot_head_is_the_full_head_restricted_to_hot_ids(runner):
    vocab = runner.config.vocab_size
    hot = torch.tensor(sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:300].tolist()))
    full, reduced = make_head(runner, seed=3), make_head(runner, hot=hot, seed=3)
    assert reduced.draft_vocab_size == 300 and full.draft_vocab_size == vocab
    x = torch.randn(6, runner.config.hidden_size)
    with torch.no_grad():
        full_logits, hot_logits = full.logits(x), reduced.logits(x)
    torch.testing.assert_close(hot_logits, full_logits[:, hot], rtol=1e-5, atol=1e-5)
    columns = torch.tensor([0, 5, 299])
    assert reduced.hot_to_full(columns).tolist() == hot[columns].tolist()
    assert torch.equal(full.hot_to_full(columns), columns)
    # The best hot column maps to the best target id among the hot ids.
    best_hot = reduced.hot_to_full(hot_logits.argmax(-1))
    assert torch.equal(best_hot, hot[full_logits[:, hot].argmax(-1)])


def test_hot_ids_must_be_sorted_and_in_range(runner):
    with pytest.raises(ValueError, match="strictly increasing"):
        EagleDraftModel(runner.config, hot_token_ids=torch.tensor([5, 3]))
    with pytest.raises(ValueError, match=r"\[0, "):
        EagleDraftModel(runner.config, hot_token_ids=torch.tensor([1, runner.config.vocab_size]))


def test_unbound_head_says_so(runner):
    head = EagleDraftModel(runner.config)
    with pytest.raises(RuntimeError, match="bind_target"):
        head.forward_train(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, runner.config.hidden_size))


@HEAD_KINDS
def test_save_load_round_trip(runner, tmp_path, feature_layers):
    hot = torch.arange(0, runner.config.vocab_size, 7)
    head = make_head(runner, hot=hot, seed=4, feature_layers=feature_layers)
    save_eagle(head, tmp_path / "exact", training={"steps": 3}, dtype=torch.float32)
    save_eagle(head, tmp_path / "fp16")
    ids = torch.randint(0, runner.config.vocab_size, (1, 9))
    feats = torch.randn(1, 9, head.feature_width)
    exact = load_eagle(tmp_path / "exact", runner.config).bind_target(runner.model)
    half = load_eagle(tmp_path / "fp16", runner.config).bind_target(runner.model)
    # The data round trip is exact: every tensor comes back with the same bits.
    saved = dict(head.named_parameters())
    for name, loaded in exact.named_parameters():
        assert torch.equal(loaded, saved[name]) and loaded.dtype == saved[name].dtype, name
    with torch.no_grad():
        expected = head.forward_train(ids, feats)
        # load_eagle packs the projections for decoding (oneDNN-blocked weights, kernels/linear.py),
        # while the freshly built head runs the training matmul (x @ weight_t): the two GEMMs sum in
        # different orders, and whether their last bits agree depends on the CPU's kernels (an AVX2
        # machine differs by ~5e-7). So: a tight tolerance against the training path, and exact
        # equality against the original head packed the same way.
        loaded_out = exact.forward_train(ids, feats)
        torch.testing.assert_close(loaded_out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(half.forward_train(ids, feats), expected, rtol=1e-2, atol=1e-2)
        head.pack_for_decode()
        torch.testing.assert_close(loaded_out, head.forward_train(ids, feats), rtol=0, atol=0)
    assert torch.equal(exact.hot_token_ids, hot) and torch.equal(half.hot_token_ids, hot)
    assert exact.feature_layers == feature_layers and exact.feature_capture == head.feature_capture
    # Only the head's own tensors are stored: the target's embedding and LM head are not.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fp16" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {n for n, _ in head.named_parameters()} | {"hot_token_ids"}
    assert not any("embed" in n or "lm_head" in n for n in names)
    config = read_eagle_config(tmp_path / "exact")
    assert config["hot_vocab_size"] == len(hot) and config["training"] == {"steps": 3}
    assert config["target"]["hidden_size"] == runner.config.hidden_size


def test_a_draft_written_over_another_is_never_half_of_each(runner, tmp_path, monkeypatch):
    """The weights were written in place, then the config: a run killed (or a disk full) between the two left the new
    weights beside the old config, which loaded without a word (its training summary another run's). Both files are
    now written whole beside the old ones, then put in place; a write that fails leaves the old draft and no
    leftovers."""
    import pathlib

    out = tmp_path / "head"
    old, new = make_head(runner, seed=1), make_head(runner, seed=2)
    save_eagle(old, out, training={"steps": 1})
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    write_text = pathlib.Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name.startswith("config.json"):
            raise OSError(28, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_eagle(new, out, training={"steps": 2})
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    save_eagle(new, out, training={"steps": 2})
    from safetensors.torch import load_file

    load_eagle(out, runner.config)
    assert read_eagle_config(out)["training"] == {"steps": 2} and sorted(f.name for f in out.iterdir()) == [
        "config.json", "model.safetensors"]
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight_t"], new.fc.weight_t.detach().half())


def test_eagle3_feature_capture_is_the_residuals_then_the_final_hidden_state(runner):
    """``FeatureLayers`` gives every row's residual after the chosen layers and the final normed
    hidden state, concatenated, even when only some rows need logits (a verify, an extend)."""
    head = make_head(runner, feature_layers=(0,))
    assert head.feature_capture == FeatureLayers((0,))
    n = 6
    ids = torch.randint(0, runner.config.vocab_size, (n,), generator=torch.Generator().manual_seed(8))

    def forward(capture, slot0):
        slots = torch.arange(slot0, slot0 + n)
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, torch.arange(n), slots, slots[None], torch.tensor([0]),
                                   torch.tensor([n]), torch.tensor([n]), logits="last", capture_hidden=capture)
        return runner.forward(batch)

    fused = forward(head.feature_capture, 1)
    layers = forward((0,), 1 + n)
    last = forward("last", 1 + 2 * n)
    h = runner.config.hidden_size
    assert fused.hidden.shape == (n, 2 * h)
    torch.testing.assert_close(fused.hidden, torch.cat([layers.layer_hidden[0], last.hidden], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(fused.logits, last.logits, rtol=0, atol=0)


def test_eagle3_settings_are_checked(runner):
    with pytest.raises(ValueError, match="feature_layers must be increasing"):
        EagleDraftModel(runner.config, feature_layers=(1, 0))
    with pytest.raises(ValueError, match="feature_layers must be increasing"):
        EagleDraftModel(runner.config, feature_layers=(runner.config.num_layers - 1,))  # the last is f^last
    head = make_head(runner, feature_layers=(0,))
    with pytest.raises(ValueError, match="target features have width"):
        head.forward_train(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, runner.config.hidden_size))


def test_eagle3_head_starts_as_the_eagle1_head(runner):
    """Training starts from fuse = identity on f^last: the fused head computes what an EAGLE-1 head
    with the same weights computes, whatever the residual part holds."""
    torch.manual_seed(0)
    eagle1 = EagleDraftModel(runner.config).bind_target(runner.model)
    eagle3 = EagleDraftModel(runner.config, feature_layers=(0,)).bind_target(runner.model)
    eagle3.load_state_dict(eagle1.state_dict(), strict=False)
    ids = torch.randint(0, runner.config.vocab_size, (1, 7))
    last = torch.randn(1, 7, runner.config.hidden_size)
    with torch.no_grad():
        expected = eagle1.forward_train(ids, last)
        got = eagle3.forward_train(ids, torch.cat([100 * torch.randn_like(last), last], dim=-1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_load_refuses_another_target(runner, tmp_path):
    import dataclasses

    save_eagle(make_head(runner), tmp_path)
    other = dataclasses.replace(runner.config, hidden_size=runner.config.hidden_size * 2)
    with pytest.raises(ValueError, match="hidden_size"):
        load_eagle(tmp_path, other)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, format_version=99)))
    with pytest.raises(ValueError, match="not a specjet-eagle v1 head"):
        load_eagle(tmp_path, runner.config)
    with pytest.raises(FileNotFoundError, match="no EAGLE head"):
        load_eagle(tmp_path / "missing", runner.config)


def test_default_head_loads_for_the_default_model(default_model_dir):
    path = default_eagle_path()
    if not (path / "config.json").is_file():
        pytest.skip(f"no packaged EAGLE head at {path} yet (train one with `python -m specjet.train eagle`)")
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.weights import default_gguf_path

    try:
        gguf_name = default_gguf_path().name
    except FileNotFoundError as err:  # a tokenizer-only model directory (the GPU check's machine has no GGUF)
        pytest.skip(str(err))
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(default_model_dir))
    head = load_eagle(path, config)
    meta = read_eagle_config(path)
    assert meta["target"]["gguf"] == gguf_name
    assert head.draft_vocab_size == (meta["hot_vocab_size"] or config.vocab_size)
    assert sum((path / name).stat().st_size for name in ("model.safetensors", "config.json")) < 16 * 2**20


@HEAD_KINDS
def test_a_packed_head_runs_its_layer_as_one_cpp_call_with_the_loops_bits(runner, feature_layers, monkeypatch):
    """pack_for_decode puts the head's layer on the C++ ops and builds its stack (models/llama.py
    native_layer_stack); the paged forward through it gives, bit for bit, the hidden states and
    logits of the same layer called op by op, and stays close to the training forward."""
    from specjet.kernels import cpu_ops

    if cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    head = make_head(runner, seed=5, feature_layers=feature_layers)
    head.pack_for_decode()
    assert head.layer.native_ops and head.layer_stack is not None
    calls = count_stack_runs(monkeypatch)
    g = torch.Generator().manual_seed(2)
    lens = [9, 6]
    ids = [torch.randint(0, runner.config.vocab_size, (n,), generator=g) for n in lens]
    feats = [torch.randn(n, head.feature_width, generator=g) for n in lens]
    stacked = paged_forward(head, ids, feats, chunks=[4, 3, 1, 1])
    assert calls["ran"] == 4
    head.layer_stack = None
    looped = paged_forward(head, ids, feats, chunks=[4, 3, 1, 1])
    assert calls["ran"] == 4
    for a, b in zip(stacked[0], looped[0]):
        assert torch.equal(a, b)
    assert torch.equal(stacked[1], looped[1])
    padded_ids = torch.zeros(2, max(lens), dtype=torch.int64)
    padded_feats = torch.zeros(2, max(lens), head.feature_width)
    for r, n in enumerate(lens):
        padded_ids[r, :n], padded_feats[r, :n] = ids[r], feats[r]
    with torch.no_grad():
        train_hidden = head.forward_train(padded_ids, padded_feats)
    for r, n in enumerate(lens):
        torch.testing.assert_close(stacked[0][r], train_hidden[r, :n], rtol=1e-4, atol=1e-4)
