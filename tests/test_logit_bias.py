"""OpenAI's ``logit_bias``: the addition on a row by hand (after the penalties); validated at the door;
it forces and bans tokens; speculative decoding (NGRAM, EAGLE, DFLASH; overlap and plain loop; under
a grammar) gives exactly plain decoding's greedy ids with it, and under sampling the biased target
distribution (an oracle written here from the definition). Reported logprobs stay the model's own."""
from __future__ import annotations

import collections

import pytest
import torch

import specjet
from specjet.kernels.penalties import Penalties, apply_penalties_, context_rows
from spec_helpers import biased_topk, repeating_prompt, total_variation, two_token_distribution
from spec_helpers import spec_engine as engine
from test_dflash_spec import make_copy_draft, make_wrong_draft
from test_penalties import PROMPTS, SCHEMA, greedy
from test_spec_eagle import random_head



def test_a_requests_penalties_and_bias_tensors_are_made_once():
    """A full-vocabulary logit_bias made every decode step 2.7x dearer: its 49,152 entries were copied into a new
    Penalties several times an iteration and into new tensors at every step. Both are made once now, and a
    change of the values (a new dict) makes new ones."""
    from specjet.scheduler.sampling_params import SamplingParams

    sp = SamplingParams.from_dict({"logit_bias": {str(i): 0.01 for i in range(49152)}})
    first = sp.penalties
    assert first is sp.penalties and len(first.bias_ids) == 49152
    cols, values = first.bias_tensors("cpu", torch.float32)
    assert first.bias_tensors("cpu", torch.float32)[0] is cols and values.shape == (49152,)
    assert first.bias_tensors("cpu", torch.bfloat16)[1].dtype == torch.bfloat16
    sp.logit_bias = {5: 1.0}
    assert sp.penalties.bias_ids == (5,)
    assert SamplingParams.from_dict({}).penalties is None


def test_bias_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    bias = Penalties(bias_ids=(1, 3), bias_values=(2.5, -100.0))
    both = Penalties(repetition=2.0, bias_ids=(0,), bias_values=(1.0,))
    # Row 0: the bias alone; row 1: no penalties; row 2: the repetition penalty on token 0 (seen), then its bias.
    counts, seen = context_rows([[], [], [0]], [0, 0, 0], 4)
    apply_penalties_(logits, counts, seen, [bias, Penalties(), both], [0, 0, 0])
    assert logits.tolist() == [[2.0, 1.5, 0.5, -97.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    # Without a contextual penalty no context is needed; rows sharing one Penalties take it together.
    rows = torch.zeros(3, 4)
    apply_penalties_(rows, None, None, [bias, bias, Penalties()], [0, 0, 0])
    assert rows.tolist() == [[0.0, 2.5, 0.0, -100.0]] * 2 + [[0.0] * 4]
    assert not bias.contextual and bias.active and both.contextual and not Penalties().active


@pytest.mark.parametrize("bias, error, match", [
    ([1, 2], TypeError, "logit_bias must be a dict"),
    ({"x": 1.0}, TypeError, "logit_bias keys must be token ids"),
    ({True: 1.0}, TypeError, "logit_bias keys must be token ids"),
    ({"1.5": 1.0}, TypeError, "logit_bias keys must be token ids"),
    ({"--5": 1.0}, TypeError, "logit_bias keys must be token ids"),
    ({"1e3": 1.0}, TypeError, "logit_bias keys must be token ids"),
    ({"5": "1"}, TypeError, r"logit_bias\['5'\] must be a number"),
    ({"5": float("nan")}, ValueError, r"logit_bias\['5'\] must be finite"),
    ({5: float("inf")}, ValueError, r"logit_bias\[5\] must be finite"),
    ({"5": 100.5}, ValueError, r"must be in \[-100.0, 100.0\]"),
    ({"5": 1.0, 5: 2.0}, ValueError, "gives token 5 twice"),
    ({"-1": 1.0}, ValueError, r"token ids in \[0, "),
    ({10 ** 30: 1.0}, ValueError, r"token ids in \[0, "),
])
def test_bad_logit_bias_is_refused(plain, bias, error, match):
    with pytest.raises(error, match=match):
        plain.generate("a", {"logit_bias": bias, "max_new_tokens": 2})
    assert plain.generate(["a", "b"], greedy(2))[1]["meta_info"]["completion_tokens"] == 2  # the engine goes on
    plain.check_kv_invariant()


def test_a_bias_forces_and_bans_tokens(plain):
    base = plain.generate(PROMPTS[1], greedy(6))["output_ids"]
    forced = plain.generate(PROMPTS[1], greedy(6, logit_bias={"7": 100}))["output_ids"]
    assert forced == [7] * 6
    banned = plain.generate(PROMPTS[1], greedy(6, logit_bias={base[0]: -100}))["output_ids"]
    assert banned[0] != base[0] and base[0] not in banned
    neutral = plain.generate(PROMPTS[1], greedy(6, logit_bias={}))["output_ids"]
    assert neutral == base
    plain.check_kv_invariant()


def biases(without: list[list[int]]) -> dict[int, float]:
    """Ban the cyclic model's most frequent greedy token and lift two others: outputs change at once."""
    common = collections.Counter(t for ids in without for t in ids).most_common(3)
    return {common[0][0]: -100.0, common[1][0]: 1.5, 11: 4.0}


@pytest.fixture(scope="module")
def expected(cyclic_model_dir):
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_guided_drafting=True) as plain:
        without = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40))]
        bias = biases(without)
        biased = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40, logit_bias=bias))]
        constrained = plain.generate(PROMPTS, greedy(40, json_schema=SCHEMA, logit_bias=bias))
        plain.check_kv_invariant()
    assert biased != without and all(max(bias, key=bias.get) in ids for ids in biased)  # it does something
    return bias, biased, [o["output_ids"] for o in constrained]


@pytest.fixture(scope="module")
def head(tmp_path_factory, cyclic_model_dir):
    return random_head(tmp_path_factory.mktemp("bias-head"), cyclic_model_dir)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, cyclic_model_dir):
    """A DFlash draft that copies its root (often right on the cyclic model) and a random one (wrong)."""
    return {"copy": make_copy_draft(tmp_path_factory.mktemp("bias-copy"), cyclic_model_dir, root_context=True),
            "wrong": make_wrong_draft(tmp_path_factory.mktemp("bias-wrong"), cyclic_model_dir, 2, 8)}


@pytest.mark.parametrize("algorithm, overlap", [("NGRAM", True), ("NGRAM", False), ("EAGLE", True),
                                                ("EAGLE", False), ("DFLASH-copy", True), ("DFLASH-copy", False),
                                                ("DFLASH-wrong", True)])
def test_greedy_speculation_with_a_bias_equals_plain(cyclic_model_dir, head, drafts, expected, algorithm, overlap):
    bias, biased, constrained = expected
    kind = algorithm.split("-")
    draft = drafts[kind[1]] if len(kind) > 1 else None
    with engine(kind[0], cyclic_model_dir, head, draft, overlap, path=0) as eng:
        outs = eng.generate(PROMPTS, greedy(40, logit_bias=bias))
        under_grammar = eng.generate(PROMPTS, greedy(40, json_schema=SCHEMA, logit_bias=bias))
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == biased
    assert [o["output_ids"] for o in under_grammar] == constrained
    if algorithm != "DFLASH-wrong":
        assert any(o["meta_info"]["spec_accept_length"] > 1 for o in outs + under_grammar)


def test_sampling_with_a_bias_matches_the_biased_target(cyclic_model_dir):
    """1000 seeded draws of three tokens with NGRAM on a model whose output repeats (so drafts are
    taken): the (t1, t2) histogram matches the biased top-k distribution (t2 comes from tree
    verification, where every node's row is biased)."""
    from transformers import AutoModelForCausalLM

    n = 1000
    model = AutoModelForCausalLM.from_pretrained(cyclic_model_dir, dtype=torch.float32)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=8192, dtype="float32",
                        speculative_algorithm="NGRAM") as eng:
        prompt = repeating_prompt(eng, PROMPTS[0])
        prompt_ids = eng.tokenizer(prompt)["input_ids"]
        plain_top = biased_topk(model, prompt_ids, {}, 3)
        # Lift the third most likely token to about even with the first: a sampler that ignored the bias fails.
        third = sorted(plain_top, key=plain_top.get)[0]
        bias = {third: 1.0}
        params = [dict(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True, seed=s, logit_bias=bias)
                  for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs) > n // 20  # drafts were accepted
    exact = two_token_distribution(model, prompt_ids, bias)
    assert total_variation(outs, exact) < 0.07
    unbiased = two_token_distribution(model, prompt_ids, {})
    assert 0.5 * sum(abs(exact.get(k, 0.0) - unbiased.get(k, 0.0)) for k in set(exact) | set(unbiased)) > 0.15


def test_each_tree_node_takes_the_bias():
    from specjet.spec_v2.tree_verifier import TreeVerifier, VerifyInput

    pen = Penalties(bias_ids=(2, 5), bias_values=(3.0, -1.0))
    torch.manual_seed(0)
    logits = torch.randn(6, 8)  # two rows of another request, then a four-node tree
    got = logits.clone()
    other = VerifyInput(1, 3, [1, 2], [-1, 0], None, None, None)
    req = VerifyInput(0, 4, [7, 3, 7, 4], [-1, 0, 1, 1], None, None, (pen, [5, 6, 5, 7], 2))
    TreeVerifier._apply_penalties([other, req], got, [0, 2])
    expected = logits.clone()
    expected[2:, 2] += 3.0
    expected[2:, 5] -= 1.0
    assert torch.equal(got, expected)


def test_logprobs_stay_the_models_own_under_a_bias(plain):
    """The bias changes which token is taken, not the log-probabilities reported (as penalties and masks)."""
    base = plain.generate(PROMPTS[1], greedy(3, return_logprob=True, top_logprobs_num=3))
    first = base["output_ids"][0]
    banned = plain.generate(PROMPTS[1], greedy(3, return_logprob=True, top_logprobs_num=3,
                                               logit_bias={first: -100}))
    assert banned["output_ids"][0] != first
    assert banned["meta_info"]["output_top_logprobs"][0] == base["meta_info"]["output_top_logprobs"][0]
    token_logprob = {tid: lp for lp, tid, _ in base["meta_info"]["output_top_logprobs"][0]}
    lp, tid, _ = banned["meta_info"]["output_token_logprobs"][0]
    if tid in token_logprob:
        assert lp == token_logprob[tid]
    plain.check_kv_invariant()
