"""Drafting only while it pays (spec_v2/payoff.py): the decisions by hand, and in an engine whose draft
is always wrong, ids equal plain decoding's while the request learns to verify its root alone."""
from __future__ import annotations

import pytest

import specjet
from specjet.spec_v2.payoff import EXPLORE, MARGIN, PAUSE, PROBE, DraftPayoff, bucket
from test_dflash_spec import tiny_model_dir  # noqa: F401 (the module's tiny cyclic target)
from test_spec_eagle import random_head


def _drive(payoff: DraftPayoff, rid: str, context: int, accepted: int, tree_s: float, root_s: float, iterations: int):
    """Run the request's iterations as the speculator does; returns its drafted / root-only pattern."""
    pattern = []
    for _ in range(iterations):
        drafted = payoff.wants_draft(rid, context)
        payoff.record(rid, context, drafted, accepted if drafted else 1, tree_s if drafted else root_s)
        pattern.append(drafted)
    return pattern


def test_drafts_that_do_not_pay_pause_after_a_probe_and_drafting_resumes_to_measure_again():
    payoff = DraftPayoff()
    # 1 token a verify at 2x a plain step's time: drafting runs at half the plain rate.
    pattern = _drive(payoff, "a", 300, accepted=1, tree_s=0.02, root_s=0.01,
                     iterations=EXPLORE + PROBE + PAUSE + EXPLORE + 1)
    assert pattern == [True] * EXPLORE + [False] * (PROBE + PAUSE) + [True] * EXPLORE + [False]
    assert payoff.summary() == {0: {"accept": 1.0, "tree_ms": 20.0, "root_ms": 10.0, "speedup": 0.5}}
    # The pause that follows a verdict is one (free-text drafting alone then stops for good); a probe is not.
    assert payoff.judged_slower("a")
    probing = DraftPayoff()
    assert _drive(probing, "b", 300, accepted=1, tree_s=0.02, root_s=0.01, iterations=EXPLORE + 1)[-1] is False
    assert not probing.judged_slower("b") and not probing.judged_slower("unknown")


def test_drafts_that_pay_keep_drafting_and_the_plain_step_is_measured_once_per_bucket():
    payoff = DraftPayoff()
    pattern = _drive(payoff, "a", 300, accepted=3, tree_s=0.02, root_s=0.01, iterations=40)
    assert pattern == [True] * EXPLORE + [False] * PROBE + [True] * (40 - EXPLORE - PROBE)
    # A second request in the same bucket needs no probe; at a longer context (another bucket) it does.
    assert all(_drive(payoff, "b", 400, accepted=3, tree_s=0.02, root_s=0.01, iterations=20))
    assert _drive(payoff, "c", 3000, accepted=3, tree_s=0.02, root_s=0.01, iterations=20).count(False) == PROBE
    assert bucket(511) == 0 and bucket(512) == 1 and bucket(1023) == 1 and bucket(1024) == 2 and bucket(3000) == 3
    payoff.drop("a")
    assert all(_drive(payoff, "a", 300, accepted=1, tree_s=0.02, root_s=0.01, iterations=EXPLORE))


def test_the_means_pool_the_bucket_and_a_marginal_bucket_keeps_drafting():
    payoff = DraftPayoff()
    # Measured 0.97x plain (1.94 tokens at 2x a step): within the margin, drafting goes on.
    _drive(payoff, "a", 300, accepted=2, tree_s=0.02, root_s=0.01, iterations=EXPLORE)
    _drive(payoff, "a", 300, accepted=1, tree_s=0.02, root_s=0.0097, iterations=PROBE)
    assert payoff.summary()[0]["speedup"] == pytest.approx(0.97) and 0.97 > MARGIN
    assert all(_drive(payoff, "b", 300, accepted=2, tree_s=0.02, root_s=0.01, iterations=40))
    # Other requests' poor drafts bring the bucket's mean below the margin: a new request pauses after
    # exploring (one request's own few verifies would be too noisy to judge).
    _drive(payoff, "c", 300, accepted=1, tree_s=0.02, root_s=0.01, iterations=60)
    assert payoff.summary()[0]["speedup"] < MARGIN
    assert _drive(payoff, "d", 300, accepted=2, tree_s=0.02, root_s=0.01, iterations=EXPLORE + 1)[-1] is False


def test_a_wrong_draft_verifies_its_root_alone_and_the_ids_stay_plain(tiny_model_dir, tmp_path):
    """int8 weights on the CPU, a random EAGLE head and no n-gram path: decoding alone, the request
    drafts, then verifies its root alone to measure a plain step, with or without the overlap loop; the
    ids are plain decoding's and the KV invariant holds; the engine argument turns the measuring off."""
    prompt = "The cat sat on the mat. The cat"
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8") as plain:
        expected = plain.generate(prompt, params)["output_ids"]
    head = random_head(tmp_path / "head", tiny_model_dir, feature_layers=(0,))
    for overlap_off in (False, True):
        trees = []
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8",
                            speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                            speculative_hybrid_ngram_tokens=0, speculative_num_draft_tokens=4,
                            speculative_draft_min_prob=0.0, disable_overlap_schedule=overlap_off,
                            speculative_measured_payoff=True) as eng:
            spec = eng.worker.speculator
            real = spec._run
            spec._run = lambda reqs, sampling, table, share, budgets: trees.append(budgets[0]) or real(
                reqs, sampling, table, share, budgets)
            assert eng.generate(prompt, params)["output_ids"] == expected
            eng.check_kv_invariant()
            assert spec.payoff is not None and spec.payoff.summary()[0]["root_ms"] > 0
        # Drafting, then the probe that measures a plain step (what follows depends on measured times:
        # the pauses are checked by hand above).
        assert trees[:EXPLORE] == [4] * EXPLORE and trees[EXPLORE:EXPLORE + PROBE] == [1] * PROBE
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8",
                        speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                        speculative_measured_payoff=False) as eng:
        assert eng.worker.speculator.payoff is None


def test_noisy_accepts_are_judged_by_their_upper_bound():
    """Accepts of 1 and 3 in turn (mean 2) at 2.2x a plain step measure 0.91x, but with one standard error
    on the accept mean the bucket may pay: drafting goes on. The same mean from steady accepts of 2 pauses."""
    payoff = DraftPayoff()
    pattern = []
    for i in range(60):
        drafted = payoff.wants_draft("a", 300)
        payoff.record("a", 300, drafted, (1 if i % 2 else 3) if drafted else 1, 0.022 if drafted else 0.01)
        pattern.append(drafted)
    assert pattern.count(False) == PROBE and payoff.summary()[0]["speedup"] < MARGIN
    steady = DraftPayoff()
    assert _drive(steady, "a", 300, accepted=2, tree_s=0.022, root_s=0.01, iterations=EXPLORE + PROBE + 1)[-1] is False


def test_the_engine_argument_is_typed_and_on_for_learned_drafts_on_a_cpu():
    from specjet.engine.args import EngineArgs
    from specjet.spec_v2.config import SpecConfig

    with pytest.raises(TypeError, match="speculative_measured_payoff must be bool"):
        EngineArgs(speculative_algorithm="EAGLE", speculative_measured_payoff="yes").validate()

    def measured(algorithm, cpu=True, **kw):
        return SpecConfig.from_args(EngineArgs(speculative_algorithm=algorithm, **kw), cpu_target=cpu).measured_payoff

    assert measured("EAGLE") and measured("DFLASH")
    assert not measured("NGRAM") and not measured("EAGLE", cpu=False)
    assert not measured("EAGLE", speculative_measured_payoff=False)
    # True asks for it on any device (a CUDA target too); still only for the learned drafts.
    assert measured("DFLASH", cpu=False, speculative_measured_payoff=True)
    assert not measured("NGRAM", speculative_measured_payoff=True)
