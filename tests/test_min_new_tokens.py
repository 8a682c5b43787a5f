"""SGLang's ``min_new_tokens``: until the output holds that many tokens its stop tokens (stop_token_ids, and EOS
unless ignore_eos) are not drawn. The hold on rows and tree nodes by hand; validated at the door (and refused with
a grammar); it keeps a request going past a stop token it would have ended at, and lets it end right after;
speculative decoding (NGRAM, EAGLE, DFLASH; overlap and plain loop) gives exactly plain decoding's ids with it,
greedy and seeded sampling (sampled speculation draws each token with plain decoding's coin)."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.kernels.penalties import Penalties, apply_penalties_
from specjet.scheduler.sampling_params import SamplingParams
from spec_helpers import spec_engine as engine
from test_dflash_spec import make_copy_draft
from test_penalties import PROMPTS, SCHEMA, greedy
from test_spec_eagle import random_head

INF = float("inf")


def test_stops_held_by_hand():
    """Row r's stop tokens are -inf while its output so far is shorter than min_new_tokens, after the bias."""
    held = Penalties(bias_ids=(1,), bias_values=(5.0,), min_new_tokens=3, stop_ids=(1, 3))
    logits = torch.zeros(4, 5)
    apply_penalties_(logits, None, None, [held, held, held, Penalties()], [0, 2, 3, 0])
    assert logits.tolist() == [[0.0, -INF, 0.0, -INF, 0.0], [0.0, -INF, 0.0, -INF, 0.0],
                               [0.0, 5.0, 0.0, 0.0, 0.0], [0.0] * 5]
    assert held.active and not held.contextual and not Penalties(min_new_tokens=3).active  # no stop ids: nothing


def test_a_hold_that_is_over_leaves_the_fast_paths_open():
    """Once the output has min_new_tokens tokens, a hold alone changes no logits: the worker and the verifier then
    treat the request as unpenalised (the argmax-only head, the host draw); a bias or a penalty keeps them."""
    from types import SimpleNamespace

    from specjet.scheduler.worker import _penalties_now

    held = Penalties(min_new_tokens=3, stop_ids=(1,))
    assert [held.needed_from(n) for n in (0, 2, 3, 9)] == [True, True, False, False]
    biased = Penalties(bias_ids=(4,), bias_values=(1.0,), min_new_tokens=3, stop_ids=(1,))
    assert biased.needed_from(9) and Penalties(frequency=0.5).needed_from(9)
    sp = SamplingParams.from_dict({"min_new_tokens": 3, "stop_token_ids": [1]})
    sp.check_token_ids(100, {2})
    prompt = [5, 6]
    for output, expected in (([], True), ([7, 8], True), ([7, 8, 9], False)):
        state = SimpleNamespace(tokens=prompt + output, prompt_len=len(prompt))
        assert (_penalties_now(SimpleNamespace(sampling=sp), state) is not None) is expected, output


def test_each_tree_node_holds_stops_by_its_depth():
    """A verified tree's node at depth d predicts the output's token number (so far) + d + 1: a node is held where
    that output is still shorter than min_new_tokens, whatever branch it is on."""
    from specjet.spec_v2.tree_verifier import TreeVerifier, VerifyInput

    pen = Penalties(min_new_tokens=4, stop_ids=(2,))
    logits = torch.zeros(5, 4)
    # prompt of 2 tokens, output so far [6, 5] (the root 5 last): the root predicts output token 3.
    req = VerifyInput(0, 4, [5, 1, 3, 7, 1], [-1, 0, 0, 1, 3], None, None, (pen, [9, 9, 6, 5], 2))
    TreeVerifier._apply_penalties([req], logits, [0])
    # depths 0, 1, 1, 2, 3: outputs 2, 3, 3, 4, 5 tokens before the predicted one; held below 4.
    assert [row[2] for row in logits.tolist()] == [-INF, -INF, -INF, 0.0, 0.0]


def test_the_held_tokens_are_the_stop_ids_and_eos_unless_ignored():
    sp = SamplingParams.from_dict({"min_new_tokens": 3, "stop_token_ids": [7, 4]})
    sp.check_token_ids(100, {2, 0})
    assert sp.penalties.stop_ids == (0, 2, 4, 7) and sp.penalties.min_new_tokens == 3
    ignoring = SamplingParams.from_dict({"min_new_tokens": 3, "stop_token_ids": [7], "ignore_eos": True})
    ignoring.check_token_ids(100, {2})
    assert ignoring.penalties.stop_ids == (7,)
    unset = SamplingParams.from_dict({"stop_token_ids": [7]})
    unset.check_token_ids(100, {2})
    assert unset.penalties is None  # min_new_tokens 0 holds nothing: the fast paths stay open


@pytest.mark.parametrize("params, error, match", [
    ({"min_new_tokens": -1}, ValueError, "min_new_tokens must be >= 0"),
    ({"min_new_tokens": 1.5}, TypeError, "min_new_tokens must be an int"),
    ({"min_new_tokens": True}, TypeError, "min_new_tokens must be an int"),
    ({"min_new_tokens": 2, "json_schema": SCHEMA}, ValueError, "min_new_tokens cannot go with json_schema"),
    ({"min_new_tokens": 2, "regex": "a+"}, ValueError, "min_new_tokens cannot go with regex"),
])
def test_bad_min_new_tokens_is_refused(plain, params, error, match):
    with pytest.raises(error, match=match):
        plain.generate("a", dict(params, max_new_tokens=2))
    assert plain.generate(["a", "b"], greedy(2))[1]["meta_info"]["completion_tokens"] == 2  # the engine goes on
    plain.check_kv_invariant()


def test_it_holds_a_stop_token_and_eos_then_lets_them_end(plain):
    base = plain.generate(PROMPTS[1], greedy(12))["output_ids"]
    stop = base[1]
    ended = plain.generate(PROMPTS[1], greedy(12, stop_token_ids=[stop]))
    assert ended["output_ids"] == base[:2]  # without it, the output ends at its second token
    held = plain.generate(PROMPTS[1], greedy(12, stop_token_ids=[stop], min_new_tokens=5))["output_ids"]
    assert stop not in held[:5] and (len(held) == 12 or held[-1] == stop) and len(held) >= 6
    # EOS, forced by a bias: at once without it, right after the fifth token with it.
    eos = plain.tokenizer.eos_token_id
    forced = {"temperature": 0, "max_new_tokens": 12, "logit_bias": {eos: 100.0}}
    assert plain.generate(PROMPTS[1], forced)["output_ids"] == [eos]
    late = plain.generate(PROMPTS[1], dict(forced, min_new_tokens=5))["output_ids"]
    assert len(late) == 6 and late[-1] == eos and eos not in late[:5]
    # ignore_eos: EOS is no stop, so nothing holds it.
    assert plain.generate(PROMPTS[1], dict(forced, min_new_tokens=5, ignore_eos=True))["output_ids"][0] == eos
    plain.check_kv_invariant()


SAMPLED = [dict(temperature=1.0, top_k=4, max_new_tokens=30, seed=s) for s in range(4)]


# Each prompt's hold: the last prompt's output reaches its stop token right after its hold.
HOLDS = [12, 12, 12, 2]


def held_params(stops: list[int], params: list[dict]) -> list[dict]:
    """Each prompt's parameters with its own stop token, held for its HOLDS tokens."""
    return [dict(sp, stop_token_ids=[stop], min_new_tokens=hold) for stop, sp, hold in zip(stops, params, HOLDS)]


@pytest.fixture(scope="module")
def expected(cyclic_model_dir):
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_guided_drafting=True) as plain:
        without = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40))]
        stops = [ids[2] for ids in without]  # each output's third token: a stop at once
        early = [o["output_ids"] for o in plain.generate(PROMPTS, [greedy(40, stop_token_ids=[s]) for s in stops])]
        held = [o["output_ids"] for o in plain.generate(PROMPTS, held_params(stops, [greedy(40)] * len(PROMPTS)))]
        sampled = [o["output_ids"] for o in plain.generate(PROMPTS, held_params(stops, SAMPLED))]
        plain.check_kv_invariant()
    assert all(len(ids) <= 3 for ids in early)  # the stop token ends every output early without the hold ...
    for ids, stop, hold in zip(held, stops, HOLDS):  # ... and never inside it
        assert stop not in ids[:hold] and (len(ids) == 40 or (ids[-1] == stop and len(ids) > hold))
    assert len(held[-1]) == 3 and held[-1][-1] == stops[-1]  # one ends by its stop token right after its hold
    assert all(len(ids) == 40 for ids in held[:3])  # the others run on past their holds
    assert all(stop not in ids[:hold] for ids, stop, hold in zip(sampled, stops, HOLDS))
    return stops, held, sampled


@pytest.fixture(scope="module")
def head(tmp_path_factory, cyclic_model_dir):
    return random_head(tmp_path_factory.mktemp("min-head"), cyclic_model_dir)


@pytest.fixture(scope="module")
def draft(tmp_path_factory, cyclic_model_dir):
    """A DFlash draft that copies its root (often right on the cyclic model)."""
    return make_copy_draft(tmp_path_factory.mktemp("min-copy"), cyclic_model_dir, root_context=True)


@pytest.mark.parametrize("algorithm, overlap", [("NGRAM", True), ("NGRAM", False), ("EAGLE", True),
                                                ("EAGLE", False), ("DFLASH", True), ("DFLASH", False)])
def test_speculation_with_min_new_tokens_equals_plain(cyclic_model_dir, head, draft, expected, algorithm, overlap):
    stops, held, sampled = expected
    # EAGLE's random head is seldom right: its trees take the n-gram path too, which the cyclic output accepts.
    with engine(algorithm, cyclic_model_dir, head, draft, overlap, path=10 if algorithm == "EAGLE" else 0) as eng:
        outs = eng.generate(PROMPTS, held_params(stops, [greedy(40)] * len(PROMPTS)))
        draws = eng.generate(PROMPTS, held_params(stops, SAMPLED))
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == held
    assert [o["output_ids"] for o in draws] == sampled
    assert any(o["meta_info"]["spec_accept_length"] > 1 for o in outs)  # drafts were taken across the hold
