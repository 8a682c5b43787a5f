"""The DFlash draft model against a plain dense implementation written here (KV injection: Q from the
block, K/V from [context ; block], the block non-causal; RoPE, GQA, norms): the paged drafting path
(context K/V written at scattered slots after prefill, in chunks and after a verify-like extend, then
one block forward in scratch slots, with and without a context window) and the training forward
(many isolated blocks per sequence) give the oracle's logits. Checkpoints round-trip; the default
target layers spread over the stack."""
from __future__ import annotations

import math

import pytest
import torch

from model_harness import OneRequest, count_stack_runs, load_runner
from specjet.kernels import cpu_ops
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.models.dflash import (DFlashDraftModel, DFlashShape, default_target_layers, load_dflash,
                                   read_dflash_config, save_dflash)
from specjet.scheduler.memory_pool import TokenToKVPoolAllocator
from specjet.spec_v2.dflash_drafter import DFlashDrafter
from specjet.spec_v2.drafter import SpecInput

BLOCK = 5
MASK_ID = 7


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return load_runner(tiny_model_dir, tokens=512)


def random_draft(config, num_layers=2, block=BLOCK, seed=0, hot=None, root_context=False, prev=False,
                 position_masks=False) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config, DFlashShape(num_layers, (0,), block, MASK_ID, root_context, prev_token_input=prev,
                                                 position_masks=position_masks), hot_token_ids=hot)
    draft.reset_parameters(std=0.2)
    with torch.no_grad():  # norms away from 1, so a missing or misplaced norm shows
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        draft.mask_embedding.normal_(0, 1.0)
    return draft


@pytest.fixture(scope="module")
def features(runner):
    """A 23-token prompt's target features (FeatureLayers capture of layer 0 and the final state)."""
    ids = torch.randint(0, 2000, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    req = OneRequest(runner)
    from specjet.models.forward_batch import FeatureLayers

    out = req.extend(ids, capture=FeatureLayers((0,)))
    return ids, out.hidden.float().clone()  # a normal tensor (the forward ran in inference mode)


# ---------------------------------------------------------------- the oracle
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """x [T, H, D] rotated by the standard (Neox, rotate-half) RoPE at ``positions``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def dense_block_logits(draft: DFlashDraftModel, runner, feats, ctx_positions, root, root_pos, known=(), size=None
                       ) -> torch.Tensor:
    """The block [root, known..., mask, ...] at root_pos.. attending to every given context position
    and to all of itself, written out with plain tensor ops: logits [S - 1, vocab] of positions
    1..S-1. A root-context draft adds root_proj of the last given position's context (root_pos - 1)
    to every block row's input; a previous-token draft adds prev_proj of the token before a row (the
    root, or a known token) to rows 1..."""
    cfg = runner.config
    hf = cfg.hf_config
    eps = cfg.rms_norm_eps
    theta = getattr(hf, "rope_theta", None) or (getattr(hf, "rope_parameters", None) or {})["rope_theta"]
    H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    P = {n: p.detach().float() for n, p in draft.named_parameters()}
    size = size or draft.shape.block_size
    c = rms(feats @ P["fc.weight_t"], P["hidden_norm.weight"], eps)
    embed = runner.model.embed_tokens.weight.detach().float()
    # A position-mask draft's mask at block position i is its own vector i - 1 (past the trained block, the last).
    masks = [P["mask_embedding"][min(i, draft.shape.block_size - 1) - 1] if draft.shape.position_masks
             else P["mask_embedding"] for i in range(1 + len(known), size)]
    x = torch.stack([embed[root]] + [embed[t] for t in known] + masks)
    if draft.shape.root_context:
        assert ctx_positions[-1] == root_pos - 1
        x = x + c[-1] @ P["root_proj.weight_t"]
    if draft.shape.prev_token_input:
        before = [root, *known][:size - 1]
        x = x + torch.stack([torch.zeros_like(x[0])] + [embed[t] @ P["prev_proj.weight_t"] for t in before]
                            + [torch.zeros_like(x[0])] * (size - 1 - len(before)))
    blk_pos = torch.arange(root_pos, root_pos + size)
    for i in range(draft.shape.num_layers):
        pre = f"layers.{i}."
        w = P[pre + "self_attn.qkv_proj.weight_t"]
        wq, wk, wv = w[:, :H * D], w[:, H * D:(H + KV) * D], w[:, (H + KV) * D:]
        hn = rms(x, P[pre + "input_layernorm.weight"], eps)
        q = rope((hn @ wq).view(size, H, D), blk_pos, theta)
        k = torch.cat([rope((c @ wk).view(-1, KV, D), ctx_positions, theta), rope((hn @ wk).view(size, KV, D), blk_pos, theta)])
        v = torch.cat([(c @ wv).view(-1, KV, D), (hn @ wv).view(size, KV, D)])
        heads = []
        for h in range(H):
            g = h // (H // KV)  # query head h reads kv head g
            scores = (q[:, h] @ k[:, g].T) / math.sqrt(D)  # no mask: the block sees all of it
            heads.append(torch.softmax(scores, -1) @ v[:, g])
        x = x + torch.cat(heads, -1) @ P[pre + "self_attn.o_proj.weight_t"]
        hn = rms(x, P[pre + "post_attention_layernorm.weight"], eps)
        gate, up = (hn @ P[pre + "mlp.gate_up_proj.weight_t"]).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ P[pre + "mlp.down_proj.weight_t"]
    x = rms(x, P["norm.weight"], eps)
    return (x @ runner.model.lm_head.weight_t.detach().float())[1:]


# ---------------------------------------------------------------- paged drafting vs the oracle
def scattered_table(num_positions, seed=0):
    """One request's row: positions on shuffled slots 1..num_positions (slot 0 is padding)."""
    slots = torch.randperm(num_positions, generator=torch.Generator().manual_seed(seed)) + 1
    return slots[None, :].clone()


def draft_and_allocator(runner, packed: bool, root_context: bool = True, prev: bool = False,
                        position_masks: bool = False):
    """A random draft (packed: its inference operands and the C++ ops, as a loaded draft runs) and an
    allocator over the runner's pool."""
    if packed and cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    draft = random_draft(runner.config, root_context=root_context, prev=prev, position_masks=position_masks)
    if packed:
        draft.pack_for_decode()
    return draft, TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")


def scratch_and_in_place_drafters(runner, packed: bool, prev: bool = False, position_masks: bool = False):
    """A root-context random draft, an allocator, and two drafters of the draft: one borrowing scratch
    slots for its blocks, one drafting in place."""
    draft, allocator = draft_and_allocator(runner, packed, prev=prev, position_masks=position_masks)
    return (draft, allocator, DFlashDrafter(runner, draft, BLOCK, None, allocator),
            DFlashDrafter(runner, draft, BLOCK, None, allocator, reserved=BLOCK))


def two_prefilled_requests(drafters, extend, ids, feats):
    """Two requests (the prompt's first 12 tokens with root 5, all of it with root 11) prefilled into each of
    ``drafters``: their table (rows 0 and 1, slots from ``extend`` for each context and a block after it) and
    their inputs."""
    table = torch.zeros(2, 64, dtype=torch.int64)
    reqs = []
    for row, (n, root) in enumerate([(12, 5), (len(ids), 11)]):
        table[row, :n + BLOCK] = extend(torch.empty(0, dtype=torch.int64), 0, n + BLOCK)
        for drafter in drafters:
            drafter.after_prefill([SpecInput(f"r{row}", row, 0, ids[:n], 0)], feats[:n], [root], table)
        reqs.append(SpecInput(f"r{row}", row, n, ids[:n] + [root], 8))
    return table, reqs


@pytest.mark.parametrize("window,root_context,packed", [(None, False, False), (6, False, False), (None, True, False),
                                                         (6, True, False), (None, True, True), (6, False, True)])
def test_paged_block_forward_equals_the_dense_oracle(runner, features, window, root_context, packed):
    """packed: the inference operands and the C++ ops (the context's k|v through their own packed
    operand, RoPE and the write in one call), as a loaded draft runs."""
    ids, feats = features
    draft, allocator = draft_and_allocator(runner, packed, root_context)
    drafter = DFlashDrafter(runner, draft, BLOCK, window, allocator)
    assert all(op is not None for op in draft.context_kv) == packed and len(draft.context_kv) == 2
    n = len(ids)
    # Let the allocator own the request's slots so the scratch block gets others.
    table = torch.zeros(2, 64, dtype=torch.int64)
    row_slots = allocator.extend(torch.empty(0, dtype=torch.int64), 0, n + 8)
    table[1, : n + 8] = row_slots[torch.randperm(n + 8, generator=torch.Generator().manual_seed(1))]
    # The prompt arrives in two prefill chunks (the second starts at committed_len 9).
    drafter.after_prefill([SpecInput("r", 1, 0, ids[:9], 0)], feats[:9], [ids[9]], table)
    drafter.after_prefill([SpecInput("r", 1, 9, ids, 0)], feats[9:], [11], table)
    root = 11
    before = allocator.num_free_slots
    logits = drafter.draft_blocks([SpecInput("r", 1, n, ids + [root], 8)], table)[0]
    assert allocator.num_free_slots == before  # the scratch block went back
    first = 0 if window is None else n - window
    expected = dense_block_logits(draft, runner, feats[first:], torch.arange(first, n), root, n)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # A batch of two requests (the second with a shorter context) gives each its own logits.
    table[0, :12] = allocator.extend(torch.empty(0, dtype=torch.int64), 0, 12)
    drafter.after_prefill([SpecInput("s", 0, 0, ids[:12], 0)], feats[:12], [5], table)
    both = drafter.draft_blocks([SpecInput("s", 0, 12, ids[:12] + [5], 8), SpecInput("r", 1, n, ids + [root], 8)],
                                table)
    torch.testing.assert_close(both[1], logits, rtol=1e-4, atol=1e-4)
    first_s = 0 if window is None else 12 - window
    torch.testing.assert_close(both[0], dense_block_logits(draft, runner, feats[first_s:12], torch.arange(first_s, 12),
                                                           5, 12), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_blocks_in_the_requests_own_slots_give_the_scratch_blocks_logits(runner, features, packed, monkeypatch):
    """In place (``reserved`` positions past the committed length held by the request: the block's K/V
    go to its own slots and the forward reads its own table row; packed, the C++ layer stack takes the
    kernel's metadata straight from the table) the logits equal, bit for bit, those of a block in
    borrowed scratch slots, and the oracle's, for one request and for a batch of two with different
    context lengths; nothing is borrowed from the allocator, and the context before the block is left
    as it was (a second block gives the same logits). Where a block would pass the table's end
    (the context's), or the drafter holds fewer reserved positions than a block, it borrows scratch."""
    ids, feats = features
    draft, allocator, scratch, in_place = scratch_and_in_place_drafters(runner, packed)
    borrowed = []
    real_extend = allocator.extend
    monkeypatch.setattr(allocator, "extend", lambda *a: borrowed.append(a[2]) or real_extend(*a))
    native = []
    real_native = draft.native_block_logits


    def spy(*args):  # counts the blocks the C++ stack ran
        out = real_native(*args)
        native.extend([] if out is None else [1])
        return out

    monkeypatch.setattr(draft, "native_block_logits", spy)
    table, reqs = two_prefilled_requests((scratch, in_place), real_extend, ids, feats)
    free = allocator.num_free_slots
    results = []
    for batch in (reqs[1:], reqs):
        borrowed.clear()
        got = in_place.draft_blocks(batch, table)
        results.append(got)
        assert not borrowed
        expected = scratch.draft_blocks(batch, table)
        assert borrowed == [BLOCK * len(batch)]
        assert torch.equal(got, expected)
        for logits, r in zip(got, batch):
            n = r.committed_len
            torch.testing.assert_close(logits, dense_block_logits(draft, runner, feats[:n], torch.arange(n), r.root, n),
                                       rtol=1e-4, atol=1e-4)
    assert bool(native) == packed
    assert torch.equal(in_place.draft_blocks(reqs, table), got)  # the context K/V were left alone
    borrowed.clear()
    narrow = table[:, :len(ids) + BLOCK - 1].contiguous()  # the second block would pass the table's end
    assert torch.equal(in_place.draft_blocks(reqs, narrow), got) and borrowed == [2 * BLOCK]
    short = DFlashDrafter(runner, draft, BLOCK, None, allocator, reserved=BLOCK - 1)
    short.after_prefill([SpecInput("r1", 1, 0, ids, 0)], feats, [11], table)
    borrowed.clear()
    assert torch.equal(short.draft_blocks(reqs[1:], table), results[0]) and borrowed == [BLOCK]
    assert allocator.num_free_slots == free  # every borrowed scratch slot went back


@pytest.mark.parametrize("packed,prev,position_masks", [(False, False, False), (True, False, False), (False, True, False),
                                                        (True, True, False), (False, True, True), (True, True, True)])
def test_known_tokens_after_the_root_give_the_oracles_logits(runner, features, packed, prev, position_masks):
    """A block holding known tokens after its root (a grammar's forced text, for a draft trained with
    known prefixes) reads their embeddings where it would read the mask's (prev: and each row after a
    known token or the root also reads that token through prev_proj; position_masks: each mask row its
    position's own mask vector): in place and in scratch slots, native and torch, alone and beside a
    block without any, the oracle's logits; the training forward with the same block ids too."""
    ids, feats = features
    draft, allocator, scratch, in_place = scratch_and_in_place_drafters(runner, packed, prev, position_masks)
    table, reqs = two_prefilled_requests((scratch, in_place), allocator.extend, ids, feats)
    known = [[], [3, 9]]
    for drafter in (in_place, scratch):
        got = drafter.draft_blocks(reqs, table, known)
        for logits, r, k in zip(got, reqs, known):
            n = r.committed_len
            expected = dense_block_logits(draft, runner, feats[:n], torch.arange(n), r.root, n, known=k)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        without = drafter.draft_blocks(reqs, table)
        assert torch.equal(got[0], without[0]) and not torch.allclose(got[1], without[1])
    # In place the packed draft runs its C++ path, in scratch slots its forward: the same bits.
    assert torch.equal(in_place.draft_blocks(reqs, table, known), scratch.draft_blocks(reqs, table, known))
    assert torch.equal(in_place.draft_blocks(reqs, table), scratch.draft_blocks(reqs, table))
    trainable = random_draft(runner.config, num_layers=1, seed=2, root_context=True, prev=prev,
                             position_masks=position_masks)
    trainable = trainable.bind_target(runner.model)
    anchors = torch.tensor([[4, 17]])
    block_ids = torch.tensor([[[ids[4], MASK_ID, MASK_ID, MASK_ID, MASK_ID], [ids[17], 3, 9, MASK_ID, MASK_ID]]])
    with torch.no_grad():
        logits = trainable.forward_train(torch.tensor([ids]), feats[None], anchors, block_ids=block_ids)
    for j, (a, k) in enumerate([(4, []), (17, [3, 9])]):
        expected = dense_block_logits(trainable, runner, feats[:a], torch.arange(a), ids[a], a, known=k)
        torch.testing.assert_close(logits[0, j], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("float32", "int8"), ("bfloat16", None),
                                                ("bfloat16", "int8")])
def test_the_cpp_block_from_host_lists_gives_the_forwards_bits(tiny_model_dir, tmp_path, dtype, quantization,
                                                                 monkeypatch):
    """A loaded draft (root context, previous-token rows) drafting in place runs its block as two C++ calls
    (csrc/dflash_block.cpp's input rows, the layer stack from host lists): for float32 and bfloat16 targets, float
    and int8 draft weights, one block or two of different context lengths, with known tokens (more than a block
    holds, too) and without, the logits of the same blocks through ``forward`` in scratch slots, bit for bit."""
    runner = load_runner(tiny_model_dir, dtype=dtype, tokens=512)
    ids = torch.randint(0, 2000, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    from specjet.models.forward_batch import FeatureLayers

    feats = OneRequest(runner).extend(ids, capture=FeatureLayers((0,))).hidden.clone()
    save_dflash(random_draft(runner.config, root_context=True, prev=True), tmp_path / "d", dtype=torch.float32)
    draft = load_dflash(tmp_path / "d", runner.config, dtype=getattr(torch, dtype))
    allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")
    scratch = DFlashDrafter(runner, draft, BLOCK, None, allocator, quantization=quantization)
    in_place = DFlashDrafter(runner, draft, BLOCK, None, allocator, quantization=quantization, reserved=BLOCK)
    assert draft._block_projections is not None and (quantization is None) == (
        draft.root_proj.packed.__class__.__name__ != "QuantizedLinear")
    ran = []
    real = draft.native_block_logits
    monkeypatch.setattr(draft, "native_block_logits", lambda *a: ran.append(1) or real(*a))
    table, reqs = two_prefilled_requests((scratch, in_place), allocator.extend, ids, feats)
    free = allocator.num_free_slots
    for batch, known in [(reqs[1:], None), (reqs[1:], [[3, 9]]), (reqs, None), (reqs, [[], [3, 9]]),
                         (reqs, [[4], [3, 9, 1, 2, 8, 6]])]:
        got = in_place.draft_blocks(batch, table, known)
        assert torch.equal(got, scratch.draft_blocks(batch, table, known)), (len(batch), known)
    assert len(ran) == 5
    assert allocator.num_free_slots == free  # the scratch blocks gave their slots back; in place borrows none
    # What the rows hold matters: another known token changes its block's logits.
    assert not torch.equal(in_place.draft_blocks(reqs[1:], table, [[3, 10]]), in_place.draft_blocks(reqs[1:], table,
                                                                                                       [[3, 9]]))


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("change, match", [
    ({"roots": [10 ** 6]}, "token id"),
    ({"known": [[1], [2]]}, "every block"),
    ({"size": 1}, "at least 2 rows"),
    ({"root_ctx": None}, "come together"),
    ({"root_ctx": "wide"}, "root_ctx"),
    ({"mask_rows": "short"}, "mask_rows"),
    ({"root_proj": "wide"}, "columns"),  # wider than the rows: overflowed the scratch row (heap corruption)
    ({"prev_proj": "wide"}, "columns"),
])
def test_the_cpp_block_input_refuses_bad_arguments(runner, change, match):
    draft = random_draft(runner.config, root_context=True, prev=True).bind_target(runner.model)
    draft.pack_for_decode()
    root_op, prev_op = draft._block_projections
    h = runner.config.hidden_size
    args = dict(roots=[3], known=[[4, 5]], size=BLOCK, embed=runner.model.embed_tokens.weight,
                mask_rows=draft._mask_rows(BLOCK)[0], root_proj=root_op, root_ctx=torch.randn(1, h), prev_proj=prev_op)
    assert cpu_ops.extension().dflash_block_input(*args.values()).shape == (BLOCK, h)
    args.update(change)
    if isinstance(args["root_ctx"], str):
        args["root_ctx"] = torch.randn(1, h + 1)
    for name in ("root_proj", "prev_proj"):
        if isinstance(args[name], str):
            wide = Fp32Linear.build(torch.randn(h, 16 * (h // 16 + 2)))
            args[name] = cpu_ops.extension().fp32_projection(wide.weight, wide.bias, wide.isa)
    if isinstance(args["mask_rows"], str):
        args["mask_rows"] = draft._mask_rows(BLOCK)[0][:2]
    with pytest.raises(RuntimeError, match=match):
        cpu_ops.extension().dflash_block_input(*args.values())


def test_hot_vocabulary_draft_gives_the_oracles_hot_columns(runner, features, tmp_path):
    """A hot head: the block's logits are the full head's at the hot ids, the drafter's candidates
    are target ids, and the hot ids survive a checkpoint."""
    ids, feats = features
    hot = torch.arange(3, runner.config.vocab_size, 7)
    draft = random_draft(runner.config, hot=hot)
    save_dflash(draft, tmp_path / "hot", dtype=torch.float32)
    draft = load_dflash(tmp_path / "hot", runner.config)
    assert torch.equal(draft.hot_token_ids, hot) and read_dflash_config(tmp_path / "hot")["hot_vocab_size"] == len(hot)
    allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")
    drafter = DFlashDrafter(runner, draft, BLOCK, None, allocator, topk=2)
    n = len(ids)
    table = allocator.extend(torch.empty(0, dtype=torch.int64), 0, n + 8)[None, :]
    drafter.after_prefill([SpecInput("r", 0, 0, ids, 0)], feats, [11], table)
    logits = drafter.draft_blocks([SpecInput("r", 0, n, ids + [11], 8)], table)[0]
    expected = dense_block_logits(draft, runner, feats, torch.arange(n), 11, n)
    torch.testing.assert_close(logits, expected[:, hot], rtol=1e-4, atol=1e-4)
    candidates = drafter._candidates(None, [], logits, BLOCK - 1)
    best = expected[:, hot].topk(2, dim=-1).indices
    assert [[t for t, _ in c] for c in candidates] == hot[best].tolist()


def test_past_the_blocks_end_a_chain_takes_the_grammars_forced_text(runner, default_model_dir):
    """Under a grammar the block's positions give the first drafts (each the best legal token); where
    the grammar still forces text after them, its tokens follow as sure ones (log-prob 0), in the
    tokenizer's split, up to the tree's budget."""
    from transformers import AutoTokenizer

    from specjet.grammar import GrammarBackend, RequestGrammar
    from specjet.spec_v2.grammar_guide import GrammarGuide

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocab = runner.config.vocab_size
    backend = GrammarBackend(tokenizer, vocab)
    try:
        grammar = RequestGrammar(backend.compile("regex", "(a|b)c, then this text is forced( x| y)").result())
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        guide = GrammarGuide(grammar, vocab, encode)
        allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")
        drafter = DFlashDrafter(runner, random_draft(runner.config), BLOCK, None, allocator, topk=1)
        logits = torch.zeros(BLOCK - 1, vocab)
        logits[0, encode("b")[0]] = 5.0  # the first position's choice; later ones: whatever is legal
        chain = drafter._candidates(guide, [], logits, 32)
        tokens = [c[0][0] for c in chain]
        drafted = tokenizer.decode(tokens[:BLOCK - 1])
        full = "bc, then this text is forced "  # the space both endings start with is forced too
        assert drafted.startswith("b") and full.startswith(drafted)
        rest = encode(full[len(drafted):])[:-1]  # its last token may merge with " x" / " y"
        assert rest and tokens[BLOCK - 1:] == rest
        assert all(lp == 0.0 for c in chain[BLOCK - 1:] for _, lp in c)
        assert [c[0][0] for c in drafter._candidates(guide, [], logits, BLOCK + 1)] == tokens[:BLOCK + 1]
        # Without a grammar, or with the tail off (quantized targets' default), the chain ends with the block.
        assert len(drafter._candidates(None, [], logits, 32)) == BLOCK - 1
        drafter.forced_tail = False
        assert [c[0][0] for c in drafter._candidates(guide, [], logits, 32)] == tokens[:BLOCK - 1]
    finally:
        backend.shutdown()


@pytest.mark.parametrize("root_context, group", [(False, 8), (True, 8), (True, 1), (False, 3)])
def test_training_forward_equals_the_dense_oracle(runner, features, root_context, group, monkeypatch):
    """Three blocks of one sequence (and a padded slot) in one training forward, each isolated:
    block j sees the context before its root (or the last ``window``) and itself only. The attention
    runs ``group`` anchors a call (unsorted anchors here: a group sees context up to its last root)."""
    import specjet.models.dflash as M

    monkeypatch.setattr(M, "TRAIN_ATTENTION_GROUP", group)
    ids, feats = features
    draft = random_draft(runner.config, num_layers=1, seed=2, root_context=root_context).bind_target(runner.model)
    anchors = torch.tensor([[4, 17, -1, 10]])
    for window in (None, 5):
        with torch.no_grad():
            logits = draft.forward_train(torch.tensor([ids]), feats[None], anchors, window=window)
        assert logits.shape == (1, 4, BLOCK - 1, runner.config.vocab_size)
        for j, a in enumerate(anchors[0].tolist()):
            if a < 0:
                continue
            first = 0 if window is None else max(0, a - window)
            expected = dense_block_logits(draft, runner, feats[first:a], torch.arange(first, a), ids[a], a)
            torch.testing.assert_close(logits[0, j], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_training_attention_is_sdpas(heads, kv_heads, autocast):
    """The training forward's written-out attention (grouped query heads, float32 scores) against torch's SDPA
    with the same boolean mask: outputs and the gradients of q, k and v, in float32 and under bf16 autocast on
    bf16 inputs (there within bf16's rounding: the two round the weights at different points)."""
    from specjet.models.dflash import _masked_attention

    gen = torch.Generator().manual_seed(heads)
    batch, rows, keys, dim = 3, 16, 40, 64
    dtype = torch.bfloat16 if autocast else torch.float32
    q = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype).requires_grad_()
    visible = torch.rand(batch, rows, keys, generator=gen) < 0.6
    visible[:, :, -1] = True  # every row sees a key (as a block sees itself)
    visible[0, 3] = False
    visible[0, 3, 7] = True  # a row that sees one key
    grad_out = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    results = []
    for attend in (lambda: _masked_attention(q, k, v, visible, 0.125),
                   lambda: torch.nn.functional.scaled_dot_product_attention(
                       q, k, v, attn_mask=visible[:, None], scale=0.125, enable_gqa=heads != kv_heads)):
        q.grad = k.grad = v.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attend()
        out.backward(grad_out)
        results.append([out.detach().float()] + [t.grad.float() for t in (q, k, v)])
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(results[0][0][0, :, 3], v[0, :, 7].detach().float().repeat_interleave(heads // kv_heads, 0),
                               rtol=0, atol=1e-6)  # one visible key: its value


def test_static_buffers_give_the_eager_logits(runner, features):
    """The draft runner's path (a batch padded to its bucket on static buffers, table widths
    rounded up) gives the eager forward's logits bit for bit, for batches of 1 to 3 (buckets 1, 2,
    4); the padded rows write only the padding slot, and the scratch slots go back."""
    ids, feats = features
    draft = random_draft(runner.config, root_context=True)
    draft.pack_for_decode()  # as load_dflash leaves it: the batch-invariant packed projections
    allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")
    eager = DFlashDrafter(runner, draft, BLOCK, None, allocator)
    static = DFlashDrafter(runner, draft, BLOCK, None, allocator, static=True)
    table = torch.zeros(3, 64, dtype=torch.int64)
    reqs = []
    for row, (n, first) in enumerate([(23, 11), (12, 5), (17, 3)]):
        table[row, :n + 8] = allocator.extend(torch.empty(0, dtype=torch.int64), 0, n + 8)
        for drafter in (eager, static):
            drafter.after_prefill([SpecInput(f"r{row}", row, 0, ids[:n], 0)], feats[:n], [first], table)
        reqs.append(SpecInput(f"r{row}", row, n, ids[:n] + [first], 8))
    before = allocator.num_free_slots
    for batch in (1, 2, 3):
        expected = eager.draft_blocks(reqs[:batch], table)
        got = static.draft_blocks(reqs[:batch], table)
        assert torch.equal(got, expected), batch
    assert allocator.num_free_slots == before
    assert static.graph.stats.padded_rows == 1 and static.graph.stats.calls == 3
    assert not static.graph.capture  # no CUDA graphs on the CPU


@pytest.mark.parametrize("prev,position_masks", [(False, False), (True, False), (True, True)])
def test_checkpoint_round_trip(runner, tmp_path, prev, position_masks):
    draft = random_draft(runner.config, prev=prev, position_masks=position_masks)
    save_dflash(draft, tmp_path / "d", training={"steps": 3}, dtype=torch.float32)
    meta = read_dflash_config(tmp_path / "d")
    assert (meta["num_layers"], meta["target_layers"], meta["block_size"], meta["mask_token_id"]) == (2, [0], BLOCK, MASK_ID)
    assert meta["prev_token_input"] == prev and (draft.prev_proj is not None) == prev
    assert meta["position_masks"] == position_masks
    assert draft.mask_embedding.shape == ((BLOCK - 1, runner.config.hidden_size) if position_masks
                                          else (runner.config.hidden_size,))
    assert meta["training"] == {"steps": 3} and meta["target"]["num_layers"] == runner.config.num_layers
    loaded = load_dflash(tmp_path / "d", runner.config)
    for (name, p), q in zip(draft.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(FileNotFoundError):
        read_dflash_config(tmp_path / "nothing")


def test_position_masks_in_smaller_and_longer_blocks(runner, features):
    """A position-mask draft in a smaller block reads its first mask vectors, in a longer one the last
    trained vector past its end: the oracle's logits either way."""
    ids, feats = features
    draft, allocator = draft_and_allocator(runner, packed=False, position_masks=True)
    n = len(ids)
    table = torch.zeros(1, 64, dtype=torch.int64)
    table[0, :n + BLOCK + 2] = allocator.extend(torch.empty(0, dtype=torch.int64), 0, n + BLOCK + 2)
    for size in (BLOCK - 2, BLOCK + 2):
        drafter = DFlashDrafter(runner, draft, size, None, allocator)
        drafter.after_prefill([SpecInput("r", 0, 0, ids, 0)], feats, [11], table)
        logits = drafter.draft_blocks([SpecInput("r", 0, n, ids + [11], 8)], table)[0]
        expected = dense_block_logits(draft, runner, feats, torch.arange(n), 11, n, size=size)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_default_target_layers_spread_over_the_stack():
    spread = default_target_layers(30, 5)
    assert len(spread) == 5 and spread[0] == 1 and spread[-1] == 27  # 1 .. L - 3, evenly
    assert all(6 <= b - a <= 7 for a, b in zip(spread, spread[1:]))
    assert default_target_layers(36, 1) == (1,)
    assert default_target_layers(2, 3) == (0,)  # a 2-layer target has one layer below its last
    for n in (4, 12, 30):
        layers = default_target_layers(n, 4)
        assert all(0 <= i < n - 1 for i in layers) and list(layers) == sorted(set(layers))


def test_block_tree_ranks_paths_and_keeps_parents_first():
    """Per-position candidates -> a tree: any node at depth i may continue with position i + 1's
    candidates (a runner-up too), the best budget - 1 paths by log-probability, parents first
    (worked out by hand)."""
    from specjet.spec_v2.dflash_drafter import _tree

    candidates = [[(10, -0.1), (11, -1.0)], [(20, -0.2), (21, -0.5)], [(30, -3.0)]]
    # path scores: 10: -0.1, 10-20: -0.3, 10-21: -0.6, 11: -1.0, 11-20: -1.2, 11-21: -1.5,
    # 10-20-30: -3.3, 10-21-30: -3.6, 11-20-30: -4.2, 11-21-30: -4.5
    assert _tree(1, candidates, 5) == ([1, 10, 20, 21, 11], [-1, 0, 1, 1, 0])
    assert _tree(1, candidates, 9) == ([1, 10, 20, 21, 11, 20, 21, 30, 30], [-1, 0, 1, 1, 0, 4, 4, 2, 3])
    assert _tree(1, candidates, 99) == ([1, 10, 20, 21, 11, 20, 21, 30, 30, 30, 30], [-1, 0, 1, 1, 0, 4, 4, 2, 3, 5, 6])
    assert _tree(1, candidates, 1) == ([1], [-1])
    chain = [[(5, 0.0)], [(6, -0.2)], [(7, -0.1)]]  # one candidate each: the chain
    assert _tree(1, chain, 16) == ([1, 5, 6, 7], [-1, 0, 1, 2])


def test_block_tree_leaves_out_unlikely_nodes():
    """speculative_draft_min_prob: a node whose path probability is below the cut is not verified,
    nor anything under it; a sure (forced) token scores 0 and is always kept."""
    import math

    from specjet.spec_v2.dflash_drafter import _tree

    candidates = [[(10, -0.1), (11, -1.0)], [(20, -0.2), (21, -0.5)], [(30, -3.0)]]
    # path scores: 10: -0.1, 11: -1.0, 20: -0.3, 21: -0.6, 30: -3.3
    assert _tree(1, candidates, 9, math.log(0.5)) == ([1, 10, 20, 21], [-1, 0, 1, 1])
    assert _tree(1, candidates, 9, math.log(0.7)) == ([1, 10, 20], [-1, 0, 1])
    assert _tree(1, candidates, 9, math.log(0.8)) == ([1, 10], [-1, 0])
    assert _tree(1, candidates, 9, math.log(0.95)) == ([1], [-1])  # a plain decode step
    assert _tree(1, candidates, 3, math.log(0.01)) == ([1, 10, 20], [-1, 0, 1])  # the budget still caps
    sure = [[(5, 0.0)], [(6, 0.0)], [(7, -2.0)]]
    assert _tree(1, sure, 16, math.log(0.9)) == ([1, 5, 6], [-1, 0, 1])


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
def test_a_packed_draft_runs_its_layers_as_one_cpp_call_with_the_loops_bits(runner, features, monkeypatch):
    """pack_for_decode builds the draft's layer stack (models/llama.py native_layer_stack); a drafting
    forward through it gives, bit for bit, the logits of the same layers called one by one."""
    ids, feats = features
    draft = random_draft(runner.config, root_context=True)
    draft.pack_for_decode()
    assert draft.layer_stack is not None and len(draft.layer_stack) == 2
    calls = count_stack_runs(monkeypatch)
    allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, 1, "cpu")
    drafter = DFlashDrafter(runner, draft, BLOCK, None, allocator)
    n = len(ids)
    table = torch.zeros(1, 64, dtype=torch.int64)
    table[0, : n + 8] = allocator.extend(torch.empty(0, dtype=torch.int64), 0, n + 8)
    drafter.after_prefill([SpecInput("r", 0, 0, ids, 0)], feats, [11], table)
    block = [SpecInput("r", 0, n, ids + [11], 8)]
    stacked = drafter.draft_blocks(block, table)[0]
    assert calls["ran"] == 1
    stack, draft.layer_stack = draft.layer_stack, None
    looped = drafter.draft_blocks(block, table)[0]
    assert calls["ran"] == 1 and torch.equal(stacked, looped)
    draft.layer_stack = stack
