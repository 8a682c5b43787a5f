"""A seeded sampled request gives the same tokens whatever the engine does around it (kernels/coins.py): drafting
or not, with any drafter, under a grammar, alone or batched, in the overlap loop, and after a retraction. Its
token at each position is drawn with that position's coin, and a speculative verify draws the token after each
tree node as plain decoding would (kernels/tree_verify.py), so sampled speculation is exact, not only exact in
distribution (the statistical tests of test_spec_eagle.py, test_spec_ngram.py and test_spec_grammar.py check
the distribution itself). Before, a request running alone drafted or not by a timing measurement, and each
verify drew as many coins as its tree had nodes: a repeated seeded request could come back different."""
from __future__ import annotations

import pytest

import specjet

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Count from 1 to 30, separated by commas.",
    "Write a short story about a robot who learns to paint.",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"]}


def requests(engine: specjet.Engine) -> tuple[list[str], list[dict]]:
    prompts, params = [], []
    for i, (question, temperature) in enumerate([(q, t) for q in QUESTIONS for t in (0.6, 1.0)]):
        prompts.append(engine.apply_chat_template(question))
        params.append({"temperature": temperature, "top_p": 0.95 if i % 2 else 1.0, "seed": 1000 + i,
                       "max_new_tokens": 64})
    prompts.append(engine.apply_chat_template("Describe a person as JSON."))
    params.append({"temperature": 0.8, "seed": 77, "max_new_tokens": 80, "json_schema": SCHEMA})
    # A greedy request under the schema beside the sampled ones: a verify walks their rows in C++, reading the masks,
    # and its rows on the torch path, the masks written into them.
    prompts.append(engine.apply_chat_template("Describe a pirate as JSON."))
    params.append({"temperature": 0, "max_new_tokens": 80, "json_schema": SCHEMA})
    return prompts, params


def alone_then_batched(engine: specjet.Engine) -> list[list[int]]:
    """Each request alone (where the default engine drafts a lone free-text request), then all as one batch."""
    prompts, params = requests(engine)
    outs = [engine.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params)]
    outs += [o["output_ids"] for o in engine.generate(prompts, params)]
    engine.check_kv_invariant()
    return outs


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with specjet.Engine(disable_guided_drafting=True, disable_free_text_drafting=True) as engine:
        outs = alone_then_batched(engine)
    n = len(outs) // 2
    assert outs[:n] == outs[n:]  # plain decoding: batch-independent
    assert len({tuple(o) for o in outs[:n]}) == n  # different seeds and prompts, different replies
    return outs


@pytest.mark.parametrize("kwargs", [
    {},  # guided drafting for the schema, the shipped DFlash draft for a lone free-text request (measured payoff)
    {"speculative_algorithm": "DFLASH", "speculative_measured_payoff": False},
    {"speculative_algorithm": "EAGLE", "speculative_measured_payoff": False},
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "DFLASH", "speculative_measured_payoff": False, "disable_overlap_schedule": False},
], ids=["default", "DFLASH", "EAGLE", "NGRAM", "DFLASH-overlap"])
def test_seeded_sampled_requests_give_plain_decodings_tokens_when_drafting(plain, kwargs):
    with specjet.Engine(**kwargs) as engine:
        outs = alone_then_batched(engine)
        stats = engine.get_server_info()["stats"]
    assert outs == plain
    assert stats["spec_accepted_tokens"] > stats["spec_verify_ct"] > 0  # sampled drafts were verified and taken


def test_a_retracted_seeded_request_resumes_on_the_same_tokens(plain):
    """A KV pool too small for the batch retracts requests; each is re-prefilled from its prompt and output and
    goes on drawing with its positions' coins (before, a re-run drew the generator's next numbers)."""
    with specjet.Engine(speculative_algorithm="DFLASH", speculative_measured_payoff=False,
                        max_total_tokens=420) as engine:
        prompts, params = requests(engine)
        outs = [o["output_ids"] for o in engine.generate(prompts, params)]
        retractions = engine.get_server_info()["stats"]["retractions"]
        engine.check_kv_invariant()
    assert retractions > 0
    assert outs == plain[len(outs):]
