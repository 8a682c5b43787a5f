"""Predicted outputs (OpenAI's ``prediction``): the prediction's index follows it in order, a text one is
matched as bytes; its continuation goes ahead of the request's own in an n-gram tree (after only its own
spelling of forced text); with NGRAM, EAGLE and DFLASH (their n-gram path) and without speculation,
overlap on and off, free and under a grammar, an exact, an edited or a useless prediction leaves the
output exactly plain decoding's, and an exact one raises acceptance; sampling keeps the target's
distribution; a prediction lets free text draft beside others on a quantized target; retraction, stop strings
and budgets cut where plain decoding does; bad predictions are refused at the door."""
from __future__ import annotations

import logging
import random

import pytest
import torch

import specjet
from specjet.spec_v2.config import NgramConfig
from specjet.spec_v2.drafter import DraftRequest, SpecInput
from specjet.spec_v2.ngram import NgramDrafter, NgramIndex
from specjet.spec_v2.prediction import PredictionIndex, PredictionText
from spec_helpers import biased_topk, mean_accept, total_variation, two_token_distribution
from spec_helpers import spec_engine as engine
from test_dflash_spec import dflash_engine, make_wrong_draft
from test_penalties import SCHEMA
from test_spec_eagle import greedy, random_head

PROMPTS = ["The cat sat on the mat. The cat", "Hello", "1 2 3 4 1 2", "Some words, then more words"]
N = 48


def test_the_prediction_is_read_in_order():
    cfg = NgramConfig(max_window=3)
    index = NgramIndex(cfg.max_window)
    index.extend([1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5])
    pred = PredictionIndex(index)
    assert pred.continuation(cfg, [7, 1, 2], [], 3) == [3, 9, 1]  # first occurrence of "1 2"
    # "9 1 2" ends at positions 5 and 9: the one after the last continuation's place comes first.
    assert pred.continuation(cfg, [3, 9, 1], [2], 2) == [4, 9]  # (the last token a grammar's forced one)
    assert pred.continuation(cfg, [4, 9, 1, 2], [], 5) == [5]
    # Past the last place a suffix matches, the nearest before it.
    assert pred.continuation(cfg, [8, 1, 2], [], 2) == [5]
    assert pred.continuation(cfg, [6], [], 4) == []  # nowhere
    assert pred.continuation(cfg, [1, 2, 5], [], 4) == []  # at the prediction's end: nothing follows


def test_the_requests_own_spelling_of_forced_text_goes_before_the_prediction():
    """A constrained model that spelt a key in its own pieces before spells it so again: that branch first,
    then the prediction's (after the grammar's forced chain, the tokenizer's split of the key)."""
    drafter = NgramDrafter(NgramConfig())
    own = [9, 1, 2, 3, 50, 60, 1, 2]  # '1 2 3' its own spelling of the text the chain [4] also spells
    req = SpecInput("r", 0, len(own) - 1, own, 20, prediction=[8, 1, 2, 4, 70, 71])
    tokens, parents = drafter.propose([DraftRequest(req, 12, None, [4])], 12, None)[0]
    assert tokens[1] == 3 and parents[1] == 0  # the respelled branch leads
    four = tokens.index(4)
    assert parents[four] == 0 and tokens[tokens.index(70)] == 70 and parents[tokens.index(70)] == four


VOCAB = [b"{", b'"', b'{"', b"a", b"b", b"ab", b'":', b" ", b"1", b"2", b",", b"}", b"x", b"y", b"y" * 12]


def toy_tokenize(text: str) -> list[int]:
    """The longest vocabulary entry first, left to right (a tokenizer's canonical split, for the toy vocabulary)."""
    data, out = text.encode(), []
    while data:
        best = max((i for i, v in enumerate(VOCAB) if data.startswith(v)), key=lambda i: len(VOCAB[i]))
        out.append(best)
        data = data[len(VOCAB[best]):]
    return out


def test_a_text_prediction_is_matched_as_bytes_whatever_the_split():
    from specjet.spec_v2.prediction import TokenText

    cfg, text = NgramConfig(), TokenText(lambda: VOCAB, toy_tokenize)
    prompt = [12, 13]  # 'xy'
    pred = PredictionText('{"ab": 1, "ab": 2}', len(prompt), text)
    # The reply so far is '{' (a constrained model's split; the tokenizer says '{"'): the text from there on,
    # in the tokenizer's split; cut short, its last token is left out (it may be the start of a longer one).
    assert pred.continuation(cfg, prompt + [0], [], 3) == toy_tokenize('"ab": 1')[:3]
    assert pred.continuation(cfg, prompt + [0], [], 1) == toy_tokenize('"')
    long = PredictionText("{" + "y" * 40, len(prompt), text)
    assert long.continuation(cfg, prompt + [0], [], 2) == [14]  # 24 bytes read, more after: the last token dropped
    # '{', '"', 'a', 'b' (another split of '{"ab') and the forced '":': what follows the first '": '.
    assert pred.continuation(cfg, prompt + [0, 1, 3, 4], [6], 3) == toy_tokenize(" 1,")
    # ', "ab": ' occurs once; then '": ' twice: the place after the last match comes first.
    assert pred.continuation(cfg, prompt + [10, 7, 1, 5, 6, 7], [], 8) == toy_tokenize("2}")
    assert pred.continuation(cfg, prompt + [12, 6, 7], [], 8) == toy_tokenize("2}")  # '": ' again: the last
    assert pred.continuation(cfg, prompt + [10, 7, 1, 5, 6, 7, 9, 11], [], 8) == []  # at its end: nothing follows
    assert pred.continuation(cfg, prompt + [12, 12], [], 8) == []  # 'xx' is nowhere


def test_the_prediction_is_the_first_branch_of_an_ngram_tree():
    drafter = NgramDrafter(NgramConfig())
    own = [5, 6, 7, 8, 5, 6]  # its own text says 7, 8 after "5 6"
    req = SpecInput("r", 0, len(own) - 1, own, 10, prediction=[5, 6, 11, 12, 13])
    tokens, parents = drafter.propose([DraftRequest(req, 6, None, [])], 6, None)[0]
    assert tokens[:4] == [6, 11, 12, 13] and parents[:4] == [-1, 0, 1, 2]
    assert 7 in tokens  # the request's own continuation follows in what is left
    drafter.release("r")
    assert not drafter._predictions and not drafter._indexes


@pytest.fixture(scope="module")
def expected(plain):
    free = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(N))]
    constrained = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(N, json_schema=SCHEMA))]
    return free, constrained


def edited(ids: list[int], seed: int) -> list[int]:
    """A prediction that is partly wrong: a token changed, one dropped, two inserted."""
    rnd = random.Random(seed)
    out = list(ids)
    out[len(out) // 4] = (out[len(out) // 4] + 1) % 1000
    del out[len(out) // 2]
    out[3 * len(out) // 4:3 * len(out) // 4] = [rnd.randrange(1000), rnd.randrange(1000)]
    return out


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_model_dir):
    return random_head(tmp_path_factory.mktemp("prediction-head"), tiny_model_dir)


@pytest.fixture(scope="module")
def wrong_draft(tmp_path_factory, tiny_model_dir):
    return make_wrong_draft(tmp_path_factory.mktemp("prediction-dflash"), tiny_model_dir, 1, 8)


@pytest.mark.parametrize("algorithm, overlap", [("NGRAM", True), ("NGRAM", False), ("EAGLE", True),
                                                ("DFLASH", True), ("DFLASH", False)])
def test_a_prediction_changes_no_token_and_an_exact_one_is_taken(tiny_model_dir, head, wrong_draft, expected,
                                                                  algorithm, overlap):
    free, constrained = expected
    with engine(algorithm, tiny_model_dir, head, wrong_draft, overlap) as eng:
        without = eng.generate(PROMPTS, greedy(N))
        exact = eng.generate(PROMPTS, [greedy(N, prediction=ids) for ids in free])
        edits = eng.generate(PROMPTS, [greedy(N, prediction=edited(ids, i)) for i, ids in enumerate(free)])
        useless = eng.generate(PROMPTS, greedy(N, prediction=list(range(100, 160))))
        schema = eng.generate(PROMPTS, [greedy(N, json_schema=SCHEMA, prediction=ids) for ids in constrained])
        eng.check_kv_invariant()
    for outs, want in ((without, free), (exact, free), (edits, free), (useless, free), (schema, constrained)):
        assert [o["output_ids"] for o in outs] == want
    assert mean_accept(exact) > max(2.5, 1.5 * mean_accept(without)), (mean_accept(exact), mean_accept(without))
    assert mean_accept(edits) > mean_accept(without)
    assert mean_accept(schema) > 2.5


@pytest.mark.parametrize("algorithm", ["NGRAM", None])
def test_sampling_with_a_prediction_matches_the_target(cyclic_model_dir, algorithm):
    """1000 seeded draws of three tokens with a prediction of the likeliest path (so its drafts are often
    verified), with NGRAM and without speculation: the (t1, t2) histogram matches the target's top-k
    distribution."""
    from transformers import AutoModelForCausalLM

    prompt, n = PROMPTS[0], 1000
    model = AutoModelForCausalLM.from_pretrained(cyclic_model_dir, dtype=torch.float32)
    spec = {} if algorithm is None else dict(speculative_algorithm=algorithm, speculative_measured_payoff=False)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=8192, dtype="float32", **spec) as eng:
        prompt_ids = eng.tokenizer(prompt)["input_ids"]
        first = max(biased_topk(model, prompt_ids, {}, 3).items(), key=lambda kv: kv[1])[0]
        second = max(biased_topk(model, prompt_ids + [first], {}, 3).items(), key=lambda kv: kv[1])[0]
        prediction = prompt_ids[-2:] + [first, second, first, second]
        params = [dict(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True, seed=s, prediction=prediction)
                  for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs) > n // 10  # drafts were accepted
    tv = total_variation(outs, two_token_distribution(model, prompt_ids, {}))
    assert tv < 0.07, tv


@pytest.mark.parametrize("prediction, error, match", [
    (5, TypeError, "prediction must be a str or a list of token ids"),
    ({1, 2}, TypeError, "prediction must be a str or a list of token ids"),
    (["a"], TypeError, "prediction must be a list of ints"),
    ([True], TypeError, "prediction must be a list of ints"),
    ([1, -1], ValueError, r"prediction token ids must be in \[0, "),
    ([10 ** 9], ValueError, r"prediction token ids must be in \[0, "),
    ([1] * 9000, ValueError, "longer than the context length"),
])
def test_bad_predictions_are_refused(plain, prediction, error, match):
    with pytest.raises(error, match=match):
        plain.generate("a", greedy(2, prediction=prediction))
    assert plain.generate(["a", "b"], greedy(2))[1]["meta_info"]["completion_tokens"] == 2  # the engine goes on
    plain.check_kv_invariant()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_engine_without_speculation_drafts_for_predictions_and_grammars(tiny_model_dir, expected, overlap):
    """No ``speculative_algorithm``: a decode batch holding a request with a prediction or a grammar verifies NGRAM
    trees for it (free text beside it verifies its root alone), any other decode batch is a plain step. Every
    output stays plain decoding's, free and under a schema; exact predictions are taken, and the schema's forced
    text; free text without a prediction counts no verify."""
    free, constrained = expected
    with engine(None, tiny_model_dir, None, None, overlap) as eng:
        assert eng.worker.speculator.guided_only
        mixed = eng.generate(PROMPTS * 2, [greedy(N, prediction=ids) for ids in free] + [greedy(N)] * len(PROMPTS))
        edits = eng.generate(PROMPTS, [greedy(N, prediction=edited(ids, i)) for i, ids in enumerate(free)])
        schema = eng.generate(PROMPTS * 3, [greedy(N, json_schema=SCHEMA, prediction=ids) for ids in constrained]
                              + [greedy(N, json_schema=SCHEMA)] * len(PROMPTS) + [greedy(N)] * len(PROMPTS))
        before = eng.get_server_info()["stats"]
        alone = eng.generate(PROMPTS, greedy(N))
        after = eng.get_server_info()["stats"]
        eng.check_kv_invariant()
    k = len(PROMPTS)
    assert [o["output_ids"] for o in mixed + edits + alone] == free * 2 + free + free
    assert [o["output_ids"] for o in schema] == constrained * 2 + free
    assert mean_accept(mixed[:k]) > 2.5 and mean_accept(schema[:k]) > 2.5, (mean_accept(mixed[:k]),
                                                                           mean_accept(schema[:k]))
    assert mean_accept(edits) > 1.5
    assert mean_accept(schema[k:2 * k]) > 1.3  # the schema's forced text, drafted without a prediction
    assert not any("spec_verify_ct" in o["meta_info"] for o in mixed[k:] + schema[2 * k:] + alone)
    # Without a guided request in the batch, a decode batch is a plain step: no verify.
    assert after["decode_batches"] > before["decode_batches"] and after["spec_verify_ct"] == before["spec_verify_ct"]


@pytest.mark.parametrize("engine_kwargs", [dict(disable_guided_drafting=True),
                                           dict(enable_deterministic_inference=False)])
def test_guided_drafting_is_off_when_asked_or_when_kernels_are_not_batch_invariant(tiny_model_dir, expected,
                                                                                   engine_kwargs):
    """``disable_guided_drafting``, and an engine whose kernels could not verify exactly: requests with a
    prediction or a grammar decode with plain steps like any other (no speculator, no verify)."""
    free, constrained = expected
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, **engine_kwargs) as eng:
        assert eng.worker.speculator is None
        outs = eng.generate(PROMPTS * 2, [greedy(N, prediction=ids) for ids in free]
                            + [greedy(N, json_schema=SCHEMA) for _ in PROMPTS])
        stats = eng.get_server_info()["stats"]
        eng.check_kv_invariant()
    assert not any("spec_verify_ct" in o["meta_info"] for o in outs) and not stats.get("spec_verify_ct")
    if engine_kwargs.get("enable_deterministic_inference", True):  # the same kernels as the reference
        assert [o["output_ids"] for o in outs] == free + constrained
    with pytest.raises(TypeError, match="disable_guided_drafting must be bool"):
        specjet.Engine(model_path=str(tiny_model_dir), disable_guided_drafting="yes")


def test_an_engine_that_drafts_no_ngrams_says_so_once_and_decodes_as_ever(tiny_model_dir, head, expected, caplog):
    with engine("EAGLE", tiny_model_dir, head, None, True, path=0) as eng:
        with caplog.at_level(logging.WARNING, logger="specjet"):
            outs = eng.generate(PROMPTS, [greedy(N, prediction=ids) for ids in expected[0]])
            eng.generate(PROMPTS[0], greedy(2, prediction="some text"))
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected[0]
    assert sum("does not draft from" in r.getMessage() for r in caplog.records) == 1


def test_free_text_with_a_prediction_drafts_beside_others_on_a_quantized_target(tiny_model_dir, wrong_draft):
    """int8 weights on the CPU: in a batch, free text verifies its root alone (QUANTIZED_FREE_TEXT_DRAFT_BATCH)
    unless it brings a prediction, the caller's claim that drafting pays; the ids stay plain decoding's."""
    kw = dict(max_total_tokens=4096, device="cpu", quantization="int8")
    with specjet.Engine(model_path=str(tiny_model_dir), **kw) as plain_q:
        ref = [o["output_ids"] for o in plain_q.generate(PROMPTS, greedy(N))]
    with dflash_engine(tiny_model_dir, wrong_draft, speculative_hybrid_ngram_tokens=10, **kw) as eng:
        assert eng.worker.speculator.cfg.free_text_draft_batch == 1
        without = eng.generate(PROMPTS, greedy(N))
        exact = eng.generate(PROMPTS, [greedy(N, prediction=ids) for ids in ref])
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in without] == ref == [o["output_ids"] for o in exact]
    assert mean_accept(without) < 1.2 and mean_accept(exact) > 3.0, (mean_accept(without), mean_accept(exact))


@pytest.mark.parametrize("algorithm, overlap", [("NGRAM", True), ("NGRAM", False), (None, True)])
def test_predictions_survive_retraction_and_stop_strings(tiny_model_dir, plain, expected, algorithm, overlap):
    """A pool too small for the batch retracts requests and prefills them again (their prediction's place kept);
    a stop string and a budget cut a prediction's accepted run where plain decoding stops."""
    free = expected[0]
    text = plain.generate(PROMPTS[0], greedy(N))["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    ref_stop = plain.generate(PROMPTS[0], greedy(N, stop=[stop]))
    with engine(algorithm, tiny_model_dir, None, None, overlap, max_total_tokens=320, page_size=16) as small:
        outs = small.generate(PROMPTS * 2, [greedy(N, prediction=ids) for ids in free * 2])
        cut = small.generate(PROMPTS[0], greedy(N, stop=[stop], prediction=free[0]))
        short = small.generate(PROMPTS[0], greedy(7, prediction=free[0]))
        small.check_kv_invariant()
        assert small.get_server_info()["stats"]["retractions"] > 0
    assert [o["output_ids"] for o in outs] == free * 2
    assert cut["output_ids"] == ref_stop["output_ids"] and cut["text"] == ref_stop["text"]
    assert short["output_ids"] == free[0][:7]
