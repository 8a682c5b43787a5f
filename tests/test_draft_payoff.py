"""Drafting only while it pays (spec_v2/payoff.py): the decisions by hand, and in an engine whose draft
is always wrong, ids equal plain decoding's while the request learns to verify its root alone."""
from __future__ import annotations

import specjet
from specjet.spec_v2.payoff import MIN_SAMPLES, PAUSE, PROBE, DraftPayoff, bucket
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
    # 1.2 tokens a verify at 2x a plain step's time: drafting loses.
    pattern = _drive(payoff, "a", 300, accepted=1, tree_s=0.02, root_s=0.01, iterations=MIN_SAMPLES + PROBE + MIN_SAMPLES + PAUSE + 1)
    assert pattern[:MIN_SAMPLES] == [True] * MIN_SAMPLES
    assert pattern[MIN_SAMPLES:MIN_SAMPLES + PROBE] == [False] * PROBE  # measuring a plain step
    after_probe = MIN_SAMPLES + PROBE
    assert pattern[after_probe:after_probe + MIN_SAMPLES] == [True] * MIN_SAMPLES  # judged on fresh samples
    assert pattern[after_probe + MIN_SAMPLES:after_probe + MIN_SAMPLES + PAUSE] == [False] * PAUSE
    assert pattern[-1] is True  # after the pause it drafts again to measure anew
    assert payoff.summary() == {"tree_ms": {0: 20.0}, "root_ms": {0: 10.0}}


def test_drafts_that_pay_keep_drafting_and_the_plain_step_is_measured_once_per_bucket():
    payoff = DraftPayoff()
    pattern = _drive(payoff, "a", 300, accepted=3, tree_s=0.02, root_s=0.01, iterations=40)
    assert pattern.count(False) == PROBE  # the probe only: 3 tokens in 2x the time pays
    # A second request in the same bucket needs no probe; at a longer context (another bucket) it does.
    assert _drive(payoff, "b", 400, accepted=3, tree_s=0.02, root_s=0.01, iterations=20).count(False) == 0
    assert _drive(payoff, "c", 3000, accepted=3, tree_s=0.02, root_s=0.01, iterations=20).count(False) == PROBE
    assert bucket(511) == 0 and bucket(512) == 1 and bucket(1023) == 1 and bucket(1024) == 2 and bucket(3000) == 3
    payoff.drop("a")
    assert _drive(payoff, "a", 300, accepted=1, tree_s=0.02, root_s=0.01, iterations=MIN_SAMPLES) == [True] * MIN_SAMPLES


def test_a_wrong_draft_verifies_its_root_alone_and_the_ids_stay_plain(tiny_model_dir, tmp_path):
    """int8 weights on the CPU, a random EAGLE head and no n-gram path: decoding alone, the request
    drafts, then verifies its root alone to measure a plain step, with or without the overlap loop; the
    ids are plain decoding's and the KV invariant holds; the measuring is opt-in."""
    prompt = "The cat sat on the mat. The cat"
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, quantization="int8") as plain:
        expected = plain.generate(prompt, params)["output_ids"]
    head = random_head(tmp_path / "head", tiny_model_dir, feature_layers=(0,))
    for overlap_off in (False, True):
        trees = []
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, quantization="int8",
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
            assert spec.payoff is not None and spec.payoff.summary()["root_ms"]
        # Drafting, then the probe that measures a plain step (what follows depends on measured times:
        # the pauses are checked by hand above).
        assert trees[:MIN_SAMPLES] == [4] * MIN_SAMPLES and trees[MIN_SAMPLES:MIN_SAMPLES + PROBE] == [1] * PROBE
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, quantization="int8",
                        speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                        ) as eng:  # off by default
        assert eng.worker.speculator.payoff is None
