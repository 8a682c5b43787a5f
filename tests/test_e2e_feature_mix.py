"""Requests that combine the sampling features at random, in random batches, on the real default model (greedy ones,
and sampled ones with a seed, whose coins are a function of the seed and the position: kernels/coins.py):
stop strings and stop ids, the three penalties, logit biases (bans and forced tokens), JSON schemas, regexes and
EBNF, predicted outputs, logprobs with top alternatives, ignore_eos, skip_special_tokens and token budgets that cut
a draft mid-way. Every drafting engine (the default one, which drafts for guided requests and for a lone free-text
request; DFLASH; EAGLE; NGRAM) must give the plain engine's tokens, text, finish reasons and logprobs exactly.

Each feature has its own exactness tests; this one is for their combinations, which no single-feature test holds
(a penalty on a grammar's tree, a stop string inside a prediction's run, a budget that ends inside a forced run)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

import specjet

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a JSON object describing a user with a name, an age and an email address.",
    "List the planets of the solar system, one per line.",
    "Count from 1 to 30, separated by commas.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["steps", "ok"]},
]
REGEXES = [r"[a-z ]{3,40}\.", r"(yes|no), because [a-z ]+\.", r"\d+(, \d+)*"]
PREDICTIONS = [
    "Natalia sold 48 clips in April and 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips altogether.",
    '{"name": "John Doe", "age": 30, "email": "john.doe@example.com"}',
    "Mercury\nVenus\nEarth\nMars\nJupiter\nSaturn\nUranus\nNeptune",
]
VOCAB = 49152  # the default model's
ROUNDS = 28
SAMPLED_ROUNDS = 8


def random_params(rng: random.Random) -> dict:
    """One greedy request's parameters: each feature on with some chance, any combination possible."""
    p: dict = {"temperature": 0} if rng.random() < 0.8 else {"temperature": 0.7, "top_k": 1}  # top_k 1 is greedy
    p["max_new_tokens"] = rng.choice([1, 2, 3, 5, 9, 17, 40, 64])
    grammar = rng.random()
    if grammar < 0.25:
        p["json_schema"] = rng.choice(SCHEMAS)
        p["max_new_tokens"] = rng.choice([p["max_new_tokens"], 96, 96])  # most of them room to complete
    elif grammar < 0.33:
        p["regex"] = rng.choice(REGEXES)
    elif grammar < 0.37:
        p["ebnf"] = 'root ::= "The answer is " [0-9]+ "."'
    if rng.random() < 0.3:
        p["stop"] = rng.sample([".", " the", "\n", "}", ",", "3", " is"], rng.randint(1, 3))
    if rng.random() < 0.15:
        p["stop_token_ids"] = rng.sample(range(VOCAB), 3) + [rng.choice([28, 30])]  # "," or "."
    if rng.random() < 0.3:
        p["frequency_penalty"] = rng.choice([-0.5, 0.5, 2.0])
    if rng.random() < 0.3:
        p["presence_penalty"] = rng.choice([-1.0, 0.7])
    if rng.random() < 0.3:
        p["repetition_penalty"] = rng.choice([0.8, 1.3, 2.0])
    if rng.random() < 0.2:
        p["logit_bias"] = {str(rng.randrange(VOCAB)): rng.choice([-100, -3, 5, 100]) for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.25:
        p["prediction"] = rng.choice(PREDICTIONS)
    if rng.random() < 0.2:
        p["return_logprob"] = True
        if rng.random() < 0.5:
            p["top_logprobs_num"] = rng.choice([1, 5])
    if rng.random() < 0.15:
        p["ignore_eos"] = True
    if rng.random() < 0.1:
        p["skip_special_tokens"] = False
    return p


# A last batch that holds each feature the coverage check asks for with room to spare, whatever the CPU's bits make
# of the random mix's replies: short JSON values to complete, a full stop in a worked answer and in a numbered count.
ANCHORS = (
    [QUESTIONS[1], QUESTIONS[0], QUESTIONS[2], QUESTIONS[0], QUESTIONS[3], QUESTIONS[2]],
    [{"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMAS[1]},
     {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMAS[1], "return_logprob": True,
      "top_logprobs_num": 2},
     {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMAS[2]},
     {"temperature": 0, "max_new_tokens": 64, "stop": ["."]},
     {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [30]},  # "."
     {"temperature": 0, "max_new_tokens": 3}],
)


def rounds() -> list[tuple[list[str], list[dict]]]:
    """The same seeded batches for every engine: (questions, parameters), 1 to 5 requests a batch, then ANCHORS."""
    rng = random.Random(20261206)
    out = []
    for _ in range(ROUNDS):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(([rng.choice(QUESTIONS) for _ in range(n)], [random_params(rng) for _ in range(n)]))
    # Sampled requests with a seed, the same mix of features: drafting or not, alone or batched, re-run after a fault
    # or not, each token is drawn with its position's coin, so these too must equal plain decoding exactly.
    for _ in range(SAMPLED_ROUNDS):
        n = rng.choice([1, 1, 2, 3])
        params = [random_params(rng) for _ in range(n)]
        for p in params:
            p.update(temperature=rng.choice([0.5, 0.8, 1.0]), seed=rng.randrange(2**64))
            p.pop("top_k", None)
            p.update(rng.choice([{}, {}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 20}]))
        out.append(([rng.choice(QUESTIONS) for _ in range(n)], params))
    return out + [ANCHORS]


def run(engine: specjet.Engine, batches) -> list[dict]:
    outs = []
    for questions, params in batches:
        outs += engine.generate([engine.apply_chat_template(q) for q in questions], params)
    return outs


def observed(out: dict) -> tuple:
    meta = out["meta_info"]
    return (out["output_ids"], out["text"], meta["finish_reason"],
            meta.get("output_token_logprobs"), meta.get("output_top_logprobs"))


@pytest.fixture(scope="module")
def plain():
    batches = rounds()
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True, disable_free_text_drafting=True) as eng:
        outs = run(eng, batches)
        eng.check_kv_invariant()
    return batches, outs


def test_the_plain_outputs_hold_the_features(plain):
    """The mix reaches what it means to test: grammars that complete and validate, stop strings, stop ids and
    budgets that end requests, logprobs, and no request refused or aborted."""
    batches, outs = plain
    params = [p for _, ps in batches for p in ps]
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert not [r for r in reasons if r["type"] == "abort"]
    assert any(isinstance(r.get("matched"), str) for r in reasons)  # a stop string ended one
    assert any(r.get("matched") in p.get("stop_token_ids", ()) for p, r in zip(params, reasons))  # a stop id too
    assert any(r["type"] == "length" for r in reasons)
    assert any("output_top_logprobs" in o["meta_info"] for o in outs)
    completed = 0
    for p, out, reason in zip(params, outs, reasons):
        if "json_schema" in p and reason["type"] == "stop" and "stop" not in p and "stop_token_ids" not in p:
            # The end-of-sequence token's text is the output's end where special tokens are not skipped.
            text = out["text"] if p.get("skip_special_tokens", True) else out["text"].removesuffix("<|im_end|>")
            jsonschema.validate(json.loads(text), p["json_schema"])
            assert "message" not in reason, reason  # the engine's own check found it valid too
            completed += 1
    assert completed >= 4


@pytest.mark.parametrize("kwargs", [
    {},  # the default engine: guided drafting, and the shipped DFlash draft for a lone free-text request
    {"speculative_algorithm": "DFLASH", "speculative_measured_payoff": False},
    {"speculative_algorithm": "EAGLE", "speculative_measured_payoff": False},
    {"speculative_algorithm": "NGRAM"},
], ids=["default", "DFLASH", "EAGLE", "NGRAM"])
def test_drafting_engines_give_plain_outputs_for_mixed_features(plain, kwargs):
    batches, expected = plain
    with specjet.Engine(max_total_tokens=8192, **kwargs) as eng:
        outs = run(eng, batches)
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    mismatched = [i for i, (a, b) in enumerate(zip(outs, expected)) if observed(a) != observed(b)]
    assert not mismatched, f"requests {mismatched} differ from plain decoding"
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"] > 0  # the drafts were verified and taken


def test_faults_at_random_end_only_requests_they_keep_following(plain):
    """The default engine runs the mix while one compute item in ten (a forward with its sampling, or a speculative
    iteration) fails at random, before it runs or after it has written its KV and state. A batch that fails is
    re-run one request at a time, and a request ends only when its own lone batches fail twice in a row: every
    other request gives exactly the plain outputs, and every ended one names the fault."""
    from bench.faults import MARKER, FaultInjector

    batches, expected = plain
    with specjet.Engine(max_total_tokens=8192) as eng:
        faults = FaultInjector(eng, rate=0.1, seed=7)
        outs = run(eng, batches)
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    fired = faults.summary()
    assert fired["fired"] >= 10 and fired["fired_in_shared_batches"] >= 2, fired  # lone and shared batches hit
    assert stats["batch_failures"] == fired["fired"]
    ended = [i for i, o in enumerate(outs) if o["meta_info"]["finish_reason"]["type"] == "abort"]
    for i in ended:
        assert MARKER in outs[i]["meta_info"]["finish_reason"]["message"]
    assert len(ended) < fired["fired"] / 2  # most faults passed: a request ends after two lone failures in a row
    mismatched = [i for i, (a, b) in enumerate(zip(outs, expected)) if i not in ended and observed(a) != observed(b)]
    assert not mismatched, f"requests {mismatched} differ from plain decoding after the faults"
