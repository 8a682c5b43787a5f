"""EAGLE speculative decoding is lossless whatever the head: exact token ids against the plain path
for mixed batches, page sizes 1 and 16, topk 1 and 4, num_steps 1, 3 and 5, cuts mid-run, and the
target's distribution under sampling; the KV invariant after every workload. Tiny random target;
random heads (always wrong) and random heads restricted to tokens the target often says (often
right, so multi-node acceptance, KV moves and draft extends are exercised)."""
from __future__ import annotations

import collections

import pytest
import torch

import specjet
from specjet.models.config import ModelConfig
from specjet.models.eagle import EagleDraftModel, save_eagle
from conftest import make_tiny_model_dir

PROMPTS = [
    "a b c a b c a b c a b",
    "The cat sat on the mat. The cat",
    "1 2 3 4 1 2",
    "Hello",
    "A longer prompt with some words, some more words, and then some more of the same words again",
]


def greedy(n, **extra):
    return dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """Smaller weights than the shared tiny model: its greedy output falls into short cycles over a
    dozen tokens, so a random head restricted to those tokens guesses right often."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic"), default_model_dir, weight_std=0.05)


@pytest.fixture(scope="module")
def expected(plain):
    return [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40))]


def random_head(tmp_path, model_dir, hot_ids=None, seed=0, feature_layers=()):
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    torch.manual_seed(seed)
    head = EagleDraftModel(config, hot_token_ids=None if hot_ids is None else torch.tensor(sorted(hot_ids)),
                           feature_layers=feature_layers)
    head.reset_parameters(std=0.3)
    if feature_layers:
        with torch.no_grad():
            head.fuse.weight_t.normal_(0.0, 0.3)
    return save_eagle(head, tmp_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def wrong_head(tmp_path_factory, tiny_model_dir):
    return random_head(tmp_path_factory.mktemp("wrong-head"), tiny_model_dir)


def copy_head(tmp_path, model_dir, expected, feature_layers=()):
    """A "copy" head: fc passes the token embedding through and the layer adds nothing, so it
    predicts that the next token repeats the current one (tied embeddings) - right most of the time
    on this cyclic target, wrong at every change, with a hot vocabulary of the tokens it says. An
    EAGLE-3 copy head also adds a little of its fused features, so that they reach the draft."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    hot = torch.tensor(sorted({t for ids in expected for t in ids} | {0, 1, 2}))
    head = EagleDraftModel(config, hot_token_ids=hot, feature_layers=feature_layers)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("weight_t") or name.endswith("bias"):
                p.zero_()
        h = config.hidden_size
        head.fc.weight_t[:h] = torch.eye(h)
        if feature_layers:
            head.fuse.weight_t.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
            head.fc.weight_t[h:] = 0.05 * torch.eye(h)
    return save_eagle(head, tmp_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def lucky_head(tmp_path_factory, tiny_model_dir, expected):
    return copy_head(tmp_path_factory.mktemp("copy-head"), tiny_model_dir, expected)


def eagle_engine(model_dir, head, **kw):
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("speculative_hybrid_ngram_tokens", 0)  # the head's own trees, unless a test merges n-grams in
    kw.setdefault("speculative_draft_min_prob", 0.0)  # and whole, unless a test cuts unlikely nodes
    # Every iteration drafts (tests/test_draft_payoff.py covers drafting only while it pays, which
    # depends on timings): drafts and acceptance compare across engines.
    kw.setdefault("speculative_measured_payoff", False)
    return specjet.Engine(model_path=str(model_dir), speculative_algorithm="EAGLE",
                          speculative_draft_model_path=str(head), **kw)


@pytest.mark.parametrize("page_size,topk,steps,nodes", [
    (1, 1, 3, 4), (16, 4, 3, 8), (1, 4, 5, 12), (16, 2, 1, 3), (1, 4, 1, 5), (16, 1, 5, 6)])
def test_greedy_equals_plain_with_a_lucky_head(tiny_model_dir, lucky_head, expected, page_size, topk, steps, nodes):
    with eagle_engine(tiny_model_dir, lucky_head, page_size=page_size, speculative_eagle_topk=topk,
                      speculative_num_steps=steps, speculative_num_draft_tokens=nodes) as eng:
        outs = eng.generate(PROMPTS, greedy(40))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert stats["spec_accepted_tokens"] > 1.1 * stats["spec_verify_ct"]  # drafts were really accepted


def test_plain_loop_gives_the_same_ids_as_the_overlap_loop(tiny_model_dir, lucky_head, expected):
    with eagle_engine(tiny_model_dir, lucky_head, disable_overlap_schedule=True, page_size=16) as eng:
        outs = eng.generate(PROMPTS, greedy(40))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert stats["spec_accepted_tokens"] > 1.1 * stats["spec_verify_ct"]


def test_min_prob_cuts_unlikely_nodes_and_stays_lossless(tiny_model_dir, lucky_head, expected):
    """speculative_draft_min_prob: a cut above every draft probability verifies the root alone (one
    token per verify); a mild one keeps the lucky head's likely nodes; the ids never change."""
    accept = {}
    for min_prob in (0.0, 1e-6, 1.0):
        with eagle_engine(tiny_model_dir, lucky_head, speculative_draft_min_prob=min_prob) as eng:
            outs = eng.generate(PROMPTS, greedy(40))
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == expected
        accept[min_prob] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
    assert accept[1.0] == 1.0 and accept[0.0] > 1.1 and accept[1e-6] > 1.1, accept


def run_eager_and_static(make_engine, expected) -> dict[str, dict]:
    """PROMPTS as a batch and PROMPTS[1] alone under ``make_engine("eager")`` and
    ``make_engine("static")``: both give the plain ids; each mode's stats."""
    stats = {}
    for mode in ("eager", "static"):
        with make_engine(mode) as eng:
            outs = eng.generate(PROMPTS, greedy(40))
            alone = eng.generate(PROMPTS[1], greedy(40))
            eng.check_kv_invariant()
            stats[mode] = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == expected, mode
        assert alone["output_ids"] == expected[1], mode
    return stats


def test_static_draft_runner_drafts_what_eager_drafts(tiny_model_dir, lucky_head, expected):
    """speculative_draft_runner="static": every draft step padded to a batch bucket on static
    buffers (5 requests x topk 4 = 20 frontier rows in bucket 24). Same ids as plain decoding, and
    the same acceptance as the eager runner, step for step: the drafts themselves are the same."""
    stats = run_eager_and_static(lambda mode: eagle_engine(
        tiny_model_dir, lucky_head, speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8,
        speculative_draft_runner=mode), expected)
    counts = [(s["spec_accepted_tokens"], s["spec_verify_ct"]) for s in stats.values()]
    assert counts[0] == counts[1] and counts[0][0] > 1.1 * counts[0][1], counts
    # Where an iteration's time went: every iteration counted (one verify forward serves one or
    # more requests' verify counts), the draft and the verify took time.
    phases = stats["static"]["spec_phases"]
    assert 0 < phases["iterations"] <= stats["static"]["spec_verify_ct"], phases
    assert phases["draft_ms"] > 0 and phases["verify_ms"] > 0 and min(phases.values()) >= 0, phases


def test_always_wrong_head_still_gives_identical_output(tiny_model_dir, wrong_head, expected):
    with eagle_engine(tiny_model_dir, wrong_head, speculative_eagle_topk=4, speculative_num_steps=3,
                      speculative_num_draft_tokens=8) as eng:
        outs = eng.generate(PROMPTS, greedy(40))
        one_by_one = [eng.generate(p, greedy(40))["output_ids"] for p in PROMPTS]
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected
    assert one_by_one == expected


def test_eagle3_heads_are_lossless(tiny_model_dir, expected, tmp_path):
    """Heads reading fused multi-layer features (the target's verify and prefill capture them): a
    random one and a copy head that gets drafts accepted, identical ids either way."""
    heads = {"random": random_head(tmp_path / "random", tiny_model_dir, feature_layers=(0,)),
             "copy": copy_head(tmp_path / "copy", tiny_model_dir, expected, feature_layers=(0,))}
    for name, head in heads.items():
        with eagle_engine(tiny_model_dir, head, speculative_eagle_topk=4, speculative_num_steps=3,
                          speculative_num_draft_tokens=8, page_size=16) as eng:
            outs = eng.generate(PROMPTS, greedy(40))
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == expected, name
        if name == "copy":
            assert stats["spec_accepted_tokens"] > 1.1 * stats["spec_verify_ct"]


def test_hybrid_ngram_trees_are_lossless_and_accept_more(tiny_model_dir, wrong_head, expected):
    """EAGLE trees with the n-gram continuation merged in: an always-wrong head alone commits one
    token per verify; with the n-gram path of this cyclic target's own output it commits more,
    and the ids stay the target's, in a batch and alone. The path's length is fed back: with a
    wrong head every draft token the target takes is an n-gram one, so what PathLength is told was
    taken adds up to every accepted token but the bonus of each verify."""
    from specjet.spec_v2.hybrid import PathLength

    accept, updates = {}, []
    real_update = PathLength.update

    def spy(self, rid, proposed, taken):
        updates.append((proposed, taken))
        real_update(self, rid, proposed, taken)

    for extra in (0, 4):
        with eagle_engine(tiny_model_dir, wrong_head, speculative_eagle_topk=4, speculative_num_steps=3,
                          speculative_num_draft_tokens=8, speculative_hybrid_ngram_tokens=extra) as eng:
            PathLength.update = spy
            try:
                outs = eng.generate(PROMPTS, greedy(40))
                alone = eng.generate(PROMPTS[1], greedy(40))
            finally:
                PathLength.update = real_update
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
        assert [o["output_ids"] for o in outs] == expected and alone["output_ids"] == expected[1]
        accept[extra] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
    assert accept[0] < 1.2 and accept[4] > 1.5, accept
    assert all(0 <= taken <= proposed <= 4 for proposed, taken in updates)
    assert sum(taken for _, taken in updates) == stats["spec_accepted_tokens"] - stats["spec_verify_ct"]
    # Unset, EAGLE merges an n-gram path of up to 14 nodes into each tree (the measured default); 0 turns it off.
    from bench.engine_info import describe_engine

    with eagle_engine(tiny_model_dir, wrong_head, speculative_hybrid_ngram_tokens=None) as eng:
        assert describe_engine(eng)["speculative"]["hybrid_ngram_tokens"] == 14
        assert eng.generate(PROMPTS[1], greedy(40))["output_ids"] == expected[1]
        eng.check_kv_invariant()


def test_cuts_stops_and_retraction(tiny_model_dir, lucky_head, plain, expected):
    text = plain.generate(PROMPTS[0], greedy(40))["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    ref_stop = plain.generate(PROMPTS[0], greedy(40, stop=[stop]))
    with eagle_engine(tiny_model_dir, lucky_head, speculative_num_draft_tokens=8) as eng:
        for n in (1, 2, 5, 11):
            assert eng.generate(PROMPTS[0], greedy(n))["output_ids"] == expected[0][:n]
        out = eng.generate(PROMPTS[0], greedy(40, stop=[stop]))
        assert out["output_ids"] == ref_stop["output_ids"] and out["text"] == ref_stop["text"]
        eng.check_kv_invariant()
    with eagle_engine(tiny_model_dir, lucky_head, max_total_tokens=320, page_size=16) as small:
        outs = small.generate(PROMPTS * 2, greedy(40))
        small.check_kv_invariant()
        assert small.get_server_info()["stats"]["retractions"] > 0
    assert [o["output_ids"] for o in outs] == expected * 2


# 0.01 cuts part of the lucky head's trees (its greedy accept drops from ~2.8 to ~2 per verify)
@pytest.mark.parametrize("hybrid,min_prob", [(0, 0.0), (2, 0.0), (0, 0.01)], ids=["eagle", "eagle+ngram", "eagle-cut"])
def test_sampling_matches_the_target_distribution(tiny_model_dir, lucky_head, hybrid, min_prob):
    from test_spec_ngram import exact_two_token_distribution

    prompt = PROMPTS[0]
    n = 2000
    with eagle_engine(tiny_model_dir, lucky_head, speculative_eagle_topk=2, speculative_num_steps=2,
                      speculative_num_draft_tokens=4, speculative_hybrid_ngram_tokens=hybrid,
                      speculative_draft_min_prob=min_prob, dtype="float32") as eng:  # the oracle's dtype
        ids = eng.tokenizer(prompt)["input_ids"]
        params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True, "seed": s}
                  for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    accepted = sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs)
    exact = exact_two_token_distribution(tiny_model_dir, ids, top_k=3)
    counts = collections.Counter(tuple(o["output_ids"][:2]) for o in outs)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.05, tv
    assert accepted > n // 20


def test_verify_token_cap_shares_nodes_across_the_batch(tiny_model_dir, lucky_head, expected):
    """speculative_max_verify_tokens: each tree of a batch of B gets max(2, cap // B) nodes, at most
    its configured size; the ids stay the target's. With the cap at 1 every tree is the root and one
    guess, so no verify commits more than two tokens, however good the head."""
    from types import SimpleNamespace

    from specjet.spec_v2.config import SpecConfig
    from specjet.spec_v2.speculator import Speculator

    def share(cap, batch_size, nodes=26):
        return Speculator.tree_share(SimpleNamespace(cfg=SpecConfig("EAGLE", nodes, max_verify_nodes=cap)), batch_size)

    assert [share(64, b) for b in (1, 2, 4, 8, 16, 64)] == [26, 26, 16, 8, 4, 2]
    assert share(None, 8) == 26 and share(64, 1, nodes=12) == 12
    with eagle_engine(tiny_model_dir, lucky_head, speculative_num_draft_tokens=8, speculative_max_verify_tokens=1,
                      speculative_hybrid_ngram_tokens=4) as eng:
        outs = eng.generate(PROMPTS, greedy(40))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert all(max(o["meta_info"]["spec_accept_histogram"]) <= 2 for o in outs)
    assert stats["spec_accepted_tokens"] > 1.1 * stats["spec_verify_ct"]  # the one guess was often right
    with pytest.raises(ValueError, match="speculative_max_verify_tokens must be >= 1"):
        eagle_engine(tiny_model_dir, lucky_head, speculative_max_verify_tokens=0)


def test_topk_wider_than_the_heads_vocabulary_is_refused_at_the_door(tiny_model_dir, tmp_path):
    head = copy_head(tmp_path, tiny_model_dir, [])  # hot vocabulary: 3 ids
    with pytest.raises(ValueError, match="speculative_eagle_topk=4 exceeds the EAGLE head's vocabulary of 3"):
        eagle_engine(tiny_model_dir, head, speculative_eagle_topk=4)
