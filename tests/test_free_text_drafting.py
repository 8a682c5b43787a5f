"""Free-text drafting on an engine without ``speculative_algorithm`` (``SpecConfig.solo``): on a CPU, a request
without a grammar or a prediction drafts DFLASH blocks while it has decoded alone since its prefill; once it decodes
beside others it takes plain steps to its end, while guided requests (grammar, prediction) keep NGRAM's trees.
Exact ids against a truly plain engine alone, batched, mixed with guided requests, for a request that gets company
mid-way, overlap on and off; the target's distribution when sampling alone; the switch; the default model end to
end. The KV invariant after every workload."""
from __future__ import annotations

import threading
import time

import pytest

import specjet
from conftest import make_tiny_model_dir
from specjet.models.eagle import default_eagle_path
from spec_helpers import mean_accept, total_variation
from test_dflash_spec import make_copy_draft, make_wrong_draft
from test_penalties import SCHEMA
from test_spec_eagle import PROMPTS, greedy

N = 40


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """The cyclic tiny model (its greedy output repeats a token for long runs): the copy draft's blocks are taken."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic"), default_model_dir, weight_std=0.05)


@pytest.fixture(scope="module")
def copy_draft(tmp_path_factory, tiny_model_dir):
    # Sharp enough that its blocks pass the free-text drafting's confidence cut: its own nodes are verified, not
    # only the n-gram path merged beside them.
    return make_copy_draft(tmp_path_factory.mktemp("copy-dflash"), tiny_model_dir, root_context=True, sharpness=10.0)


@pytest.fixture(scope="module")
def wrong_draft(tmp_path_factory, tiny_model_dir):
    return make_wrong_draft(tmp_path_factory.mktemp("wrong-dflash"), tiny_model_dir, 1, 8)


@pytest.fixture(scope="module")
def expected(plain):
    free = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(N))]
    constrained = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(N, json_schema=SCHEMA))]
    return free, constrained


def solo_engine(model_dir, draft, overlap=False, **kw):
    """The engine without ``speculative_algorithm``, its free text drafting with ``draft`` on every iteration alone
    (the measured payoff, which depends on timings, off: drafts and acceptance then compare across runs)."""
    kw = dict(dict(max_total_tokens=4096, disable_overlap_schedule=not overlap, speculative_measured_payoff=False,
                   device="cpu"), **kw)  # a CPU engine's: free-text drafting is not built on CUDA
    return specjet.Engine(model_path=str(model_dir), speculative_draft_model_path=str(draft), **kw)


def verifies(outs) -> list[int]:
    return [o["meta_info"].get("spec_verify_ct", 0) for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
def test_free_text_drafts_alone_and_takes_plain_steps_beside_others(tiny_model_dir, copy_draft, expected, overlap):
    free, constrained = expected
    with solo_engine(tiny_model_dir, copy_draft, overlap) as eng:
        spec = eng.worker.speculator
        assert spec.guided_only and spec.solo is not None and spec.solo.cfg.algorithm == "DFLASH"
        alone = [eng.generate(p, greedy(N)) for p in PROMPTS]
        before = eng.get_server_info()["stats"]
        batched = eng.generate(PROMPTS, greedy(N))
        after = eng.get_server_info()["stats"]
        mixed = eng.generate(PROMPTS * 2, [greedy(N, json_schema=SCHEMA) for _ in PROMPTS] + [greedy(N)] * len(PROMPTS))
        again = eng.generate(PROMPTS[1], greedy(N))
        # Prefilled beside a guided request (which ends with its first token), then decoding alone: its rows of the
        # prefill's features alone make its draft state.
        pair = eng.generate(PROMPTS[2:4], [greedy(1, json_schema=SCHEMA), greedy(N)])
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in alone] == free
    assert mean_accept(alone) > 1.5, [o["meta_info"] for o in alone]  # the copy draft's blocks, taken
    # Beside each other: plain decode steps, no verify at all.
    assert [o["output_ids"] for o in batched] == free
    assert not any(verifies(batched)) and after["spec_verify_ct"] == before["spec_verify_ct"]
    assert after["decode_batches"] > before["decode_batches"]
    # Beside guided requests: their NGRAM trees are verified, the free text's roots alone (no draft of its own).
    assert [o["output_ids"] for o in mixed] == constrained + free
    assert not any(verifies(mixed[len(PROMPTS):])) and mean_accept(mixed[:len(PROMPTS)]) > 1.3
    # A new request alone drafts again.
    assert again["output_ids"] == free[1] and again["meta_info"]["spec_accept_length"] > 1.2
    assert pair[0]["output_ids"] == constrained[2][:1] and pair[1]["output_ids"] == free[3]
    if not overlap:  # the overlap loop builds the next decode batch before it learns that the guided one ended
        assert pair[1]["meta_info"]["spec_accept_length"] > 1.2


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_gets_company_mid_way_takes_plain_steps_to_its_end(tiny_model_dir, wrong_draft, plain,
                                                                          overlap):
    """The first request drafts alone until a second one arrives; from then on both take plain steps (the first's
    draft state stops covering its positions), also once the second has ended."""
    long_params, short_params = greedy(1800), greedy(30)  # long enough to be running when the second arrives
    reference = plain.generate(PROMPTS[:2], [long_params, short_params])
    with solo_engine(tiny_model_dir, wrong_draft, overlap) as eng:
        started, out = threading.Event(), {}

        def first():
            ids = []
            for chunk in eng.generate(PROMPTS[0], long_params, stream=True):
                ids += chunk["output_ids"]
                if len(ids) >= 8:  # a few iterations alone, drafting
                    started.set()
            out["first"], out["ids"] = chunk, ids

        thread = threading.Thread(target=first)
        thread.start()
        assert started.wait(60)
        second = eng.generate(PROMPTS[1], short_params)
        thread.join(120)
        stats = eng.get_server_info()["stats"]
        eng.check_kv_invariant()
    assert [out["ids"], second["output_ids"]] == [o["output_ids"] for o in reference]
    # It drafted alone (verifies), and took plain steps beside the second and after it: the tokens its verifies
    # accepted fall short of its output by the second's 30 steps at least.
    assert out["first"]["meta_info"]["spec_verify_ct"] > 0 and "spec_verify_ct" not in second["meta_info"]
    assert stats["spec_accepted_tokens"] <= len(out["ids"]) - len(second["output_ids"]), stats
    # Its accept length counts what its verifies committed, not the plain steps' tokens (the second verified
    # nothing, so the engine's counts are the first's alone).
    info = out["first"]["meta_info"]
    assert info["spec_verify_ct"] == stats["spec_verify_ct"]
    assert info["spec_accept_length"] == stats["spec_accepted_tokens"] / stats["spec_verify_ct"], (info, stats)


def test_sampling_alone_matches_the_target_distribution(tiny_model_dir, copy_draft):
    """1,000 seeded draws of three tokens, each request decoding alone (one running request at a time), through the
    free-text drafting's DFLASH verify: the (t1, t2) histogram is within a small total variation of the exact top-k
    distribution (HF transformers). The copy draft proposes t2 = t1, which the target gives only part of the time:
    a sampler that took drafts too readily would fail."""
    from test_spec_ngram import exact_two_token_distribution

    prompt, n = PROMPTS[0], 1000
    with solo_engine(tiny_model_dir, copy_draft, max_running_requests=1, dtype="float32") as eng:
        ids = eng.tokenizer(prompt)["input_ids"]
        outs = eng.generate([prompt] * n, [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True,
                                            "seed": s} for s in range(n)])
        eng.check_kv_invariant()
    assert sum(o["meta_info"].get("spec_accept_length", 0) > 1 for o in outs) > n // 20
    tv = total_variation(outs, exact_two_token_distribution(tiny_model_dir, ids, top_k=3))
    assert tv < 0.07, tv


def test_free_text_drafting_is_off_when_asked_or_without_a_draft(tiny_model_dir, copy_draft, expected):
    free, constrained = expected
    with solo_engine(tiny_model_dir, copy_draft, disable_free_text_drafting=True) as eng:
        assert eng.worker.speculator.guided_only and eng.worker.speculator.solo is None
        alone = eng.generate(PROMPTS[0], greedy(N))
        schema = eng.generate(PROMPTS[0], greedy(N, json_schema=SCHEMA))
        eng.check_kv_invariant()
    assert alone["output_ids"] == free[0] and "spec_verify_ct" not in alone["meta_info"]
    assert schema["output_ids"] == constrained[0] and schema["meta_info"]["spec_verify_ct"] > 0
    # A model of the user's without speculative_draft_model_path: no draft for it, so guided drafting alone.
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096) as eng:
        assert eng.worker.speculator.solo is None
    with pytest.raises(TypeError, match="disable_free_text_drafting must be bool"):
        specjet.Engine(model_path=str(tiny_model_dir), disable_free_text_drafting=1)
    # speculative_draft_model_path without an algorithm names the free-text draft: what is not one says so.
    with pytest.raises(ValueError, match="is not a specjet-dflash v1 draft"):
        specjet.Engine(model_path=str(tiny_model_dir), device="cpu",
                       speculative_draft_model_path=str(default_eagle_path()))
    with pytest.raises(FileNotFoundError, match="DFlash draft model not found"):
        specjet.Engine(model_path=str(tiny_model_dir), device="cpu", speculative_draft_model_path="/nonexistent/d")


def test_the_default_engine_drafts_free_text_alone_with_the_shipped_draft():
    """The default model on the CPU, end to end: ``Engine()`` drafts a lone chat reply with the shipped DFlash draft
    (the measured payoff on, as shipped), batched replies take plain steps; every reply is plain decoding's."""
    params = greedy(48)
    with specjet.Engine(disable_guided_drafting=True, device="cpu") as ref:
        prompts = [ref.apply_chat_template(q) for q in ("Count from one to ten in words.",
                                                         "Name the planets of the solar system in order.")]
        expected = [o["output_ids"] for o in ref.generate(prompts, params)]
    with specjet.Engine(device="cpu") as eng:
        spec = eng.worker.speculator
        assert spec.solo is not None and spec.solo.cfg.algorithm == "DFLASH" and spec.solo.payoff is not None
        alone = [eng.generate(p, params) for p in prompts]
        batched = eng.generate(prompts, params)
        info = eng.get_server_info()
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in alone + batched] == expected * 2
    assert all(v > 0 for v in verifies(alone)) and not any(verifies(batched))
    assert info["draft_quantization"] is not None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_drafting_measures_slower_takes_plain_steps_to_its_end(tiny_model_dir, copy_draft, expected,
                                                                               monkeypatch, overlap):
    """With the measured payoff on and every verdict "slower" (a margin no draft meets), a lone request explores,
    probes a plain step, is judged, and from then on takes plain steps (no verify, no draft state); ids stay plain."""
    from specjet.spec_v2 import payoff

    free, _ = expected
    monkeypatch.setattr(payoff, "MARGIN", 1e9)
    with solo_engine(tiny_model_dir, copy_draft, overlap, speculative_measured_payoff=True) as eng:
        outs = [eng.generate(p, greedy(N)) for p in PROMPTS[:2]]
        spec = eng.worker.speculator
        eng.check_kv_invariant()
        # Under the overlap loop the compute side releases a finished request after its output may have reached
        # the caller: wait for that (a request never released still fails).
        deadline = time.monotonic() + 10
        while (spec._stale or spec.solo.drafter.learned.root_ctx) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not spec._stale and not spec.solo.drafter.learned.root_ctx  # released at their ends
    assert [o["output_ids"] for o in outs] == free[:2]
    # The first request explores and probes (a bucket's first plain step), the second only explores; each is
    # then judged in one more root-only verify (the overlap loop may launch one more before the host learns).
    first, second = (o["meta_info"]["spec_verify_ct"] for o in outs)
    slack = 1 if overlap else 0
    assert payoff.EXPLORE + payoff.PROBE + 1 <= first <= payoff.EXPLORE + payoff.PROBE + 1 + slack
    assert payoff.EXPLORE + 1 <= second <= payoff.EXPLORE + 1 + slack


def test_a_request_left_alone_when_its_batch_mate_fails_at_launch_takes_a_plain_step(tiny_model_dir, copy_draft, plain,
                                                                                    monkeypatch):
    """R decoded beside Q, so it takes plain steps for good and its KV is reserved one position at a time. Once Q has
    ended, R shares a speculative batch with G (under a grammar), whose grammar fork fails at the launch: G ends
    alone, and R, left alone in the batch, must take a plain step rather than draft alone (a lone free-text request
    would, into KV it never reserved). R's ids stay plain decoding's, and no iteration writes past its reservation."""
    from specjet.grammar import RequestGrammar

    with solo_engine(tiny_model_dir, copy_draft) as eng:
        sched, solo = eng.scheduler, eng.worker.speculator.solo
        expected = plain.generate(PROMPTS[0], greedy(160))["output_ids"]
        lone_drafts = []
        solo_run = solo.run

        def noting(reqs, *args, **kwargs):
            lone_drafts.extend(r.rid for r in reqs)
            return solo_run(reqs, *args, **kwargs)

        solo.run = noting
        stream = eng.generate([PROMPTS[0], PROMPTS[1]], [greedy(160), greedy(14)], rid=["R", "Q"], stream=True)
        ids = []
        for chunk in stream:
            if chunk["index"] == 0:
                ids += chunk["output_ids"]
            elif chunk["meta_info"]["finish_reason"] is not None:
                break  # Q has ended: R decodes on
        fork = RequestGrammar.fork

        def failing_fork(grammar):
            raise RuntimeError("injected fork failure")

        launched = []
        start_batch = sched.start_batch

        def noting_launch(batch):
            launched.append(sorted(r.rid for r in batch.reqs))
            return start_batch(batch)

        sched.start_batch = noting_launch
        monkeypatch.setattr(RequestGrammar, "fork", failing_fork)
        g = eng.generate(PROMPTS[2], greedy(20, json_schema=SCHEMA), rid="G")
        monkeypatch.setattr(RequestGrammar, "fork", fork)
        for chunk in stream:
            ids += chunk["output_ids"]
        assert ["G", "R"] in launched  # G's failing launch held R
        reason = g["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "forking its grammar" in reason["message"], reason
        assert ids == expected
        assert "R" not in lone_drafts
        eng.check_kv_invariant()
