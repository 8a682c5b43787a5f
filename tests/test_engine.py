"""Engine behaviour on a tiny random-weight Llama: batching, paging, sampling, stops, aborts,
retraction under KV pressure, bad input, streaming and async. Every test ends with the KV check."""
from __future__ import annotations

import re

import anyio
import pytest

import specjet
from text_helpers import finished_text

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "JSON is",
    "A much longer prompt that goes on for a while so that the batch has requests of quite different lengths in it",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, random_seed=0) as eng:
        yield eng


@pytest.fixture(autouse=True)
def kv_invariant_after_each_test(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.wait_idle()
        eng.check_kv_invariant()


def ids_of(outs):
    return [o["output_ids"] for o in outs]


def text_of(engine, ids, **kwargs) -> str:
    """A finished reply's text from its ids (tests/text_helpers.py); the ids here are no special tokens."""
    token_bytes = engine.scheduler.grammar_backend.token_bytes()
    return finished_text(engine.tokenizer.decode(ids, **kwargs), b"".join(token_bytes[t] for t in ids))


def test_batched_equals_one_at_a_time(engine):
    batched = engine.generate(PROMPTS, GREEDY)
    single = [engine.generate(p, GREEDY) for p in PROMPTS]
    assert ids_of(batched) == ids_of(single)
    assert all(len(o["output_ids"]) == 24 for o in batched)
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 24} for o in batched)


def test_page_size_16_gives_the_same_outputs(engine, tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, page_size=16) as paged:
        out = paged.generate(PROMPTS, GREEDY)
        paged.check_kv_invariant()
    assert ids_of(out) == ids_of(engine.generate(PROMPTS, GREEDY))


def test_result_shape_and_meta_info(engine):
    out = engine.generate("Hello", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert set(out) >= {"text", "output_ids", "meta_info"}
    info = out["meta_info"]
    assert info["prompt_tokens"] == len(engine.tokenizer("Hello")["input_ids"])
    assert info["completion_tokens"] == 5
    assert 0 < info["ttft"] <= info["e2e_latency"]
    assert out["text"] == text_of(engine, out["output_ids"], skip_special_tokens=True)


def test_input_ids_and_prompt_agree(engine):
    ids = engine.tokenizer("Hello there")["input_ids"]
    assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == \
        engine.generate("Hello there", GREEDY)["output_ids"]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    a = engine.generate(PROMPTS[0], params)
    b = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [dict(params, seed=7), params, dict(params, seed=8)])[1]
    assert a["output_ids"] == b["output_ids"]
    other = engine.generate(PROMPTS[0], dict(params, seed=999))
    assert other["output_ids"] != a["output_ids"]  # a different seed draws differently (16 tokens from a flat-ish model)


def test_n_choices_are_the_seeded_single_requests(engine):
    """SGLang's n in the sampling parameters (it was an unknown parameter): each prompt's n choices in a row, choice i
    sampled with seed + i, the requests one would send apart; one prompt answers a list; streamed chunks carry each
    choice's index; n of 1 is one answer; an n out of range or differing between prompts is refused."""
    sp = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 5}
    singles = [engine.generate(p, dict(sp, seed=5 + i)) for p in PROMPTS[:2] for i in range(3)]
    assert len({tuple(o["output_ids"]) for o in singles[:3]}) == 3
    assert ids_of(engine.generate(PROMPTS[:2], dict(sp, n=3))) == ids_of(singles)
    one = engine.generate(PROMPTS[0], dict(sp, n=2))
    assert isinstance(one, list) and ids_of(one) == ids_of(singles[:2])
    assert engine.generate(PROMPTS[0], dict(sp, n=1))["output_ids"] == singles[0]["output_ids"]
    streamed = {0: [], 1: []}
    for chunk in engine.generate(PROMPTS[0], dict(sp, n=2), stream=True):
        streamed[chunk["index"]] += chunk["output_ids"]
    assert [streamed[0], streamed[1]] == ids_of(singles[:2])
    with pytest.raises(ValueError, match=re.escape("n must be an integer in [1, 128], got 0")):
        engine.generate("a", dict(sp, n=0))
    with pytest.raises(ValueError, match="n must be the same in every sampling_params"):
        engine.generate(["a", "b"], [dict(sp, n=2), sp])
    assert len(engine.generate(["a", "b"], [dict(sp, n=1), sp])) == 2  # a dict without n says 1
    # A rid names its choices r_0, r_1, ... (one a prompt: each prompt's), as SGLang's /generate does.
    named = engine.generate(PROMPTS[:2], dict(sp, n=2), rid=["p", "q"])
    assert [o["meta_info"]["id"] for o in named] == ["p_0", "p_1", "q_0", "q_1"] and ids_of(named) == ids_of(
        [singles[0], singles[1], singles[3], singles[4]])
    assert [o["meta_info"]["id"] for o in engine.generate(PROMPTS[0], dict(sp, n=2), rid="x")] == ["x_0", "x_1"]
    with pytest.raises(ValueError, match="1 rids for 2 prompts"):
        engine.generate(PROMPTS[:2], dict(sp, n=2), rid=["p"])


def test_stop_string_cuts_text(engine):
    full = engine.generate(PROMPTS[1], GREEDY)
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = engine.generate(PROMPTS[1], dict(GREEDY, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert stop not in out["text"]


def test_stop_token_ids_and_max_new_tokens(engine):
    full = engine.generate(PROMPTS[2], GREEDY)["output_ids"]
    target = full[5]
    out = engine.generate(PROMPTS[2], dict(GREEDY, stop_token_ids=[target]))
    assert out["output_ids"] == full[: full.index(target) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert len(engine.generate(PROMPTS[2], dict(GREEDY, max_new_tokens=3))["output_ids"]) == 3


def test_the_stop_token_is_left_out_of_the_text_unless_no_stop_trim(engine):
    """SGLang's trim: a reply a stop token ended (an ordinary one of stop_token_ids, or EOS shown with
    skip_special_tokens False) leaves it out of its text, whole and streamed; output_ids keep it; no_stop_trim keeps
    it in the text too."""
    full = engine.generate(PROMPTS[2], GREEDY)["output_ids"]
    target = full[5]
    cut = full[: full.index(target) + 1]
    params = dict(GREEDY, stop_token_ids=[target])
    out = engine.generate(PROMPTS[2], params)
    assert out["output_ids"] == cut and out["text"] == text_of(engine, cut[:-1], skip_special_tokens=True)
    assert "".join(c["text"] for c in engine.generate(PROMPTS[2], params, stream=True)) == out["text"]
    kept = engine.generate(PROMPTS[2], dict(params, no_stop_trim=True))
    assert kept["output_ids"] == cut and kept["text"] == text_of(engine, cut, skip_special_tokens=True)
    assert "".join(c["text"] for c in engine.generate(PROMPTS[2], dict(params, no_stop_trim=True), stream=True)) \
        == kept["text"]
    eos = engine.tokenizer.eos_token_id
    shown = {"temperature": 0, "max_new_tokens": 8, "skip_special_tokens": False, "logit_bias": {eos: 100.0}}
    first = engine.generate(PROMPTS[2], dict(shown, logit_bias={}, max_new_tokens=1))["output_ids"][0]
    forced = dict(shown, logit_bias={eos: 100.0}, min_new_tokens=1)  # one token, then EOS
    ended = engine.generate(PROMPTS[2], forced)
    assert ended["output_ids"][-1] == eos and ended["text"] == text_of(engine, [first])
    spelled = engine.generate(PROMPTS[2], dict(forced, no_stop_trim=True))["text"]
    assert spelled == engine.tokenizer.decode([first, eos], skip_special_tokens=False)
    with pytest.raises(TypeError, match="no_stop_trim must be a bool"):
        engine.generate(PROMPTS[2], dict(GREEDY, no_stop_trim=1))


def test_no_stop_trim_keeps_a_matched_stop_string(engine):
    """SGLang's no_stop_trim keeps the stop string that ended the text (whole and streamed), where the default cuts
    before it."""
    text = engine.generate(PROMPTS[1], GREEDY)["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) == len(text) // 2, "need a stop string first found mid-text"
    kept = engine.generate(PROMPTS[1], dict(GREEDY, stop=[stop], no_stop_trim=True))
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == text[: text.find(stop) + len(stop)]
    streamed = engine.generate(PROMPTS[1], dict(GREEDY, stop=[stop], no_stop_trim=True), stream=True)
    assert "".join(c["text"] for c in streamed) == kept["text"]
    assert engine.generate(PROMPTS[1], dict(GREEDY, stop=[stop]))["text"] == text[: text.find(stop)]


def test_a_stop_token_is_checked_before_a_stop_string_it_completes(engine):
    """A token that is a stop token and whose text completes a stop string ends the request as the stop token (as
    in SGLang): its text is everything before the token, not cut at the stop string's start."""
    ids = engine.generate(PROMPTS[2], GREEDY)["output_ids"]
    decode = engine.tokenizer.decode
    for k in range(3, len(ids)):
        before, piece = decode(ids[:k]), decode(ids[:k + 1])[len(decode(ids[:k])):]
        spanning = before[-1:] + piece[:1]
        if (piece and before and ids[k] not in ids[:k] and decode(ids[:k + 1]).startswith(before)
                and spanning not in before):
            break
    else:
        pytest.skip("no token here completes a two-character stop string")
    out = engine.generate(PROMPTS[2], dict(GREEDY, stop_token_ids=[ids[k]], stop=[spanning]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert out["output_ids"] == ids[:k + 1] and out["text"] == before


def test_ignore_eos_decodes_past_eos_and_max_new_tokens_0_outputs_nothing(engine):
    """ignore_eos: an EOS the model writes (forced by a bias) is an ordinary token, and the reply runs to
    max_new_tokens; without it the EOS ends the reply at once. max_new_tokens 0: no token, a length finish of 0."""
    eos = engine.tokenizer.eos_token_id
    forced = {"temperature": 0, "max_new_tokens": 5, "logit_bias": {eos: 100.0}}
    ignored = engine.generate(PROMPTS[0], dict(forced, ignore_eos=True))
    assert ignored["output_ids"] == [eos] * 5
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    ended = engine.generate(PROMPTS[0], forced)
    assert ended["output_ids"] == [eos] and ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    for stream in (False, True):
        out = engine.generate(PROMPTS[0], dict(GREEDY, max_new_tokens=0), stream=stream)
        chunks = list(out) if stream else [out]
        assert [t for c in chunks for t in c["output_ids"]] == [] and "".join(c["text"] for c in chunks) == ""
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert chunks[-1]["meta_info"]["completion_tokens"] == 0


def test_get_load_counts_what_requests_hold(engine):
    """SGLang's load report: a running request and the KV it holds; idle, nothing (the prefix cache's slots that
    no request holds are free for the taking)."""
    engine.generate(PROMPTS[0], GREEDY)  # leaves its prefix in the cache
    engine.wait_idle()
    idle = engine.get_load()
    assert idle == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_pages": 0}
    stream = engine.generate(PROMPTS[1], dict(GREEDY, max_new_tokens=2000), stream=True)
    next(stream)
    busy = engine.get_load()
    stream.close()
    assert busy["num_reqs"] == 1 and busy["num_waiting_reqs"] == 0 and busy["num_tokens"] > 0
    assert busy["num_pages"] == busy["num_tokens"]  # pages of one token


def test_abort_while_streaming(engine):
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}, stream=True)
    first = next(stream)
    engine.abort_request(first["meta_info"]["id"])
    chunks = [first, *stream]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by the caller",
                                                        "status_code": 400, "err_type": "request_aborted"}
    assert sum(len(c["output_ids"]) for c in chunks) < 2000


def test_abort_all_ends_every_live_request_and_nothing_after(engine):
    """SGLang's ``abort_request(abort_all=True)``: every request live at the call ends with request_aborted; a request
    submitted after it is served whole."""
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    streams = [engine.generate(p, long, stream=True) for p in PROMPTS[:2]]
    firsts = [next(s) for s in streams]
    engine.abort_request(abort_all=True)
    for first, stream in zip(firsts, streams):
        chunks = [first, *stream]
        assert chunks[-1]["meta_info"]["finish_reason"]["err_type"] == "request_aborted"
        assert sum(len(c["output_ids"]) for c in chunks) < 2000
    assert len(engine.generate(PROMPTS[2], dict(GREEDY, max_new_tokens=5))["output_ids"]) == 5
    with pytest.raises(TypeError, match="abort_request"):
        engine.abort_request(7)
    engine.check_kv_invariant()


def test_streaming_concatenates_to_the_full_output(engine):
    full = engine.generate(PROMPTS[3], GREEDY)
    chunks = list(engine.generate(PROMPTS[3], GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_reply_cut_inside_a_character_leaves_that_character_out(engine):
    """A reply that max_new_tokens ends inside a character (here after the first byte of a three-byte one) ended its
    text and its stream's last chunk in U+FFFD; the cut character is left out of the text, as vLLM does and as the
    stream never sent it; the ids keep its byte. Bytes no character can continue (the first two of three 0xE4s) stay
    U+FFFDs, as does a U+FFFD written whole, and a reply ending in a whole character keeps it."""
    tok = engine.tokenizer
    lead = tok.convert_tokens_to_ids("\u00e4")  # the byte-level token of the byte 0xE4 alone
    whole = tok("\u4e2d", add_special_tokens=False)["input_ids"]
    replacement = tok("\ufffd", add_special_tokens=False)["input_ids"]  # U+FFFD written whole, one token here
    assert tok.decode([lead]) == "\ufffd" and len(whole) == 1 and len(replacement) == 1
    for token, count, text in ((lead, 1, ""), (lead, 3, "\ufffd\ufffd"), (whole[0], 2, "\u4e2d\u4e2d"),
                               (replacement[0], 2, "\ufffd\ufffd")):
        sp = dict(GREEDY, max_new_tokens=count, logit_bias={str(token): 100.0})
        out = engine.generate(PROMPTS[1], sp)
        assert out["output_ids"] == [token] * count and out["text"] == text, out
        chunks = list(engine.generate(PROMPTS[1], sp, stream=True))
        assert "".join(c["text"] for c in chunks) == text
        assert [t for c in chunks for t in c["output_ids"]] == [token] * count


def test_max_new_tokens_must_fit_the_context_beside_the_prompt(tiny_model_dir):
    """A prompt that fits with a max_new_tokens that does not was cut short without a word; it is refused naming the
    numbers (SGLang's and vLLM's rule), before anything of its list is queued. None (SGLang's null) decodes up to
    the context, as many tokens as the largest number allowed; so does the default where the context ends first."""
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, context_length=64) as eng:
        n = len(eng.tokenizer(PROMPTS[1])["input_ids"])
        with pytest.raises(ValueError, match=f"prompt of {n} tokens and max_new_tokens {65 - n} exceed the context "
                                             f"length 64: at most {64 - n} new tokens fit"):
            eng.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, dict(GREEDY, max_new_tokens=65 - n)])
        assert eng.get_server_info()["stats"]["requests_submitted"] == 0
        outs = eng.generate([PROMPTS[1]] * 2, [dict(GREEDY, max_new_tokens=64 - n), dict(GREEDY, max_new_tokens=None)])
        assert outs[0]["output_ids"] == outs[1]["output_ids"] and len(outs[0]["output_ids"]) == 64 - n
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 2
        # The default (128, not asked for) is not held to the context, as SGLang holds only a given number.
        default = eng.generate(PROMPTS[1], {"temperature": 0, "ignore_eos": True})
        assert default["output_ids"] == outs[0]["output_ids"]
        assert default["meta_info"]["finish_reason"]["message"] == "context length reached"
        eng.check_kv_invariant()


def test_kv_exhaustion_retracts_and_keeps_outputs(tiny_model_dir, engine):
    expected = ids_of(engine.generate(PROMPTS * 2, dict(GREEDY, max_new_tokens=40)))
    # 8 usable pages of 16: far less than 10 requests x ~60 tokens; requests must take turns.
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=160, page_size=16) as small:
        out = small.generate(PROMPTS * 2, dict(GREEDY, max_new_tokens=40))
        small.check_kv_invariant()
        retractions = small.get_server_info()["stats"]["retractions"]
    assert ids_of(out) == expected
    assert retractions > 0


def test_prompt_larger_than_pool_is_rejected_and_engine_lives_on(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=32) as small:
        with pytest.raises(ValueError, match="KV slots"):
            small.generate(input_ids=list(range(100, 140)), sampling_params=GREEDY)
        # a request that fits its prompt but cannot grow further ends with a clear abort, alone
        out = small.generate(input_ids=list(range(100, 120)), sampling_params=dict(GREEDY, max_new_tokens=100))
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "KV pool exhausted" in reason["message"], reason
        assert reason["status_code"] == 503 and reason["err_type"] == "kv_pool_exhausted"
        assert len(small.generate("hi", dict(GREEDY, max_new_tokens=3))["output_ids"]) == 3
        small.check_kv_invariant()


def test_bad_input_gives_clear_errors(engine):
    with pytest.raises(TypeError, match="temprature"):
        engine.generate("x", {"temprature": 0.5})
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("x", {"top_p": 0})
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[10**9])
    # a bad item in a list raises before anything is queued
    with pytest.raises(TypeError):
        engine.generate(["a", "b"], [GREEDY, {"bogus": 1}])
    # a lone surrogate (what JSON's "\\ud800" decodes to) is named, not left to the tokenizer's own TypeError
    with pytest.raises(ValueError, match="prompt 1 is not valid Unicode: surrogates not allowed at index 1"):
        engine.generate(["ok", "a\ud800b"], GREEDY)
    with pytest.raises(ValueError, match="prediction is not valid Unicode"):
        engine.generate("x", dict(GREEDY, prediction="y\udfff"))


def test_stream_must_be_a_bool(engine):
    for stream in ("no", 1, None):  # "no" used to return a stream
        with pytest.raises(TypeError, match="stream must be a bool"):
            engine.generate("a", {"max_new_tokens": 2}, stream=stream)
    engine.check_kv_invariant()


def test_log_level_info_shows_the_start_up_choices_on_its_own(tiny_model_dir):
    """A script that sets up no logging: log_level="info" printed nothing (Python's last resort shows warnings)."""
    import subprocess
    import sys

    script = ("import specjet\n"
              f"with specjet.Engine(model_path={str(tiny_model_dir)!r}, max_total_tokens=256, log_level='info') as e:\n"
              "    e.generate('a', {'max_new_tokens': 1})\n"
              "    e.check_kv_invariant()\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "specjet.models.runner INFO KV cache: 256 tokens" in run.stderr


def test_unknown_engine_arg_is_named(tiny_model_dir):
    with pytest.raises(TypeError, match="max_batch_size"):
        specjet.Engine(model_path=str(tiny_model_dir), max_batch_size=4)


def test_hybrid_ngram_needs_eagle_and_a_count(tiny_model_dir):
    with pytest.raises(ValueError, match="needs speculative_algorithm='EAGLE'"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_hybrid_ngram_tokens=4)
    with pytest.raises(ValueError, match="speculative_hybrid_ngram_tokens must be >= 0"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="EAGLE", speculative_hybrid_ngram_tokens=-1)


def test_speculation_without_batch_invariance_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="enable_deterministic_inference=True"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="NGRAM",
                       enable_deterministic_inference=False)


@pytest.mark.parametrize("kind,spec,words", [
    ("json_schema", '{"type": "object", "properties": ', "invalid json_schema"),  # not JSON
    ("regex", "(yes|no", "regex could not be parsed: .*parenthesis is not closed"),
    ("ebnf", 'root ::= "a" value', 'ebnf could not be parsed: .*Rule "value" is not defined'),
    ("ebnf", 'root ::= r "!"\nr[max_tokens=2] ::= "ab" | "abcd"', r"ebnf rule budgets in tokens are not supported"),
])
def test_a_spec_xgrammar_cannot_parse_is_refused_at_the_door(engine, kind, spec, words):
    """Known before anything is queued, so the call raises for the whole list, with xgrammar's reason (it was an
    abort after the request had queued for its compile), and the engine serves the next caller as before."""
    alone = engine.generate(PROMPTS[0], GREEDY)
    submitted = engine.scheduler.stats["requests_submitted"]
    with pytest.raises(ValueError, match=words):
        engine.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, dict(GREEDY, **{kind: spec})])
    assert engine.scheduler.stats["requests_submitted"] == submitted  # neither request was queued
    assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == alone["output_ids"]
    engine.check_kv_invariant()


SCHEMAS_THE_COMPILE_REFUSES = [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
     "json_schema could not be compiled: .*defs"),  # a dangling $ref
    ({"type": "strnig"}, 'json_schema could not be compiled: Unsupported type "strnig"'),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # requires its own kind: no text ends
     "json_schema admits no finite output"),
]


@pytest.mark.parametrize("schema,words", SCHEMAS_THE_COMPILE_REFUSES)
def test_a_schema_the_compile_refuses_within_the_doors_wait_is_refused_at_the_door(engine, schema, words):
    """The door starts the request's compile and waits for it (up to door_compile_wait_s: the request could not start
    before it anyway): what the compile refuses by then raises for the whole call, with the reason, and nothing of the
    call is queued."""
    submitted = engine.scheduler.stats["requests_submitted"]
    with pytest.raises(ValueError, match=words):
        engine.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, dict(GREEDY, json_schema=schema)])
    assert engine.scheduler.stats["requests_submitted"] == submitted
    engine.check_kv_invariant()


def test_the_compile_the_door_started_is_the_requests_own(engine, monkeypatch):
    """One compile request a grammar request: the door's (submit starts no second one), and a wait of 0 leaves it to
    submit."""
    backend = engine.scheduler.grammar_backend
    calls = []
    real = backend.compile
    monkeypatch.setattr(backend, "compile", lambda *key: calls.append(key) or real(*key))
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], [dict(GREEDY, regex="(yes|no) (maybe|never)"), GREEDY])
    assert calls == [("regex", "(yes|no) (maybe|never)")] and outs[0]["meta_info"]["finish_reason"]["type"] == "stop"
    monkeypatch.setattr(backend, "door_compile_wait_s", 0.0)
    engine.generate(PROMPTS[0], dict(GREEDY, regex="(yes|no) (maybe|never)"))
    assert len(calls) == 2
    engine.check_kv_invariant()


@pytest.mark.parametrize("schema,words", SCHEMAS_THE_COMPILE_REFUSES)
def test_a_schema_the_compile_refuses_after_the_doors_wait_fails_alone(engine, schema, words, monkeypatch):
    """Past the door's wait (0 here: a compile slower than the wait), what the compile refuses fails its request
    alone, with the reason, while its batch mates are served."""
    monkeypatch.setattr(engine.scheduler.grammar_backend, "door_compile_wait_s", 0.0)
    outs = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                           [GREEDY, dict(GREEDY, json_schema=schema), dict(GREEDY, regex="[a-z]+")])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "length"
    reason = outs[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and re.search(words, reason["message"]), reason
    assert reason["status_code"] == 400 and reason["err_type"] == "invalid_grammar"
    assert outs[2]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    engine.check_kv_invariant()


def test_a_grammar_that_allows_no_token_fails_alone_and_says_so(engine):
    """A regex that compiles but matches no text masks every logit at its first step: that request ends with an
    abort that says why, its batch mates get what they get alone, and nothing leaks."""
    alone = engine.generate(PROMPTS[1], GREEDY)
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], [dict(GREEDY, regex="[^\\x00-\\U0010FFFF]"), GREEDY])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "the grammar allows no token" in reason["message"], reason
    assert reason["status_code"] == 400 and reason["err_type"] == "request_refused"
    assert outs[0]["text"] == "" and outs[0]["output_ids"] == [] and outs[0]["meta_info"]["completion_tokens"] == 0
    assert outs[1]["output_ids"] == alone["output_ids"]
    engine.check_kv_invariant()


def test_regex_constrains_a_random_model(engine):
    import re

    out = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 30, "regex": r"(yes|no), [0-9]{2,4}"})
    assert re.fullmatch(r"(yes|no), [0-9]{2,4}", out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_async_many_tasks_match_sync(engine):
    expected = ids_of(engine.generate(PROMPTS, GREEDY))
    results: list = [None] * len(PROMPTS)
    streamed: list = [None] * len(PROMPTS)

    async def one(i):
        results[i] = await engine.async_generate(PROMPTS[i], GREEDY)

    async def one_stream(i):
        ids = []
        async for chunk in await engine.async_generate(PROMPTS[i], GREEDY, stream=True):
            ids.extend(chunk["output_ids"])
        streamed[i] = ids

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
                tg.start_soon(one_stream, i)

    anyio.run(main)
    assert ids_of(results) == expected
    assert streamed == expected


def test_chat_template_and_tokenizer(engine):
    text = engine.apply_chat_template("What is 2+2?")
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    assert engine.tokenizer.decode(engine.tokenizer("abc")["input_ids"]) == "abc"


def test_async_generate_tokenizes_off_the_event_loop(engine, monkeypatch):
    """A long prompt's tokenizing (and its checks) ran on the caller's event loop, which a server shares with
    every stream it is writing. Here the tokenizer holds one prompt until the loop itself releases it: that
    works only if the tokenizing runs elsewhere (on the loop it would wait out its 30 s and fail)."""
    import threading

    release, real = threading.Event(), engine.tokenizer

    class Holding:
        def __call__(self, text, *args, **kwargs):
            if text == "hold me":
                assert release.wait(30), "the event loop was blocked by the tokenizer"
            return real(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(engine, "tokenizer", Holding())
    beats, results = [], {}

    async def held():
        results["held"] = await engine.async_generate("hold me", GREEDY)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            for _ in range(5):  # the loop goes on while the prompt is held
                await anyio.sleep(0.01)
                beats.append(len(results))
            release.set()

    anyio.run(main)
    assert beats == [0] * 5
    assert results["held"]["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="context length"):  # a refusal still reaches the awaiting caller
        anyio.run(engine.async_generate, "x" * (engine.scheduler.config.context_len * 100))
