"""NGRAM speculative decoding is lossless: exact token ids against the plain path (greedy), the
target's distribution under sampling, and no KV leak. Tiny random-weight model."""
from __future__ import annotations

import collections
import os
import time

import pytest
import torch

import specjet
from specjet.kernels import cpu_ops
from spec_helpers import repeating_prompt

PROMPTS = [
    "a b c a b c a b c a b",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "1 2 3 4 1 2 3 4 1 2",
    "Hello",
    "A longer prompt with some words, some more words, and then some more of the same words again",
]


def greedy(n, **extra):
    return dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_guided_drafting=True) as eng:
        yield eng


def ngram_engine(tiny_model_dir, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)


@pytest.mark.parametrize("page_size,num_draft_tokens,breadth", [(1, 8, 4), (16, 8, 4), (1, 4, 1), (16, 12, 2)])
def test_greedy_equals_plain(tiny_model_dir, plain, page_size, num_draft_tokens, breadth):
    expected = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(48))]
    with ngram_engine(tiny_model_dir, page_size=page_size, speculative_num_draft_tokens=num_draft_tokens,
                      speculative_ngram_max_bfs_breadth=breadth) as eng:
        outs = eng.generate(PROMPTS, greedy(48))  # one mixed batch
        single = [eng.generate(p, greedy(48)) for p in PROMPTS]
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert [o["output_ids"] for o in single] == expected
    # the speculative path really ran and accepted drafts (not a root-only tree every time)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"]


def _plain_and_ngram_under(isa: str, model_dir: str, **engine_kw) -> tuple[list, list, list, dict]:
    """With SPECJET_ATTENTION_ISA=isa: plain decoding's ids, then NGRAM's outputs batched and alone and its stats (each
    engine's KV invariant checked after its workload)."""
    os.environ[cpu_ops.ISA_ENV] = isa
    cpu_ops.isa.cache_clear()
    try:
        assert cpu_ops.isa() == cpu_ops.ISAS[isa]
        with specjet.Engine(model_path=model_dir, max_total_tokens=4096, disable_guided_drafting=True,
                            **engine_kw) as eng:
            expected = [o["output_ids"] for o in eng.generate(PROMPTS, greedy(48))]
            eng.check_kv_invariant()
        with specjet.Engine(model_path=model_dir, speculative_algorithm="NGRAM", max_total_tokens=4096,
                            **engine_kw) as eng:
            outs = eng.generate(PROMPTS, greedy(48))
            single = [eng.generate(p, greedy(48)) for p in PROMPTS]
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
    finally:
        del os.environ[cpu_ops.ISA_ENV]
        cpu_ops.isa.cache_clear()
    return expected, outs, single, stats


@pytest.mark.skipif(cpu_ops.extension() is None or not cpu_ops.extension().isa_supported(cpu_ops.ISAS["amx"]),
                    reason="this CPU has no AMX-BF16 tiles (or this process may not use them)")
def test_greedy_equals_plain_with_the_attentions_amx_scores(tiny_model_dir):
    """SPECJET_ATTENTION_ISA=amx (a bf16 pool's scores on AMX tiles, bits of its own): NGRAM trees verified with it
    give plain decoding's ids under it, batched and alone, with drafts accepted."""
    expected, outs, single, stats = _plain_and_ngram_under("amx", str(tiny_model_dir), dtype="bfloat16")
    assert [o["output_ids"] for o in outs] == expected
    assert [o["output_ids"] for o in single] == expected
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"]


@pytest.mark.skipif(cpu_ops.extension() is None or not cpu_ops.extension().isa_supported(cpu_ops.ISAS["bf16dp"]),
                    reason="this CPU has no AVX-512 BF16")
def test_greedy_equals_plain_with_the_attentions_bf16_products(tmp_path, default_model_dir):
    """SPECJET_ATTENTION_ISA=bf16dp (a bf16 pool's products by VDPBF16PS on q and the softmax weights rounded to bf16,
    bits of its own; the default where the CPU runs it) on a
    model whose head_dim it takes (32; smaller weights, so the greedy text repeats and n-grams get drafted): NGRAM
    trees verified with it give plain decoding's ids under it, batched and alone, with drafts accepted."""
    from conftest import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "wide", default_model_dir, weight_std=0.05, hidden_size=128,
                                    intermediate_size=256)
    expected, outs, single, stats = _plain_and_ngram_under("bf16dp", str(model_dir))
    assert [o["output_ids"] for o in outs] == expected
    assert [o["output_ids"] for o in single] == expected
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"]


def test_cuts_at_max_new_tokens_and_stops_mid_run(cyclic_model_dir):
    """The cyclic model, whose output repeats: n-gram runs are taken, so they are cut mid-run."""
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_guided_drafting=True,
                        disable_free_text_drafting=True) as plain:
        full = plain.generate(PROMPTS[0], greedy(60))
        text, ids = full["text"], full["output_ids"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        ref_stop = plain.generate(PROMPTS[0], greedy(60, stop=[stop]))
        plain.check_kv_invariant()
    with ngram_engine(cyclic_model_dir) as eng:
        for n in (1, 2, 7, 13):  # accepted runs are longer than what is left: they must be cut
            out = eng.generate(PROMPTS[0], greedy(n))
            assert out["output_ids"] == ids[:n]
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        with_stop = eng.generate(PROMPTS[0], greedy(60, stop=[stop]))
        assert with_stop["output_ids"] == ref_stop["output_ids"] and with_stop["text"] == ref_stop["text"]
        target = ids[20]
        with_tok = eng.generate(PROMPTS[0], greedy(60, stop_token_ids=[target]))
        assert with_tok["output_ids"] == ids[: ids.index(target) + 1]
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert stats["spec_accepted_tokens"] > 2 * stats["spec_verify_ct"], stats  # long runs were taken


def test_a_stop_inside_an_accepted_run_drops_the_rest_of_the_run(cyclic_model_dir):
    """A stop token or stop string met inside a run of accepted draft tokens ends the reply there: the run's later
    tokens are not output. The prompt already holds the reply's cycle, so the n-gram drafter drafts it from the
    first step and the stops below fall inside long accepted runs (the cyclic model repeats itself)."""
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_guided_drafting=True,
                        disable_free_text_drafting=True) as plain:
        prompt = plain.tokenizer(PROMPTS[0])["input_ids"]
        prompt += plain.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]
        cont = plain.generate(input_ids=prompt, sampling_params=greedy(24))
        ids, text = cont["output_ids"], cont["text"]
        targets = sorted(set(ids[3:]))
        params = [greedy(24, stop_token_ids=[t]) for t in targets]
        params += [greedy(24, stop=[text[k:k + 2]]) for k in range(4, len(text) - 2, 5) if text[k:k + 2].strip()]
        expected = plain.generate(input_ids=[prompt] * len(params), sampling_params=params)
        plain.check_kv_invariant()
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in expected)
    with ngram_engine(cyclic_model_dir) as eng:
        outs = [eng.generate(input_ids=prompt, sampling_params=sp) for sp in params]
        eng.check_kv_invariant()
        long_runs = eng.generate(input_ids=prompt, sampling_params=greedy(24))
        eng.check_kv_invariant()
    assert long_runs["output_ids"] == ids and long_runs["meta_info"]["spec_verify_ct"] <= len(ids) // 3
    for sp, out, ref in zip(params, outs, expected):
        assert out["output_ids"] == ref["output_ids"], sp
        assert out["text"] == ref["text"] and out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_a_tree_never_drafts_past_max_new_tokens(cyclic_model_dir):
    """A request's tree is cut to the tokens it may still produce (Speculator.tree_budget): its verifies' accepted
    runs (the accept histogram) add up to exactly the reply's tokens after the prefill's, however long the runs the
    cyclic model's n-gram drafts would give, and never to more that the token limit then throws away."""
    with ngram_engine(cyclic_model_dir) as eng:
        for n in (2, 5, 9, 16, 31):
            out = eng.generate(PROMPTS[0], greedy(n))
            meta = out["meta_info"]
            assert len(out["output_ids"]) == n and meta["finish_reason"] == {"type": "length", "length": n}
            accepted = sum(k * count for k, count in meta["spec_accept_histogram"].items())
            assert accepted == n - 1, (n, meta["spec_accept_histogram"])
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert stats["spec_accepted_tokens"] > 2 * stats["spec_verify_ct"], stats  # long runs were taken


def test_retraction_under_kv_pressure_keeps_outputs(tiny_model_dir, plain):
    expected = [o["output_ids"] for o in plain.generate(PROMPTS * 2, greedy(40))]
    with ngram_engine(tiny_model_dir, max_total_tokens=256, page_size=16) as eng:
        outs = eng.generate(PROMPTS * 2, greedy(40))
        eng.check_kv_invariant()
        assert eng.get_server_info()["stats"]["retractions"] > 0
    assert [o["output_ids"] for o in outs] == expected


def test_grammar_requests_stay_exact_beside_speculative_ones(tiny_model_dir, plain):
    params = [greedy(30), dict(greedy(30), regex=r"[a-c ]{5,25}"), greedy(30)]
    prompts = PROMPTS[:3]
    expected = [o["output_ids"] for o in plain.generate(prompts, params)]
    with ngram_engine(tiny_model_dir) as eng:
        outs = eng.generate(prompts, params)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected


def exact_two_token_distribution(model_dir, prompt_ids, top_k):
    """P(t1, t2) under top-k sampling at temperature 1, from HF transformers (an independent oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def topk_probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        vals, idx = logits.topk(top_k)
        return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist()))

    dist = {}
    for t1, p1 in topk_probs(prompt_ids).items():
        for t2, p2 in topk_probs(prompt_ids + [t1]).items():
            dist[(t1, t2)] = p1 * p2
    return dist


def test_sampling_matches_the_target_distribution(cyclic_model_dir):
    """2000 seeded draws of (t1, t2, t3) with NGRAM on: the (t1, t2) histogram is within a small total
    variation of the exact distribution. t2 and t3 come from tree verification (t1 from prefill). The cyclic
    model after its own output: the n-gram trees' drafts are taken part of the time."""
    with ngram_engine(cyclic_model_dir, dtype="float32") as eng:  # the oracle's dtype
        prompt = repeating_prompt(eng, PROMPTS[0])
        ids = eng.tokenizer(prompt)["input_ids"]
        n = 2000
        params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True, "seed": s} for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
        accepted_drafts = sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs)
    exact = exact_two_token_distribution(cyclic_model_dir, ids, top_k=3)
    counts = collections.Counter(tuple(o["output_ids"][:2]) for o in outs)
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.05, tv
    assert accepted_drafts > n // 20  # drafts were accepted often enough for the test to mean something


def test_merge_trees_by_hand():
    """EAGLE + n-gram trees: the n-gram path first, then the learned tree's nodes it lacks, a shared
    path merged into one node (its subtree hanging there), parents before children, capped."""
    from specjet.spec_v2.hybrid import merge_trees

    ngram = ([7, 1, 2, 3], [-1, 0, 1, 2])  # root 7, then the path 1 2 3
    #            root 7
    # learned: children 1 and 4 of the root; 5 and 2 under 1; 6 under 4; 9 under 1 -> 2
    learned = ([7, 1, 4, 5, 6, 2, 9], [-1, 0, 0, 1, 2, 1, 5])
    tokens, parents = merge_trees(ngram, learned, max_nodes=20)
    # learned 1 = merged 1; 4 -> new 4; 5 under 1 -> new 5; 6 under 4 -> new 6; 2 under 1 = merged 2;
    # 9 under that 2 -> new 7.
    assert tokens == [7, 1, 2, 3, 4, 5, 6, 9]
    assert parents == [-1, 0, 1, 2, 0, 1, 4, 2]
    # Capped: the first tree's nodes first, then the learned ones in their order, a child never
    # without its parent.
    assert merge_trees(ngram, learned, max_nodes=5) == ([7, 1, 2, 3, 4], [-1, 0, 1, 2, 0])
    assert merge_trees(ngram, learned, max_nodes=3) == ([7, 1, 2], [-1, 0, 1])
    assert merge_trees(([7], [-1]), learned, max_nodes=4) == ([7, 1, 4, 5], [-1, 0, 0, 1])
    with pytest.raises(ValueError, match="different roots"):
        merge_trees(ngram, ([8], [-1]), max_nodes=4)


def test_hybrid_learned_nodes_stop_at_the_requests_learned_budget_and_the_path_passes_it():
    """HybridDrafter with a request's ``learned_nodes``: the learned tree's nodes fill the merged tree only up to that
    many nodes, while an n-gram path longer than that is kept whole; without it the learned nodes fill the budget."""
    from specjet.spec_v2.config import NgramConfig
    from specjet.spec_v2.drafter import DraftRequest, SpecInput
    from specjet.spec_v2.hybrid import HybridDrafter
    from specjet.spec_v2.ngram import NgramDrafter

    class WideLearned:  # a learned drafter's tree: 30 children of the root, best first
        feature_capture = None
        draft_kv_reads_next_token = False

        def propose(self, reqs, share, req_to_token):
            return [([r.input.root, *range(100, 130)], [-1] + [0] * 30) for r in reqs]

    def merged(text, learned_nodes, max_path=20):
        hybrid = HybridDrafter(WideLearned(), NgramDrafter(NgramConfig(max_branches=1)), max_path, 40)
        req = SpecInput("r", 0, len(text) - 1, text, remaining=100)
        return hybrid.propose([DraftRequest(req, 40, None, [], learned_nodes=learned_nodes)], 40, None)[0]

    cycle = list(range(1, 26))  # said twice: the path continues with the whole cycle, up to its limit
    tokens, _ = merged(cycle * 2, 16)  # the path: 10 tokens (half its cap as a rule), then 5 learned nodes
    assert len(tokens) == 16 and tokens[11:] == [100, 101, 102, 103, 104]
    tokens, _ = merged(cycle * 2, 16, max_path=40)  # a 20-token path passes the 16 nodes; no learned node is added
    assert len(tokens) == 21 and not set(tokens) & set(range(100, 130))
    tokens, _ = merged([9, 8], 16)  # no path: the learned tree up to 16 nodes
    assert tokens == [8, *range(100, 115)]
    assert len(merged(cycle * 2, None)[0]) == 40  # no limit: learned nodes fill the budget


def test_ngram_path_prefers_the_requests_own_spelling_of_forced_text():
    """Grammar-aware n-gram drafting: when the request has already written the forced text in
    other pieces than the tokenizer's chain, that spelling is the first branch; the chain stays
    as the next one. A continuation matched after the chain is used when nothing disagrees."""
    from specjet.spec_v2.config import NgramConfig
    from specjet.spec_v2.ngram import NgramDrafter

    text = {1: ' "', 2: "a", 3: "rg", 4: "um", 5: "en", 6: "ts", 7: "uments", 8: '":', 9: " 1", 10: ",", 11: "x"}

    def legal_len(prefix, tokens):  # a grammar that accepts exactly the text ' "arguments": 1,'
        target = ' "arguments": 1,'
        done = "".join(text[t] for t in [1, 2] + list(prefix))
        for n, tok in enumerate(tokens):
            done += text[tok]
            if not target.startswith(done):
                return n
        return len(tokens)

    drafter = NgramDrafter(NgramConfig(max_branches=2))
    drafter.observe("r", [11, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 1, 2])  # wrote ' "a' 'rg' 'um' 'en' 'ts' before
    tokens, parents = drafter.tree_for("r", 9, chain=[3, 7], legal_len=legal_len)
    # Own spelling first (cut where the grammar stops it: after ','), then the chain.
    assert tokens == [2, 3, 4, 5, 6, 8, 9, 10, 7]
    assert parents == [-1, 0, 1, 2, 3, 4, 5, 6, 1]
    # No earlier spelling of the text: the chain, then what followed the chain's tokens before.
    fresh = NgramDrafter(NgramConfig(max_branches=2))
    fresh.observe("r", [3, 7, 8, 9, 1, 2])
    assert fresh.tree_for("r", 8, chain=[3, 7], legal_len=legal_len) == ([2, 3, 7, 8, 9], [-1, 0, 1, 2, 3])
    # The same spelling as the chain is no second branch.
    same = NgramDrafter(NgramConfig(max_branches=2))
    same.observe("r", [1, 2, 3, 7, 8, 9, 10, 1, 2])
    assert same.tree_for("r", 8, chain=[3, 7], legal_len=legal_len) == ([2, 3, 7, 8, 9, 10], [-1, 0, 1, 2, 3, 4])


def test_hybrid_path_length_adapts_to_what_the_target_takes():
    """PathLength: half the cap as a rule; doubles (to the cap) when a path is taken whole at the
    limit; after a miss one past what was taken, by half at most, never below the rule; a path cut
    short by its match (taken whole, under the limit) or no path at all changes nothing."""
    from specjet.spec_v2.hybrid import PathLength

    lengths = PathLength(14)
    assert lengths.limit("r") == 7
    lengths.update("r", proposed=7, taken=7)
    assert lengths.limit("r") == 14
    lengths.update("r", proposed=14, taken=14)
    assert lengths.limit("r") == 14  # capped
    lengths.update("r", proposed=14, taken=10)
    assert lengths.limit("r") == 11  # one past what was taken
    lengths.update("r", proposed=11, taken=0)
    assert lengths.limit("r") == 7  # by half at most, and not below the rule
    lengths.update("r", proposed=3, taken=3)  # the match ran out before the limit: says nothing
    lengths.update("r", proposed=0, taken=0)
    assert lengths.limit("r") == 7
    assert lengths.limit("other") == 7
    lengths.release("r")
    assert lengths.limit("r") == 7 and PathLength(1).limit("r") == 1


def test_first_path_follows_first_children():
    from specjet.spec_v2.hybrid import first_path
    from specjet.spec_v2.ngram import build_trie

    tokens, parents = build_trie(9, [[1, 2, 3], [1, 4], [5]], max_nodes=10)
    assert first_path(tokens, parents) == [1, 2, 3]
    assert first_path([9], [-1]) == []


def test_verify_token_cap_keeps_ngram_output_exact(tiny_model_dir, plain):
    """NGRAM under speculative_max_verify_tokens=1 (every trie is the root and one guess, whatever
    the batch): ids equal plain decoding's, in a batch and alone, no verify commits more than two
    tokens, and some of those guesses are taken."""
    expected = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(32))]
    with ngram_engine(tiny_model_dir, speculative_num_draft_tokens=8, speculative_max_verify_tokens=1) as eng:
        outs = eng.generate(PROMPTS, greedy(32))
        single = eng.generate(PROMPTS[0], greedy(32))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected and single["output_ids"] == expected[0]
    assert all(max(o["meta_info"]["spec_accept_histogram"]) <= 2 for o in outs + [single])
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"]  # some guesses were taken


IDLE_PROMPTS = ["The cat sat on the mat. The cat", "one two three one two"]


@pytest.mark.parametrize("overlap_off", [False, True])
def test_an_idle_engine_holds_no_ended_requests_state(tiny_model_dir, plain, overlap_off):
    """A request's compute-side state (its compute state, the drafter's n-gram index) is dropped once it ends
    and the loop has nothing else to do, not only when the next batch comes: an idle server keeps no ended
    request's memory. The same rids served again afterwards give plain decoding's ids."""
    expected = [o["output_ids"] for o in plain.generate(IDLE_PROMPTS, greedy(24))]
    with ngram_engine(tiny_model_dir, disable_overlap_schedule=overlap_off) as eng:
        assert [o["output_ids"] for o in eng.generate(IDLE_PROMPTS, greedy(24), rid=["a", "b"])] == expected
        eng.wait_idle()
        drafter = eng.worker.speculator.drafter

        def held():
            return len(eng.worker._states), len(drafter._indexes)

        deadline = time.monotonic() + 10
        while eng.scheduler.run_in_loop(held).result() != (0, 0):
            assert time.monotonic() < deadline, eng.scheduler.run_in_loop(held).result()
            time.sleep(0.01)
        assert [o["output_ids"] for o in eng.generate(IDLE_PROMPTS, greedy(24), rid=["a", "b"])] == expected
        eng.check_kv_invariant()


def test_a_failed_idle_release_is_logged_and_the_engine_serves_on(tiny_model_dir, plain, caplog):
    """Dropping ended requests' state when the loop goes idle cannot fail a request: an error there is logged,
    the loop goes on, and the next requests are served with plain decoding's ids."""
    expected = [o["output_ids"] for o in plain.generate(IDLE_PROMPTS, greedy(16))]
    with ngram_engine(tiny_model_dir) as eng:
        real, failed = eng.worker.release, []

        def release(rids):
            if rids and not failed:  # the first hand-over of an ended request: the idle one (one request below)
                failed.append(tuple(rids))
                raise RuntimeError("injected release failure")
            return real(rids)

        eng.worker.release = release
        assert eng.generate(IDLE_PROMPTS[0], greedy(16))["output_ids"] == expected[0]
        deadline = time.monotonic() + 10
        while not failed:
            assert time.monotonic() < deadline, "the idle loop did not hand the ended request over"
            time.sleep(0.01)
        assert [o["output_ids"] for o in eng.generate(IDLE_PROMPTS, greedy(16))] == expected
        assert eng.is_alive()
        eng.check_kv_invariant()
    assert any("injected release failure" in (r.exc_text or "") or "ended requests failed" in r.getMessage()
               for r in caplog.records)


def test_phase_timings_count_the_nodes_of_a_requests_verify_tree():
    """``tree_nodes``: the nodes of one request's verify tree, roots included, over the iterations counted."""
    from specjet.spec_v2.speculator import PhaseTimings

    timings = PhaseTimings()
    assert timings.summary()["tree_nodes"] == 0.0  # nothing verified yet
    timings.finish(10, 2)  # a verify of two requests' trees, 10 nodes in all
    timings.finish(3, 1)
    summary = timings.summary(reset=True)
    assert summary["iterations"] == 2 and summary["tree_nodes"] == pytest.approx(13 / 3)
    assert timings.summary() == {"iterations": 0, "grammar_ms": 0.0, "draft_ms": 0.0, "verify_ms": 0.0,
                                 "draft_extend_ms": 0.0, "tree_nodes": 0.0}


def test_the_engine_reports_the_mean_nodes_its_verify_trees_held(cyclic_model_dir, monkeypatch):
    """get_server_info()["stats"]["spec_phases"]["tree_nodes"] is the mean size of the trees the verifier was
    given since the timings were last reset (bench.compare prints it beside the phases)."""
    from specjet.spec_v2.tree_verifier import TreeVerifier

    sizes = []
    real = TreeVerifier.verify

    def verify(self, reqs, *args):
        sizes.extend(len(r.tokens) for r in reqs)
        return real(self, reqs, *args)

    monkeypatch.setattr(TreeVerifier, "verify", verify)
    with ngram_engine(cyclic_model_dir, speculative_num_draft_tokens=8) as eng:
        eng.generate(PROMPTS[1], greedy(8))
        eng.get_server_info(reset_timings=True)
        sizes.clear()
        eng.generate(PROMPTS[:3], greedy(40))
        phases = eng.get_server_info()["stats"]["spec_phases"]
        eng.check_kv_invariant()
    assert sizes and max(sizes) > 1 and min(sizes) >= 1, sizes  # some trees went past their roots
    assert phases["tree_nodes"] == pytest.approx(sum(sizes) / len(sizes))
