"""DFLASH speculative decoding is lossless whatever the draft: exact token ids against the plain path
for mixed batches, page sizes 1 and 16, block sizes 4 / 8 / 16, a context window, the overlap loop
on and off, cuts by max_new_tokens and stop strings mid-block, retraction; the target's
distribution under sampling; constrained requests (grammar-aware drafting on and off) against plain
constrained decoding, every output valid; the KV invariant after every workload.

Two drafts on a tiny cyclic target (its greedy output repeats a token for long runs): a random one
(always wrong) and a hand-built "copy" draft that predicts the root at every block position, so
whole blocks are accepted and the accepted-context path (draft KV from the verify's features) and
the cuts inside a block are exercised."""
from __future__ import annotations

import collections

import pytest
import torch

import specjet
from conftest import make_tiny_model_dir
from specjet.models.config import ModelConfig
from specjet.models.dflash import DFlashDraftModel, DFlashShape, save_dflash
from test_spec_eagle import PROMPTS, greedy, run_eager_and_static
from test_spec_grammar import MIXED, REGEX, backend, check_valid, masked_two_token_tv  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic"), default_model_dir, weight_std=0.05)


@pytest.fixture(scope="module")
def expected(plain):
    return [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40))]


def _config(model_dir) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))


def make_wrong_draft(path, model_dir, num_layers: int = 2, block_size: int = 16):
    """A random DFlash draft (DFlash as published): its blocks are wrong, so whatever is accepted came from
    elsewhere (an n-gram path, a prediction)."""
    torch.manual_seed(0)
    draft = DFlashDraftModel(_config(model_dir), DFlashShape(num_layers, (0,), block_size, 0))
    draft.reset_parameters(std=0.3)
    return save_dflash(draft, path, dtype=torch.float32)


@pytest.fixture(scope="module")
def wrong_draft(tmp_path_factory, tiny_model_dir):
    return make_wrong_draft(tmp_path_factory.mktemp("wrong-dflash"), tiny_model_dir)


@pytest.fixture(scope="module")
def wrong_position_draft(tmp_path_factory, tiny_model_dir):
    """A random draft with every specjet addition to the block's inputs, a mask vector per position among them."""
    torch.manual_seed(1)
    draft = DFlashDraftModel(_config(tiny_model_dir), DFlashShape(2, (0,), 16, 0, root_context=True, known_prefix=True,
                                                                  prev_token_input=True, position_masks=True))
    draft.reset_parameters(std=0.3)
    return save_dflash(draft, tmp_path_factory.mktemp("wrong-position-dflash"), dtype=torch.float32)


@pytest.fixture(scope="module")
def copy_draft(tmp_path_factory, tiny_model_dir):
    """With a root context (zero: still a copy draft), so every workload also runs the drafter's
    per-request root-context state; the wrong draft is DFlash as published."""
    return make_copy_draft(tmp_path_factory.mktemp("copy-dflash"), tiny_model_dir, root_context=True)


@pytest.fixture(scope="module")
def copy_draft_hot(tmp_path_factory, tiny_model_dir, expected):
    """The copy draft with a hot vocabulary of the tokens the target says (and a few more)."""
    hot = torch.tensor(sorted({t for ids in expected for t in ids} | {0, 1, 2}))
    return make_copy_draft(tmp_path_factory.mktemp("copy-dflash-hot"), tiny_model_dir, hot)


def make_copy_draft(path, tiny_model_dir, hot=None, root_context=False, sharpness=1.0):
    """Every block position predicts the root. With the context, the mask embedding and every query
    zero, attention is uniform and only the root's value is non-zero, so each mask position gets
    the root's normed embedding, half of its coordinates per layer (a value is half as wide as the
    hidden state here); the tied LM head then ranks the root first. ``sharpness`` scales the final
    norm, so the logits: at 1 the root's probability is tiny beside a random model's vocabulary (every
    node under a confidence cut), at 10 close to 1 (the blocks pass the engine's default cut)."""
    cfg = _config(tiny_model_dir)
    draft = DFlashDraftModel(cfg, DFlashShape(2, (0,), 16, 0, root_context), hot_token_ids=hot)
    d, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    assert kv * 2 == cfg.hidden_size
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("weight_t") or name == "mask_embedding":
                p.zero_()
        for layer_id, layer in enumerate(draft.layers):
            qkv, o = layer.self_attn.qkv_proj.weight_t, layer.self_attn.o_proj.weight_t
            for i in range(kv):  # v = this layer's half of the input
                qkv[layer_id * kv + i, q + kv + i] = 1.0
            for g in range(cfg.num_kv_heads):  # the first query head of each group writes it back
                for j in range(d):
                    o[g * group * d + j, layer_id * kv + g * d + j] = 1.0
        draft.norm.weight.mul_(sharpness)
    return save_dflash(draft, path, dtype=torch.float32)


def dflash_engine(model_dir, draft, **kw):
    kw.setdefault("max_total_tokens", 4096)
    # The draft's own blocks, whole, unless a test merges n-grams in or cuts unlikely nodes.
    kw.setdefault("speculative_hybrid_ngram_tokens", 0)
    kw.setdefault("speculative_draft_min_prob", 0.0)
    # Every iteration drafts (tests/test_draft_payoff.py covers drafting only while it pays, which
    # depends on timings): drafts and acceptance compare across engines.
    kw.setdefault("speculative_measured_payoff", False)
    return specjet.Engine(model_path=str(model_dir), speculative_algorithm="DFLASH",
                          speculative_draft_model_path=str(draft), **kw)


@pytest.mark.parametrize("draft_name,page_size,block,overlap,window,topk", [
    ("copy", 1, 4, True, None, 1), ("copy", 16, 8, True, None, 1), ("copy", 1, 16, False, None, 1),
    ("copy", 16, 16, True, 3, 1), ("wrong", 16, 8, False, None, 1), ("wrong", 1, 16, True, 5, 1),
    ("copy", 16, 8, True, None, 3), ("wrong", 1, 8, True, None, 4), ("copy-hot", 1, 8, True, None, 2),
    ("wrong-position", 16, 8, True, None, 1), ("wrong-position", 1, 16, False, None, 3)])
def test_greedy_equals_plain(tiny_model_dir, copy_draft, copy_draft_hot, wrong_draft, wrong_position_draft, expected,
                             draft_name, page_size, block, overlap, window, topk):
    """topk > 1: trees (each block position's runners-up beside the chain), verified as any tree;
    copy-hot: a draft with a hot vocabulary; wrong-position: a mask vector per block position."""
    draft = {"copy": copy_draft, "copy-hot": copy_draft_hot, "wrong": wrong_draft,
             "wrong-position": wrong_position_draft}[draft_name]
    with dflash_engine(tiny_model_dir, draft, page_size=page_size, speculative_num_draft_tokens=block,
                       disable_overlap_schedule=not overlap, speculative_dflash_draft_window_size=window,
                       speculative_eagle_topk=topk) as eng:
        outs = eng.generate(PROMPTS, greedy(40))
        alone = eng.generate(PROMPTS[2], greedy(40))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert alone["output_ids"] == expected[2]
    if draft_name.startswith("copy"):  # whole runs of a block are accepted (a tree's spine is shorter)
        assert stats["spec_accepted_tokens"] > min(block // topk, 4) / 2 * stats["spec_verify_ct"], stats
    else:
        assert stats["spec_accepted_tokens"] < 1.2 * stats["spec_verify_ct"], stats


@pytest.mark.parametrize("draft_name", ["copy", "wrong", "wrong-position"])
def test_static_draft_runner_drafts_what_eager_drafts(tiny_model_dir, copy_draft, wrong_draft, wrong_position_draft,
                                                      expected, draft_name):
    """speculative_draft_runner="static": each block forward padded to a batch bucket on static
    buffers (5 requests in bucket 8; one alone in bucket 1). Same ids as plain decoding, and the
    same acceptance as the eager runner: the drafts themselves are the same."""
    draft = {"copy": copy_draft, "wrong": wrong_draft, "wrong-position": wrong_position_draft}[draft_name]
    stats = run_eager_and_static(lambda mode: dflash_engine(
        tiny_model_dir, draft, speculative_num_draft_tokens=8, page_size=16, speculative_draft_runner=mode), expected)
    counts = [(s["spec_accepted_tokens"], s["spec_verify_ct"]) for s in stats.values()]
    assert counts[0] == counts[1], counts


def test_ngram_path_merged_into_blocks_is_lossless_and_accepts_more(tiny_model_dir, wrong_draft, expected):
    """speculative_hybrid_ngram_tokens with DFLASH: an always-wrong draft alone commits one token per
    verify; with the request's n-gram path merged in it commits more on this cyclic target."""
    from bench.engine_info import describe_engine, spec_str

    accept = {}
    for extra in (0, 4):
        with dflash_engine(tiny_model_dir, wrong_draft, speculative_num_draft_tokens=8, speculative_eagle_topk=1,
                           speculative_hybrid_ngram_tokens=extra, speculative_draft_model_quantization=None) as eng:
            outs = eng.generate(PROMPTS, greedy(40))
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
            if extra:
                cap = ", at most 32 nodes per verify" if eng.worker.device.type == "cpu" else ""  # float CPU targets
                tile = ", learned drafts alone within 16 nodes" if eng.worker.runner.tiled_rows else ""  # AMX bf16
                assert (spec_str(describe_engine(eng)["speculative"])
                        == f"DFLASH block=8 topk=1 + 4 n-gram nodes{cap}{tile}, float draft weights")
        assert [o["output_ids"] for o in outs] == expected
        accept[extra] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
    assert accept[0] < 1.2 and accept[4] > 1.5, accept


def test_min_prob_cuts_unlikely_block_nodes_and_stays_lossless(tiny_model_dir, copy_draft, expected):
    """speculative_draft_min_prob: the copy draft's blocks are accepted in long runs without a cut;
    a cut above every draft probability verifies the root alone (one token per verify), a low one
    keeps the block's likely head; the ids never change."""
    accept = {}
    for min_prob in (0.0, 1e-6, 1.0):
        with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8, speculative_eagle_topk=2,
                           speculative_draft_min_prob=min_prob) as eng:
            outs = eng.generate(PROMPTS, greedy(40))
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == expected
        accept[min_prob] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
    # 1e-6 still cuts the tail of the copy draft's blocks (a product of 7 modest probabilities)
    assert accept[1.0] == 1.0 and accept[0.0] > 2 and 1.5 < accept[1e-6] <= accept[0.0], accept


def test_cuts_stops_and_retraction(tiny_model_dir, copy_draft, plain, expected):
    text = plain.generate(PROMPTS[0], greedy(40))["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    ref_stop = plain.generate(PROMPTS[0], greedy(40, stop=[stop]))
    from bench.engine_info import describe_engine, spec_str

    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8, speculative_eagle_topk=1,
                       speculative_draft_model_quantization="int8", device="cpu") as eng:  # int8: CPU kernels
        tile = ", learned drafts alone within 16 nodes" if eng.worker.runner.tiled_rows else ""  # AMX bf16 targets
        assert (spec_str(describe_engine(eng)["speculative"])
                == f"DFLASH block=8 topk=1, at most 32 nodes per verify{tile}, int8 draft weights")
        for n in (1, 2, 5, 11):  # budgets that end inside a block
            assert eng.generate(PROMPTS[0], greedy(n))["output_ids"] == expected[0][:n]
        out = eng.generate(PROMPTS[0], greedy(40, stop=[stop]))
        assert out["output_ids"] == ref_stop["output_ids"] and out["text"] == ref_stop["text"]
        eng.check_kv_invariant()
    with dflash_engine(tiny_model_dir, copy_draft, max_total_tokens=320, page_size=16,
                       speculative_num_draft_tokens=8) as small:
        outs = small.generate(PROMPTS * 2, greedy(40))
        small.check_kv_invariant()
        assert small.get_server_info()["stats"]["retractions"] > 0
    assert [o["output_ids"] for o in outs] == expected * 2


@pytest.mark.parametrize("min_prob", [0.0, 1e-4], ids=["whole-block", "cut"])  # 1e-4 cuts the copy draft's tail
def test_sampling_matches_the_target_distribution(tiny_model_dir, copy_draft, min_prob):
    from test_spec_ngram import exact_two_token_distribution

    """1000 seeded draws of three tokens: the (t1, t2) histogram is within a small total variation of
    the exact top-k distribution (HF transformers). The copy draft proposes t2 = t1, which the
    target gives only part of the time: a sampler that took drafts too readily would fail."""
    prompt = PROMPTS[0]
    n = 1000
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=4, speculative_draft_min_prob=min_prob,
                       dtype="float32") as eng:
        ids = eng.tokenizer(prompt)["input_ids"]
        params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True, "seed": s}
                  for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    accepted = sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs)
    exact = exact_two_token_distribution(tiny_model_dir, ids, top_k=3)
    counts = collections.Counter(tuple(o["output_ids"][:2]) for o in outs)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.07, tv
    assert accepted > n // 20


@pytest.mark.parametrize("draft_name,topk", [("copy", 1), ("wrong", 1), ("wrong", 3), ("copy-hot", 2)])
def test_constrained_equals_plain_constrained(tiny_model_dir, copy_draft, copy_draft_hot, wrong_draft, plain,
                                              draft_name, topk):
    """copy-hot: its hot vocabulary holds few if any tokens a schema allows, so past the forced chain
    a block position often has no legal hot token and the chain ends there: still the plain ids."""
    draft = {"copy": copy_draft, "copy-hot": copy_draft_hot, "wrong": wrong_draft}[draft_name]
    ref = plain.generate(PROMPTS[:4], MIXED)
    check_valid(ref, MIXED)
    accept = {}
    for aware in (True, False):
        with dflash_engine(tiny_model_dir, draft, speculative_num_draft_tokens=8, page_size=16,
                           speculative_grammar_aware=aware, speculative_eagle_topk=topk) as eng:
            outs = eng.generate(PROMPTS[:4], MIXED)
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref], aware
        check_valid(outs, MIXED)
        accept[aware] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
    # Grammar-aware: forced keys are sure tokens and every drafted token is legal, so it commits more.
    assert accept[True] > 1.3 and accept[True] > accept[False], accept


@pytest.mark.parametrize("topk", [1, 3])
def test_the_grammar_walk_stops_at_the_cut_with_the_same_tree(tiny_model_dir, copy_draft, plain, topk, monkeypatch):
    """Under a grammar the walk stops once the chain of best tokens falls below the request's cut: no path
    reaches past it, so the tree is the one the whole walk gives (chain and 3-wide lattice), the walk was
    shorter at least once, and the ids stay plain decoding's."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter, _tree

    compared = []
    real = DFlashDrafter._candidates

    def spy(self, guide, forced, logits, want, min_logp=float("-inf"), width=None):
        out = real(self, guide, forced, logits, want, min_logp, width)
        if guide is not None and min_logp > float("-inf"):
            whole = real(self, guide, forced, logits, want, -1e30, width)  # a cut no path reaches: the whole walk
            budget = want + 1
            compared.append((_tree(0, out, budget, min_logp) == _tree(0, whole, budget, min_logp),
                             len(out) < len(whole)))
        return out

    monkeypatch.setattr(DFlashDrafter, "_candidates", spy)
    ref = plain.generate(PROMPTS[:4], MIXED)
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8, speculative_eagle_topk=topk,
                       speculative_draft_min_prob=0.3) as eng:
        outs = eng.generate(PROMPTS[:4], MIXED)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert compared and all(same for same, _ in compared)
    assert any(shorter for _, shorter in compared)


def test_a_request_under_a_grammar_drafts_a_chain_by_default(tiny_model_dir, copy_draft, plain, monkeypatch):
    """Without speculative_eagle_topk the block is a 3-wide tree for free text and a chain (one
    candidate a position) under a grammar, except for a request decoding alone on a target whose bf16
    projections run on AMX tiles (tests/test_spec_config.py); the ids stay plain decoding's."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    trees = []  # (guided?, batch size, parents) of every proposed tree
    real = DFlashDrafter.propose

    def spy(self, reqs, share, req_to_token):
        out = real(self, reqs, share, req_to_token)
        trees.extend((r.guide is not None, len(reqs), parents) for r, (_, parents) in zip(reqs, out))
        return out

    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    ref = plain.generate(PROMPTS[:4], MIXED)
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8) as eng:
        dflash = eng.worker.speculator.cfg.dflash
        outs = eng.generate(PROMPTS[:4], MIXED)
        eng.check_kv_invariant()
        tiled = eng.worker.runner.tiled_rows
    assert (dflash.topk, dflash.grammar_topk) == (3, 1)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]

    def branches(parents):  # some node has two children
        return len(set(parents[1:])) < len(parents) - 1

    guided = [parents for g, n, parents in trees if g and (n > 1 or not tiled)]
    free = [parents for g, _, parents in trees if not g]
    assert guided and not any(branches(p) for p in guided)
    assert any(len(p) > 2 for p in guided)  # chains of several drafted tokens, not just a root
    assert free and any(branches(p) for p in free)


@pytest.fixture(scope="module")
def plain_cpu_mixed(tiny_model_dir):
    """Plain decoding's outputs of PROMPTS[:4] under MIXED on the CPU, and of PROMPTS[2] alone."""
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu",
                        disable_guided_drafting=True) as plain_cpu:
        ref = plain_cpu.generate(PROMPTS[:4], MIXED)
        alone = plain_cpu.generate(PROMPTS[2], MIXED[2])
        plain_cpu.check_kv_invariant()
    return ref, alone


def test_the_default_cut_of_a_free_text_tree_grows_with_the_batch(tiny_model_dir, copy_draft, plain_cpu_mixed,
                                                                  monkeypatch):
    """With the default confidence cut on a float CPU target the speculator hands each request the cut of its
    batch size: the base cut alone (or the tiled target's lone cut where it has one), or a constrained
    request in any batch; min_prob x batch / 2 for free text beside others. The ids stay plain's."""
    import math

    from specjet.spec_v2.config import DFLASH_MIN_DRAFT_PROB
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    seen = set()  # (batch size, constrained?, cut)
    real = DFlashDrafter.propose
    batch = verify_batch_sizes(monkeypatch)

    def spy(self, reqs, share, req_to_token):
        seen.update((batch[-1], r.guide is not None, round(math.exp(r.min_logp), 6)) for r in reqs)
        return real(self, reqs, share, req_to_token)

    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    ref, alone = plain_cpu_mixed
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8, device="cpu",
                       speculative_draft_min_prob=None) as eng:
        assert eng.worker.speculator.cfg.min_draft_prob_grows
        # Where bf16 projections run on AMX tiles (dtype auto on such a CPU), a lone request has its own cut.
        lone = eng.worker.speculator.cfg.alone.min_draft_prob
        lone_grammar = eng.worker.speculator.cfg.alone.grammar_min_draft_prob
        outs = eng.generate(PROMPTS[:4], MIXED)
        one = eng.generate(PROMPTS[2], MIXED[2])
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert one["output_ids"] == alone["output_ids"]
    base = DFLASH_MIN_DRAFT_PROB
    # How many of the 4 requests share a draft call depends on when the scheduler admits each and when
    # each ends (seen: 3 at most on one fast CPU), so any batch of 3 or more shows the growth.
    assert any(n >= 3 and not constrained and cut > base for n, constrained, cut in seen)
    assert any(n >= 3 and constrained for n, constrained, _ in seen)
    lone = base if lone is None else lone
    lone_grammar = base if lone_grammar is None else lone_grammar
    assert (1, False, round(lone, 6)) in seen
    assert all(cut == round((lone_grammar if n == 1 else base) if constrained
                            else lone if n == 1 else base * max(1, n / 2), 6)
               for n, constrained, cut in seen)


def verify_batch_sizes(monkeypatch) -> list[int]:
    """A list whose last element is, from then on, the batch size of the speculative iteration under way (the
    requests of its verify, drafting or not: a drafter sees only those whose trees go past their root)."""
    from specjet.spec_v2.speculator import Speculator

    sizes = [0]
    real = Speculator._run

    def run(self, reqs, *args):
        sizes.append(len(reqs))
        return real(self, reqs, *args)

    monkeypatch.setattr(Speculator, "_run", run)
    return sizes


def test_on_a_quantized_target_free_text_beside_others_verifies_its_root_alone(tiny_model_dir, copy_draft,
                                                                               monkeypatch):
    """int8 weights on the CPU (QUANTIZED_FREE_TEXT_DRAFT_BATCH): in a batch, a request without a grammar
    gets a root-only tree and no block forward, a constrained one still drafts; alone, free text drafts
    again. The ids are plain decoding's (same weights) in both."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    trees = []  # (batch, constrained?, nodes, block rows of free text) of every tree
    real_propose, real_blocks = DFlashDrafter.propose, DFlashDrafter.draft_blocks
    block_rows = []

    def spy(self, reqs, share, req_to_token):
        block_rows.clear()
        out = real_propose(self, reqs, share, req_to_token)
        free_rows = sum(block_rows)
        trees.extend((len(reqs), r.guide is not None, len(tokens), free_rows) for r, (tokens, _) in zip(reqs, out))
        return out

    def spy_blocks(self, reqs, req_to_token, known=None):
        block_rows.append(sum(r.grammar is None for r in reqs))
        return real_blocks(self, reqs, req_to_token, known)

    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    monkeypatch.setattr(DFlashDrafter, "draft_blocks", spy_blocks)
    kw = dict(device="cpu", quantization="int8", speculative_num_draft_tokens=4)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8",
                        disable_guided_drafting=True) as plain_q:
        ref = [o["output_ids"] for o in plain_q.generate(PROMPTS[:4], MIXED)]
        ref_alone = plain_q.generate(PROMPTS[2], MIXED[2])["output_ids"]
        plain_q.check_kv_invariant()
    with dflash_engine(tiny_model_dir, copy_draft, **kw) as eng:
        assert eng.worker.speculator.cfg.free_text_draft_batch == 1
        outs = [o["output_ids"] for o in eng.generate(PROMPTS[:4], MIXED)]
        batched = list(trees)
        alone = eng.generate(PROMPTS[2], MIXED[2])["output_ids"]
        eng.check_kv_invariant()
    assert outs == ref and alone == ref_alone
    assert all(n == 1 for size, constrained, n, _ in batched if size > 1 and not constrained)
    assert any(n > 1 for size, constrained, n, _ in batched if size > 1 and constrained)
    assert all(free == 0 for size, _, _, free in batched if size > 1)  # no block row for free text in a batch
    assert any(n > 1 for size, _, n, _ in trees[len(batched):] if size == 1)


def test_a_forced_chain_that_fills_the_block_needs_no_draft_forward(tiny_model_dir, copy_draft, plain, monkeypatch):
    """The regex's forced text ('hello world, ' twice) is longer than a block of 4 holds, and the
    n-gram path's budget lets the chain run past it: those iterations verify the chain without a
    block forward, and the ids stay plain decoding's."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    chains, drafted = [], []
    real_propose, real_blocks = DFlashDrafter.propose, DFlashDrafter.draft_blocks

    def propose(self, reqs, share, req_to_token):
        chains.append([len(r.chain) for r in reqs])
        return real_propose(self, reqs, share, req_to_token)

    def draft_blocks(self, reqs, req_to_token, known=None):
        drafted.append(len(reqs))
        return real_blocks(self, reqs, req_to_token, known)

    monkeypatch.setattr(DFlashDrafter, "propose", propose)
    monkeypatch.setattr(DFlashDrafter, "draft_blocks", draft_blocks)
    params = [greedy(40, regex=REGEX)]
    ref = plain.generate(PROMPTS[:1], params)
    plain.check_kv_invariant()
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=4,
                       speculative_hybrid_ngram_tokens=8) as eng:
        outs = eng.generate(PROMPTS[:1], params)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    check_valid(outs, params)
    assert any(n >= 3 for c in chains for n in c)  # the chain filled the block's 3 positions at least once
    assert sum(drafted) == sum(1 for c in chains for n in c if n < 3)


def test_a_draft_trained_with_known_prefixes_reads_the_forced_chain(tiny_model_dir, plain, tmp_path, monkeypatch):
    """A draft whose config says it was trained with known prefixes gets each request's forced chain
    in its block (this one also reads each row's previous token), one without gets masks only; either
    way the ids stay plain constrained decoding's and every output is valid."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    seen = []  # (known tokens handed to the block, the request's forced chain), per drafted block
    chains = {}
    proposed = []  # (a request's tokens so far, the tree drafted after them)
    real_propose, real_blocks = DFlashDrafter.propose, DFlashDrafter.draft_blocks

    def propose(self, reqs, share, req_to_token):
        chains.update({r.input.rid: r.chain for r in reqs})
        trees = real_propose(self, reqs, share, req_to_token)
        proposed.extend((tuple(r.input.token_ids), tree) for r, tree in zip(reqs, trees))
        return trees

    def draft_blocks(self, reqs, req_to_token, known=None):
        seen.extend(zip(known or [[] for _ in reqs], [chains[r.rid] for r in reqs]))
        return real_blocks(self, reqs, req_to_token, known)

    monkeypatch.setattr(DFlashDrafter, "propose", propose)
    monkeypatch.setattr(DFlashDrafter, "draft_blocks", draft_blocks)
    ref = plain.generate(PROMPTS[:4], MIXED)
    trees = {}
    # The static draft runner (padded batch buckets on static buffers: the CUDA-graph path's inputs,
    # eager here) takes the known tokens through its ids buffer: the same drafts as the eager runner.
    for known_prefix, runner in ((True, "eager"), (True, "static"), (False, "eager")):
        torch.manual_seed(1)
        draft = DFlashDraftModel(_config(tiny_model_dir), DFlashShape(2, (0,), 8, 0, True, known_prefix=known_prefix,
                                                                   prev_token_input=known_prefix))
        draft.reset_parameters(std=0.3)
        path = save_dflash(draft, tmp_path / f"{known_prefix}-{runner}", dtype=torch.float32)
        seen.clear()
        proposed.clear()
        # (topk given: a lone request's tree as wide as a batch's, where batches form differently by runner)
        with dflash_engine(tiny_model_dir, path, speculative_num_draft_tokens=8, page_size=16,
                           speculative_draft_runner=runner, speculative_eagle_topk=3) as eng:
            outs = eng.generate(PROMPTS[:4], MIXED)
            eng.check_kv_invariant()
        trees[(known_prefix, runner)] = sorted(proposed)  # batches may form differently
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
        check_valid(outs, MIXED)
        assert any(chain for _, chain in seen)  # some drafted blocks follow forced text
        if known_prefix:
            assert all(known == chain for known, chain in seen)
        else:
            assert not any(known for known, _ in seen)
    assert trees[(True, "eager")] == trees[(True, "static")]


@pytest.mark.parametrize("topk", [None, 4])
def test_sampling_with_forced_text_in_the_block_matches_the_masked_target(tiny_model_dir, backend, tmp_path,
                                                                         monkeypatch, topk):
    """Sampling with a draft that reads the grammar's forced text in its block (known prefixes and
    previous tokens, as the packaged draft): 1000 seeded draws under a regex that forces
    " and then " before each sampled letter; the (t1, t2) histogram matches the exact grammar-masked top-k
    distribution, and forced chains did reach the block. With topk 4 the block is a tree of 4 candidates a
    position under the grammar (as a lone constrained request's on an AMX bf16 target), not the chain."""
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    known_seen = []
    branched = []  # trees in which some node has two children
    real_blocks, real_propose = DFlashDrafter.draft_blocks, DFlashDrafter.propose

    def draft_blocks(self, reqs, req_to_token, known=None):
        known_seen.extend(k for k in known or [] if k)
        return real_blocks(self, reqs, req_to_token, known)

    def propose(self, reqs, share, req_to_token):
        trees = real_propose(self, reqs, share, req_to_token)
        branched.extend(parents for _, parents in trees if len(set(parents[1:])) < len(parents) - 1)
        return trees

    monkeypatch.setattr(DFlashDrafter, "draft_blocks", draft_blocks)
    monkeypatch.setattr(DFlashDrafter, "propose", propose)
    torch.manual_seed(2)
    draft = DFlashDraftModel(_config(tiny_model_dir), DFlashShape(2, (0,), 8, 0, True, known_prefix=True,
                                                               prev_token_input=True))
    draft.reset_parameters(std=0.3)
    path = save_dflash(draft, tmp_path / "known", dtype=torch.float32)
    regex = r"( and then [abc]){2,4}"
    prompt = PROMPTS[0]
    n = 1000
    # Every request's whole tree in one verify (a float CPU target caps the nodes of a verify, which
    # leaves the many requests here a chain of one token, filled by the forced text).
    with dflash_engine(tiny_model_dir, path, speculative_num_draft_tokens=8, speculative_max_verify_tokens=1 << 16,
                       dtype="float32", speculative_eagle_topk=topk) as eng:
        assert eng.worker.speculator.cfg.dflash.grammar_topk == (topk or 1)
        prompt_ids = eng.tokenizer(prompt)["input_ids"]
        # Room for a block after the forced chain: a tree is never longer than what the request may still say.
        params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 8, "regex": regex, "seed": s} for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    assert len(known_seen) > n // 20
    assert (len(branched) > n // 20) if topk else not branched
    tv = masked_two_token_tv(tiny_model_dir, backend, regex, prompt_ids, outs, top_k=3)
    assert tv < 0.07, tv


def test_without_a_draft_the_error_says_where_it_looked(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="DFlash draft model not found"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="DFLASH",
                       speculative_draft_model_path=str(tmp_path / "none"), max_total_tokens=256)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_lone_free_text_request_gets_the_tiled_targets_width_and_cut(tiny_model_dir, copy_draft, plain_cpu_mixed,
                                                                       monkeypatch, overlap):
    """Where the target's projections take rows in 16-row AMX tiles (forced here: the tiny model computes in
    float32), a request decoding alone gets TILED_BF16_ALONE_TOPK candidates a block position and the
    TILED_BF16_ALONE_MIN_DRAFT_PROB cut, under a grammar TILED_BF16_ALONE_GRAMMAR_TOPK and its cut; beside others
    free text keeps the usual 3 and the batch's cut, a grammar the chain and the usual cut. The ids stay plain
    decoding's, every constrained output valid, on the plain loop and the overlap loop."""
    import math

    from specjet.spec_v2 import config as spec_config
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    force_tiled_target(monkeypatch)
    seen = set()  # (batch size, constrained?, cut, most candidates at a block position past the forced ones)
    real = DFlashDrafter._candidates
    calls = []
    batch = verify_batch_sizes(monkeypatch)

    def candidates(self, guide, forced, logits, want, min_logp=-math.inf, width=None):
        out = real(self, guide, forced, logits, want, min_logp, width)
        calls.append(max((len(c) for c in out[len(forced):]), default=0))
        return out

    def spy(self, reqs, share, req_to_token):
        calls.clear()
        out = real_propose(self, reqs, share, req_to_token)
        for r, most in zip((r for r in reqs if len(r.chain) < r.budget - 1), calls):
            seen.add((batch[-1], r.guide is not None, round(math.exp(r.min_logp), 6), most))
        return out

    real_propose = DFlashDrafter.propose
    monkeypatch.setattr(DFlashDrafter, "_candidates", candidates)
    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    ref, alone = plain_cpu_mixed
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=8, device="cpu",
                       speculative_draft_min_prob=None, disable_overlap_schedule=not overlap) as eng:
        cfg = eng.worker.speculator.cfg
        assert (cfg.alone.topk, cfg.alone.min_draft_prob, cfg.dflash.topk) == (
            spec_config.TILED_BF16_ALONE_TOPK, spec_config.TILED_BF16_ALONE_MIN_DRAFT_PROB, 3)
        outs = eng.generate(PROMPTS[:4], MIXED)
        one = eng.generate(PROMPTS[2], MIXED[2])
        lone_constrained = [eng.generate(PROMPTS[i], MIXED[i]) for i in (0, 1)]
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert one["output_ids"] == alone["output_ids"]
    assert [o["output_ids"] for o in lone_constrained] == [o["output_ids"] for o in ref[:2]]
    check_valid(lone_constrained, MIXED[:2])
    base = spec_config.DFLASH_MIN_DRAFT_PROB
    lone = [s for s in seen if s[0] == 1 and not s[1]]
    assert lone and all(cut == spec_config.TILED_BF16_ALONE_MIN_DRAFT_PROB for _, _, cut, _ in lone)
    assert any(most == 4 for *_, most in lone) and all(most <= 4 for *_, most in lone)
    free_beside = [s for s in seen if s[0] > 1 and not s[1]]
    assert free_beside and all(most <= 3 and cut == round(base * max(1, n / 2), 6) for n, _, cut, most in free_beside)
    lone_grammar = [s for s in seen if s[0] == 1 and s[1]]
    lone_cut = spec_config.TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB
    assert lone_grammar and all(cut == lone_cut for *_, cut, _ in lone_grammar)
    assert any(most > 1 for *_, most in lone_grammar) and all(most <= 4 for *_, most in lone_grammar)
    assert all(cut == base and most <= 1 for n, constrained, cut, most in seen if constrained and n > 1)


def force_tiled_target(monkeypatch) -> None:
    """Engines made after this take their speculative defaults as on a target whose bf16 projections run on AMX
    tiles, whatever this CPU and the model's dtype."""
    from specjet.spec_v2 import config as spec_config

    real_from_args = spec_config.SpecConfig.from_args.__func__
    monkeypatch.setattr(spec_config.SpecConfig, "from_args", classmethod(
        lambda cls, args, quantized_cpu_target=False, cpu_target=False, tiled_bf16_target=False:
        real_from_args(cls, args, quantized_cpu_target, cpu_target, True)))


@pytest.mark.parametrize("ngram_tokens,overlap", [(0, False), (14, False), (14, True)])
def test_a_lone_requests_learned_nodes_stay_within_a_tile_and_its_ngram_path_may_pass_it(
        tiny_model_dir, copy_draft, plain_cpu_mixed, monkeypatch, ngram_tokens, overlap):
    """On a tiled target (forced) a request decoding alone verifies at most TILED_ROWS nodes of learned drafts. Cut
    off (given 0) and 4 wide, the learned trees would fill every node of their share (a block of 24 alone, 30 with
    an n-gram path). Without a path the DFlash tree stops at 16 nodes; with one the learned tree comes whole and the
    merge keeps it to 16 nodes or the path's, whichever is longer. The ids stay plain's, on the overlap loop too."""
    from specjet.spec_v2 import config as spec_config
    from specjet.spec_v2 import hybrid
    from specjet.spec_v2.dflash_drafter import DFlashDrafter

    force_tiled_target(monkeypatch)
    merges = []  # (batch size, n-gram tree nodes, learned tree nodes, the merge's budget, merged nodes)
    drafted = []  # (batch size, nodes) of the DFlash drafter's trees
    real_merge, real_propose = hybrid.merge_trees, DFlashDrafter.propose
    batch = verify_batch_sizes(monkeypatch)

    def merge(first, second, max_nodes):
        out = real_merge(first, second, max_nodes)
        merges.append((batch[-1], len(first[0]), len(second[0]), max_nodes, len(out[0])))
        return out

    def propose(self, reqs, share, req_to_token):
        trees = real_propose(self, reqs, share, req_to_token)
        drafted.extend((batch[-1], len(tokens)) for tokens, _ in trees)
        return trees

    monkeypatch.setattr(hybrid, "merge_trees", merge)
    monkeypatch.setattr(DFlashDrafter, "propose", propose)
    ref, alone = plain_cpu_mixed
    block = 16 if ngram_tokens else 24
    with dflash_engine(tiny_model_dir, copy_draft, speculative_num_draft_tokens=block, device="cpu",
                       speculative_hybrid_ngram_tokens=ngram_tokens, speculative_eagle_topk=4,
                       speculative_draft_min_prob=0.0, speculative_max_verify_tokens=None,
                       disable_overlap_schedule=not overlap) as eng:
        assert eng.worker.speculator.cfg.learned_nodes(1) == spec_config.TILED_ROWS == 16
        one = eng.generate(PROMPTS[2], MIXED[2])
        outs = eng.generate(PROMPTS[:4], MIXED)
        eng.check_kv_invariant()
    assert one["output_ids"] == alone["output_ids"]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    lone = [nodes for n, nodes in drafted if n == 1]
    if not ngram_tokens:
        assert lone and max(lone) == 16 and not merges  # a block of 24 whose 4-wide tree fills 24, stopped at the tile
        return
    assert lone and max(lone) > 16  # the hybrid's learned tree comes whole
    lone_merges = [m for m in merges if m[0] == 1]
    # (a request near its end has fewer nodes left than a tile: its budget is then what it may still say)
    assert lone_merges and all(merged <= budget <= max(16, path) for _, path, _, budget, merged in lone_merges)
    assert any(merged == 16 < learned for _, _, learned, _, merged in lone_merges)  # the tile's limit bound
