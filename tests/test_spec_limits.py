"""Speculation at the context and KV-pool limits, with the overlap loop (the compute side a batch
ahead of the host): trees are cut by the room left, so requests end with ``length`` (or, alone in
a pool too small for them, a clear "KV pool exhausted" abort), never an internal error; the
greedy output equals plain decoding's, and no slot leaks."""
from __future__ import annotations

import pytest

import specjet
from robustness_helpers import assert_healthy, bounded
from test_dflash_spec import make_copy_draft
from test_spec_eagle import random_head

PROMPTS = ["a b c a b c a b c a b c a b c a b", "1 2 3 4 1 2 3 4 1 2 3", "x y z"]
GREEDY = {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_model_dir):
    return random_head(tmp_path_factory.mktemp("limits-head"), tiny_model_dir)


@pytest.fixture(scope="module")
def copy_draft(tmp_path_factory, cyclic_model_dir):
    """A DFlash draft whose blocks the cyclic target accepts whole: the compute side reaches the
    context's end fast, where a block no longer fits in the request's own slots (it borrows scratch)."""
    return make_copy_draft(tmp_path_factory.mktemp("limits-dflash"), cyclic_model_dir, root_context=True, sharpness=10.0)


def spec_kwargs(algorithm, head, copy_draft=None):
    if algorithm == "EAGLE":
        return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head)}
    if algorithm == "DFLASH":
        return {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(copy_draft),
                "speculative_num_draft_tokens": 8, "speculative_hybrid_ngram_tokens": 0}
    return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8}


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "DFLASH"])
@pytest.mark.parametrize("context_length", [64, 97])
def test_context_limit(cyclic_model_dir, head, copy_draft, algorithm, context_length):
    """Requests that decode up to the context (max_new_tokens None) reach its end in a verify: plain's ids."""
    params = dict(GREEDY, max_new_tokens=None)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, context_length=context_length) as plain:
        expected = [o["output_ids"] for o in plain.generate(PROMPTS, params)]
        plain.check_kv_invariant()
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, context_length=context_length,
                        **spec_kwargs(algorithm, head, copy_draft)) as eng:
        outs = bounded(eng.generate, PROMPTS, params)
        for out, ids in zip(outs, expected):
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
            assert out["output_ids"] == ids
            assert out["meta_info"]["prompt_tokens"] + len(ids) == context_length
        assert_healthy(eng)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE"])
def test_pool_limit(tiny_model_dir, head, algorithm):
    """A pool that holds about two of the three requests at full length: they take turns
    (retraction), every output equals plain decoding's, and none aborts."""
    params = dict(GREEDY, max_new_tokens=60)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096) as plain:
        expected = [o["output_ids"] for o in plain.generate(PROMPTS, params)]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=200,
                        **spec_kwargs(algorithm, head)) as eng:
        outs = bounded(eng.generate, PROMPTS, params)
        for out, ids in zip(outs, expected):
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
            assert out["output_ids"] == ids
        assert_healthy(eng)
