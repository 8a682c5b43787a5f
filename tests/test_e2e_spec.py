"""Speculative decoding on the real default model: EAGLE with the packaged head, DFLASH with the
packaged draft and NGRAM give the
plain engine's greedy tokens exactly, in mixed batches, with and without a grammar."""
from __future__ import annotations

import json

import jsonschema
import pytest

import specjet

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
    "How much in dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue.",
    "What is the capital of France?",
]
PARAMS = {"temperature": 0, "max_new_tokens": 64}


@pytest.fixture(scope="module")
def plain_outputs():
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        prompts = [eng.apply_chat_template(q) for q in QUESTIONS]
        return prompts, [o["output_ids"] for o in eng.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kwargs", [
    {"speculative_algorithm": "EAGLE"},
    {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "speculative_num_steps": 5,
     "speculative_num_draft_tokens": 6, "page_size": 16},
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "DFLASH"},  # the shipped draft: a lattice tree of block 8, topk 3
    {"speculative_algorithm": "DFLASH", "speculative_eagle_topk": 1, "page_size": 16},
])
def test_speculative_greedy_equals_plain(plain_outputs, kwargs):
    prompts, expected = plain_outputs
    with specjet.Engine(max_total_tokens=8192, **kwargs) as eng:
        outs = eng.generate(prompts, PARAMS)
        batched = eng.get_server_info()["stats"]
        # Alone too: on the default (quantized) weights EAGLE's and DFLASH's free text drafts only alone
        # (SpecConfig.free_text_draft_batch), so their drafts show there. Plain decoding's tokens do not
        # depend on the batch (test_e2e_quant.py, test_engine.py).
        alone = [eng.generate(p, PARAMS)["output_ids"] for p in prompts[2:]]
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected and alone == expected[2:]
    assert stats["spec_accepted_tokens"] - batched["spec_accepted_tokens"] > stats["spec_verify_ct"] - batched["spec_verify_ct"]


def test_eagle_accepts_several_tokens_per_verify_on_gsm8k(plain_outputs):
    prompts, _ = plain_outputs
    # Every iteration drafts: the payoff controller pauses free-text drafting where it measures slower than plain
    # steps (on an AVX2-only CPU it does for these prompts), and its root-only verifies would count here.
    with specjet.Engine(max_total_tokens=8192, speculative_algorithm="EAGLE", speculative_measured_payoff=False) as eng:
        for prompt in prompts[:2]:  # alone: beside others, free text verifies its root alone on the default weights
            eng.generate(prompt, PARAMS)
        assert eng.get_server_info()["stats"]["spec_accept_length"] > 1.5  # a trained head, not a random one
        eng.check_kv_invariant()


def test_json_schema_with_eagle_is_valid_and_exact():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = {"temperature": 0, "max_new_tokens": 60, "json_schema": schema}
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        prompt = eng.apply_chat_template("Give a person's name and age as JSON.")
        expected = eng.generate([prompt, prompt], [params, PARAMS])
    with specjet.Engine(max_total_tokens=8192, speculative_algorithm="EAGLE") as eng:
        outs = eng.generate([prompt, prompt], [params, PARAMS])
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    jsonschema.validate(json.loads(outs[0]["text"]), schema)


@pytest.mark.parametrize("algorithm", ["EAGLE", "DFLASH"])
def test_grammar_masked_head_keeps_speculation_exact(algorithm, monkeypatch):
    """Under a JSON schema a verify's quantized LM head computes only the columns each node's mask allows
    where it allows few (QuantizedLinear.masked): the outputs stay those of plain constrained decoding,
    alone and beside a free-text request, and the sparse rows were taken."""
    from specjet.kernels import qgemm

    sparse_rows = []
    real = qgemm.QuantizedLinear.masked

    def counting(self, x, bitmask, masked, *args):
        out = real(self, x, bitmask, masked, *args)
        if out is not None:
            sparse_rows.append(int((out == float("-inf")).any(dim=1).sum()))
        return out

    monkeypatch.setattr(qgemm.QuantizedLinear, "masked", counting)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "landmarks": {"type": "array", "items": {"type": "string"}}},
              "required": ["city", "population", "landmarks"]}
    params = {"temperature": 0, "max_new_tokens": 80, "json_schema": schema}
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        prompt = eng.apply_chat_template("Describe Paris as JSON with three landmarks.")
        expected = [o["output_ids"] for o in eng.generate([prompt, prompt], [params, PARAMS])]
        alone = eng.generate(prompt, params)["output_ids"]
    with specjet.Engine(max_total_tokens=8192, speculative_algorithm=algorithm) as eng:
        outs = [o["output_ids"] for o in eng.generate([prompt, prompt], [params, PARAMS])]
        spec_alone = eng.generate(prompt, params)["output_ids"]
        eng.check_kv_invariant()
    assert outs == expected and spec_alone == alone == expected[0]
    assert sum(sparse_rows) > 0


def test_logprobs_of_speculative_decoding_are_plain_decodings(plain_outputs):
    """On the default (quantized) model: DFLASH and EAGLE report each token's logprob and top alternatives with
    plain decoding's numbers, alone (where they draft) and under a JSON schema; a greedy token is its own best."""
    prompts, _ = plain_outputs
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}}, "required": ["city", "population"]}
    params = [dict(PARAMS, max_new_tokens=40, return_logprob=True, top_logprobs_num=2),
              dict(PARAMS, max_new_tokens=40, return_logprob=True, top_logprobs_num=2, json_schema=schema)]
    asks = [prompts[2], prompts[3]]
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        expected = [eng.generate(p, sp) for p, sp in zip(asks, params)]
        # Asking changes no token (its rows' LM head then covers every column; the grammar's rows alone otherwise).
        unasked = [eng.generate(p, {k: v for k, v in sp.items() if "logprob" not in k}) for p, sp in zip(asks, params)]
    assert [o["output_ids"] for o in unasked] == [o["output_ids"] for o in expected]
    free = expected[0]["meta_info"]  # unconstrained greedy: each token is the best of its distribution
    assert all(top[0][:2] == pair[:2] for pair, top in zip(free["output_token_logprobs"], free["output_top_logprobs"]))
    for algorithm in ("DFLASH", "EAGLE"):
        with specjet.Engine(max_total_tokens=8192, speculative_algorithm=algorithm,
                            speculative_measured_payoff=False) as eng:
            outs = [eng.generate(p, sp) for p, sp in zip(asks, params)]
            eng.check_kv_invariant()
        for out, want in zip(outs, expected):
            assert out["output_ids"] == want["output_ids"]
            assert out["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
            assert out["meta_info"]["output_top_logprobs"] == want["meta_info"]["output_top_logprobs"]
            assert out["meta_info"]["spec_verify_ct"] < len(out["output_ids"])


@pytest.mark.parametrize("algorithm", ["DFLASH", "NGRAM", None, "guided-only"])
def test_a_predicted_output_keeps_plain_tokens_and_is_taken(plain_outputs, algorithm):
    """On the default model, a prediction (text: the engine tokenizes it) of the reply, exact or with a few words
    changed, gives plain decoding's tokens; an exact one is taken several tokens a verify, also by the engine
    without speculation (None: which also drafts free text alone; guided-only: which without free-text drafting
    verifies predictions alone)."""
    prompts, expected = plain_outputs
    spec = ({} if algorithm is None else dict(disable_free_text_drafting=True) if algorithm == "guided-only"
            else dict(speculative_algorithm=algorithm, speculative_measured_payoff=False))
    with specjet.Engine(max_total_tokens=8192, **spec) as eng:
        texts = [eng.tokenizer.decode(ids, skip_special_tokens=True) for ids in expected[:2]]
        without = [eng.generate(p, PARAMS) for p in prompts[:2]]
        exact = [eng.generate(p, dict(PARAMS, prediction=t)) for p, t in zip(prompts, texts)]
        edited = [eng.generate(p, dict(PARAMS, prediction=t.replace(" the ", " a ").replace("eggs", "ducks")))
                  for p, t in zip(prompts, texts)]
        eng.check_kv_invariant()
    for outs in (without, exact, edited):
        assert [o["output_ids"] for o in outs] == expected[:2]
    for got, base in zip(exact, without):
        assert got["meta_info"]["spec_accept_length"] > max(3.0, base["meta_info"].get("spec_accept_length", 1.0))
    assert algorithm != "guided-only" or not any("spec_verify_ct" in o["meta_info"] for o in without)


def test_a_predicted_json_object_is_found_in_a_constrained_models_own_spelling():
    """Under a schema the model spells some text in other pieces than the tokenizer: the prediction (text) is
    matched as bytes, so its
    continuation is still found; the output is plain constrained decoding's."""
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 10 ** 9},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
        "required": ["city", "population", "landmarks"], "additionalProperties": False}
    params = dict(PARAMS, max_new_tokens=128, json_schema=schema)
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        prompt = eng.apply_chat_template("Describe Paris as JSON.")
        want = eng.generate(prompt, params)
    text = json.loads(want["text"])
    # (' [', '"' where the tokenizer says ' ["', say)
    assert want["output_ids"][:-1] != eng.tokenizer(want["text"], add_special_tokens=False)["input_ids"]
    with specjet.Engine(max_total_tokens=8192, speculative_algorithm="NGRAM", speculative_num_draft_tokens=12,
                        speculative_measured_payoff=False) as eng:
        without = eng.generate(prompt, params)
        exact = eng.generate(prompt, dict(params, prediction=want["text"]))
        eng.check_kv_invariant()
    assert text and without["output_ids"] == exact["output_ids"] == want["output_ids"]
    assert exact["meta_info"]["spec_accept_length"] > max(4.0, 1.5 * without["meta_info"]["spec_accept_length"])
