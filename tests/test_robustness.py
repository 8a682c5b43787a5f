"""One bad request fails alone: every parameter is checked at the door (a TypeError/ValueError
naming it, nothing queued), and what gets past the door can never stop the scheduler thread, abort
other requests or leak KV. Each numbered test is a defect of issue 13 that hung, aborted innocent
requests or leaked before it was fixed. Tiny random-weight model; every test ends healthy (thread
alive, idle, KV invariant)."""
from __future__ import annotations

import json
import time

import pytest

import specjet
from robustness_helpers import assert_healthy, bounded

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True, "seed": 3}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module", params=["overlap", "plain"])
def engine(request, tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, random_seed=0,
                        disable_overlap_schedule=request.param == "plain") as eng:
        yield eng


@pytest.fixture(autouse=True)
def healthy_after_each_test(request):
    yield
    if "engine" in request.fixturenames:
        assert_healthy(request.getfixturevalue("engine"))


@pytest.fixture(scope="module")
def innocent_expected(engine):
    return bounded(engine.generate, "An innocent request", GREEDY)["output_ids"]


BAD_PARAMS = [
    # (params, exception, words the message must contain)
    ({"stop": [None]}, TypeError, "stop"),
    ({"stop": 5}, TypeError, "stop"),
    ({"stop": [["x"]]}, TypeError, "stop"),
    ({"stop": ""}, ValueError, "stop"),
    ({"stop": ["ok", ""]}, ValueError, "stop"),
    ({"stop": ["s%d" % i for i in range(1025)]}, ValueError, "stop"),
    ({"stop": ["ok", "y" * 4097]}, ValueError, "stop"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": [True]}, TypeError, "stop_token_ids"),
    ({"seed": "42"}, TypeError, "seed"),
    ({"seed": 4.2}, TypeError, "seed"),
    ({"seed": True}, TypeError, "seed"),
    ({"seed": 2**64}, ValueError, "seed"),
    ({"seed": -1}, ValueError, "seed"),
    ({"top_k": 2**63}, ValueError, "top_k"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"top_k": 1.5}, TypeError, "top_k"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"temperature": 1e39}, ValueError, "temperature"),
    ({"top_p": float("nan")}, ValueError, "top_p"),
    ({"top_p": 0}, ValueError, "top_p"),
    ({"top_p": None}, TypeError, "top_p"),
    ({"min_p": float("nan")}, ValueError, "min_p"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ({"skip_special_tokens": 1}, TypeError, "skip_special_tokens"),
    ({"json_schema": 5}, TypeError, "json_schema"),
    ({"regex": ["a"]}, TypeError, "regex"),
    ({"ebnf": 3}, TypeError, "ebnf"),
    ({"json_schema": "{not json"}, ValueError, "json_schema"),
    ({"temprature": 0.5}, TypeError, "temprature"),
]


@pytest.mark.parametrize("params,exc,words", BAD_PARAMS, ids=[repr(p[0]) for p in BAD_PARAMS])
def test_bad_sampling_params_raise_at_the_door(engine, innocent_expected, params, exc, words):
    """Defects 1-5: each of these used to reach the scheduler thread (killing it, aborting every
    request, or leaking KV) or pass silently (stop="" ended every request after one token)."""
    with pytest.raises(exc, match=words):
        engine.generate("x", dict(GREEDY, **params))
    # ... as an item of a list: nothing of the list is queued
    with pytest.raises(exc, match=words):
        engine.generate(["good", "bad"], [GREEDY, dict(GREEDY, **params)])
    # the engine serves the next caller exactly as before
    assert bounded(engine.generate, "An innocent request", GREEDY)["output_ids"] == innocent_expected


def test_sampling_params_must_be_a_dict(engine):
    with pytest.raises(TypeError, match="sampling_params"):
        engine.generate("x", [("temperature", 0)])
    with pytest.raises(TypeError, match="sampling_params"):
        engine.generate("x", "greedy")


@pytest.mark.parametrize("bad", [[1, True, 2], [1, 2.0], ["1"], [-3], [10**9]])
def test_bad_input_ids_raise(engine, bad):
    with pytest.raises((TypeError, ValueError), match="input_ids"):
        engine.generate(input_ids=bad, sampling_params=GREEDY)


def test_large_top_k_and_tiny_temperature_sample_like_their_limits(engine):
    """A top_k beyond the vocabulary means no top-k; the output equals top_k=-1 with the same seed."""
    a = bounded(engine.generate, "x y", dict(SAMPLED, top_k=2**40))
    b = bounded(engine.generate, "x y", dict(SAMPLED, top_k=-1))
    assert a["output_ids"] == b["output_ids"]
    tiny = bounded(engine.generate, "x y", dict(SAMPLED, temperature=1e-30))
    assert tiny["output_ids"] == bounded(engine.generate, "x y", GREEDY)["output_ids"]


def test_duplicate_rids_are_refused(engine):
    """Defect 10: two live requests with one rid corrupted per-rid state and aborted a batch."""
    with pytest.raises(ValueError, match="rid"):
        engine.generate(["a", "b"], GREEDY, rid=["same", "same"])
    long = dict(GREEDY, max_new_tokens=400)
    stream = engine.generate("a", long, rid="live-one", stream=True)
    next(stream)
    with pytest.raises(ValueError, match="live-one"):
        engine.generate("b", GREEDY, rid="live-one")
    engine.abort_request("live-one")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    bounded(engine.wait_idle)
    # once finished, the rid may be used again
    assert bounded(engine.generate, "b", GREEDY, rid="live-one")["meta_info"]["id"] == "live-one"
    with pytest.raises(TypeError, match="rid"):
        engine.generate("b", GREEDY, rid=5)


def test_abort_does_not_cancel_a_shared_grammar_compile(engine):
    """Defect 9: aborting one request cancelled the compile its schema-twins were waiting on (a
    compile still queued behind busy compile slots could be cancelled)."""
    from test_grammar_limits import slow_schema

    def params(tag):  # each tag compiles for about a second
        return dict(GREEDY, max_new_tokens=30, json_schema=slow_schema(tag, properties=1))

    blockers = [engine.generate(f"block {tag}", params(tag), stream=True) for tag in (20, 21)]  # both slots
    first = engine.generate("first", params(22), rid="to-abort", stream=True)
    second = engine.generate("second", params(22), stream=True)  # shares the compile of "first"
    engine.abort_request("to-abort")
    reason = bounded(list, second)[-1]["meta_info"]["finish_reason"]
    assert reason["type"] in ("stop", "length"), reason
    assert list(first)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    for stream in blockers:
        assert bounded(list, stream)[-1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_deeply_nested_schema_raises_before_anything_of_the_list_is_queued(engine):
    """Defect 11: a schema nested thousands deep raised RecursionError mid-list."""
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    before = engine.get_server_info()["stats"]["requests_submitted"]
    with pytest.raises(ValueError, match="json_schema"):
        engine.generate(["fine", "too deep"], [GREEDY, dict(GREEDY, json_schema=schema)])
    assert engine.get_server_info()["stats"]["requests_submitted"] == before


def test_shutdown_answers_calls_still_in_the_inbox(tiny_model_dir):
    """Defect 8: a call that slipped in just before shutdown was never answered."""
    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096)
    futures = [specjet_call(eng, i) for i in range(8)]
    eng.shutdown()
    for f in futures:
        out = f.result(timeout=30)
        if isinstance(out, dict):  # served before the shutdown, or aborted by it
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "length" or (reason["type"] == "abort" and reason["status_code"] == 503
                                                  and reason["err_type"] == "engine_not_alive"), reason
        else:
            assert isinstance(out, RuntimeError) and "shut down" in str(out)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("late", GREEDY)
    assert not eng.is_alive()
    eng.scheduler.check_kv_invariant()  # the loop's thread has ended: nothing owns a slot any more
    eng.scheduler.flush_cache()  # nor holds a cached prefix: the cache can give every slot back
    assert eng.scheduler.allocator.num_free_slots == eng.scheduler.allocator.size


def test_shutdown_with_a_message_tells_every_request_it_ends(tiny_model_dir):
    """shutdown(message) (a server's drain deadline): each request it ends is an abort 503 engine_not_alive saying
    the message, a stream's last chunk included, and nothing is left holding a slot."""
    import threading

    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096)
    long = dict(GREEDY, max_new_tokens=None, ignore_eos=True)
    stream = eng.generate("streamed", long, stream=True)
    first = next(stream)
    results: list = []
    whole = threading.Thread(target=lambda: results.append(eng.generate("whole", long)))
    whole.start()
    deadline = time.monotonic() + 60
    while eng.get_server_info()["stats"]["requests_submitted"] < 2:
        assert time.monotonic() < deadline, "the whole reply's request never reached the engine"
        time.sleep(0.01)
    eng.shutdown("the server is shutting down (a test)")
    whole.join(30)
    assert not whole.is_alive()
    chunks = [first, *stream]
    for reason in (results[0]["meta_info"]["finish_reason"], chunks[-1]["meta_info"]["finish_reason"]):
        assert reason == {"type": "abort", "message": "the server is shutting down (a test)", "status_code": 503,
                          "err_type": "engine_not_alive"}, reason
    eng.scheduler.check_kv_invariant()


def specjet_call(eng, i):
    from robustness_helpers import _pool

    def call():
        try:
            return eng.generate(f"prompt {i}", dict(GREEDY, max_new_tokens=200))
        except RuntimeError as exc:
            return exc
    return _pool.submit(call)


def test_context_limit_under_ngram_and_overlap_finishes_with_length(cyclic_model_dir):
    """Defect 6: with the host a batch behind, a request could reach a verify with no room left in
    its context and abort its whole batch with an internal error."""
    prompt = "a b c a b c a b c a b c a b c a b c a b c"
    for context_length in (90, 93, 96):
        with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, context_length=context_length,
                            speculative_algorithm="NGRAM", speculative_num_draft_tokens=8) as eng:
            outs = bounded(eng.generate, [prompt, prompt + " a", "x y z"],
                           {"temperature": 0, "max_new_tokens": None, "ignore_eos": True})
            for out in outs:
                reason = out["meta_info"]["finish_reason"]
                assert reason["type"] == "length", reason
                assert out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] == context_length
            assert_healthy(eng)


def test_eagle_prompt_that_leaves_no_room_for_drafting_is_refused_at_the_door(tiny_model_dir, tmp_path):
    """Defect 7: a prompt that fit the pool but not the pool plus the drafter's scratch was accepted
    and then blocked admission for every request behind it, for ever."""
    from test_spec_eagle import random_head

    head = random_head(tmp_path / "head", tiny_model_dir)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=256, speculative_algorithm="EAGLE",
                        speculative_draft_model_path=str(head)) as eng:
        with pytest.raises(ValueError, match="KV"):
            eng.generate(input_ids=[100 + i % 50 for i in range(250)], sampling_params=GREEDY)
        out = bounded(eng.generate, "a short one", GREEDY)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert_healthy(eng)


@pytest.mark.parametrize("kwargs,exc,name", [
    ({"page_size": "1"}, TypeError, "page_size"),
    ({"max_total_tokens": True}, TypeError, "max_total_tokens"),
    ({"mem_fraction_static": float("nan")}, ValueError, "mem_fraction_static"),
    ({"random_seed": 1.5}, TypeError, "random_seed"),
    ({"context_length": 0}, ValueError, "context_length"),
    ({"log_level": "loud"}, ValueError, "log_level"),
    ({"disable_overlap_schedule": "no"}, TypeError, "disable_overlap_schedule"),
    ({"speculative_num_steps": 0, "speculative_algorithm": "EAGLE"}, ValueError, "speculative_num_steps"),
    ({"grammar_token_timeout": 0}, ValueError, "grammar_token_timeout"),
    ({"grammar_token_timeout": float("nan")}, ValueError, "grammar_token_timeout"),
    ({"grammar_token_timeout": "1"}, TypeError, "grammar_token_timeout"),
    # A prefill budget under a page held no chunk: a longer prompt waited for ever.
    ({"page_size": 16, "max_prefill_tokens": 8}, ValueError, "max_prefill_tokens"),
    ({"device": "gpu"}, ValueError, "device"),
    ({"device": "cuda:x"}, ValueError, "device"),
    ({"speculative_algorithm": "eagle"}, ValueError, "speculative_algorithm"),
])
def test_bad_engine_arguments_raise_naming_the_argument(kwargs, exc, name):
    from specjet.engine.args import EngineArgs

    with pytest.raises(exc, match=name):
        EngineArgs.from_kwargs(**kwargs)


def test_a_context_longer_than_the_models_is_refused(tiny_model_dir):
    """The tiny model's max_position_embeddings is 2048: a longer context_length was taken silently (positions the
    model never saw, and a token table row of that length for every running request)."""
    with pytest.raises(ValueError, match="context_length=4096 is longer than the model's max_position_embeddings"):
        specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, context_length=4096)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, context_length=2048) as eng:
        assert eng.generate("a", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        eng.check_kv_invariant()


def test_a_schema_pattern_over_the_check_budget_ends_checked_as_unknown_and_alone(tiny_model_dir):
    """A backtracking pattern xgrammar does not enforce ("not"), on an output of 40 "a"s (the enforced pattern's):
    the output check gives up within its budget ("not checked"), the request ends "stop", and a request decoding
    beside it gets its whole output."""
    from specjet.grammar.output_check import PATTERN_BUDGET_S

    schema = {"type": "string", "pattern": "^a{40}$", "not": {"pattern": "^(a|aa)+b$"}}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096) as eng:
        checked, beside = bounded(eng.generate, ["x", "y"], [
            {"temperature": 0, "max_new_tokens": 60, "json_schema": schema},
            {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True}])
        assert checked["text"] == '"' + "a" * 40 + '"' and checked["meta_info"]["finish_reason"]["type"] == "stop"
        assert checked["meta_info"]["json_schema_valid"] is None
        assert f"more than {PATTERN_BUDGET_S * 1e3:.0f} ms" in checked["meta_info"]["json_schema_message"]
        assert beside["meta_info"]["completion_tokens"] == 50
        eng.check_kv_invariant()


def test_sizes_no_memory_can_hold_are_refused_naming_them(tiny_model_dir):
    """A KV pool or a token table larger than the memory available: a ValueError naming the argument before
    anything is allocated (were the allocator's RuntimeError or OSError)."""
    with pytest.raises(ValueError, match="max_total_tokens=1000000000000000 needs"):  # exabytes: no machine has them
        specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=10**15)
    with pytest.raises(ValueError, match="max_running_requests=1000000000 requests"):
        specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=10**9)


def test_a_cuda_device_without_cuda_is_refused_at_the_door():
    import torch

    from specjet.engine.args import EngineArgs

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    for device in ("cuda", "cuda:0"):  # was torch's AssertionError "Torch not compiled with CUDA enabled" at load
        with pytest.raises(ValueError, match="sees no CUDA device"):
            EngineArgs.from_kwargs(device=device)


def test_a_grammar_over_the_compile_time_limit_fails_alone(tiny_model_dir):
    """Defect 11: a pathological schema held its requests (and a compile slot) for as long as
    xgrammar took; now it fails its request with a clear error and others go on."""
    from test_grammar_limits import slow_schema

    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, grammar_compile_timeout=0.05) as eng:
        slow, quick = bounded(eng.generate, ["a", "b"], [dict(GREEDY, json_schema=slow_schema(11)),
                                                         dict(GREEDY, regex="(yes|no)")])
        reason = slow["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "timed out" in reason["message"], reason
        assert reason["status_code"] == 400 and reason["err_type"] == "invalid_grammar"  # the spec's own fault
        assert quick["meta_info"]["finish_reason"]["type"] == "stop" and quick["text"] in ("yes", "no")
        # A second timed-out compile reaches max_abandoned_compiles (2) while both still run (seconds each): a new
        # spec is then not compiled, a condition that passes (503), not the spec's fault.
        (second,) = bounded(eng.generate, ["d"], [dict(GREEDY, json_schema=slow_schema(12))])
        assert second["meta_info"]["finish_reason"]["err_type"] == "invalid_grammar"
        busy = bounded(eng.generate, "e", dict(GREEDY, regex="(maybe|never)"))["meta_info"]["finish_reason"]
        assert busy["type"] == "abort" and "compiles that timed out are still running" in busy["message"], busy
        assert busy["status_code"] == 503 and busy["err_type"] == "grammar_compiler_busy"
        with pytest.raises(ValueError, match="bytes"):
            eng.generate("c", dict(GREEDY, regex="a" * (200 << 10)))
        assert_healthy(eng)


# Ambiguous: every split of the x's is a parse, so matching a token costs more the longer the text (cubic).
AMBIGUOUS_EBNF = 'root ::= a+\na ::= a a | "x"'


@pytest.mark.parametrize("speculative", [False, True])
def test_a_grammar_whose_matching_grows_without_bound_ends_alone(tiny_model_dir, speculative):
    """An ambiguous grammar took ~0.4 s of the scheduler's thread a token after 160 tokens and seconds soon after,
    while every other request waited. Past grammar_token_timeout its request ends (abort, naming the limit); the
    request beside it gets its output alone, and a grammar that matches in constant time is never cut. (The default
    engine drafts a constrained request's n-grams and forced text: the speculative case.)"""
    innocent = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    no_end = {"logit_bias": {"0": -100.0, "1": -100.0, "2": -100.0}}  # the grammar may end after any "x"
    ambiguous = dict(no_end, temperature=0, max_new_tokens=600, ebnf=AMBIGUOUS_EBNF)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=8192, grammar_token_timeout=0.002,
                        disable_guided_drafting=not speculative) as eng:
        alone = eng.generate("The cat sat on", innocent)
        outs = bounded(eng.generate, ["The cat sat on", "x"], [innocent, ambiguous])
        plain_x = eng.generate("x", dict(no_end, temperature=0, max_new_tokens=200, ebnf='root ::= "x"+'))
        assert_healthy(eng)
    assert outs[0]["output_ids"] == alone["output_ids"]
    reason = outs[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "grammar_token_timeout" in reason["message"], reason
    assert 0 < outs[1]["meta_info"]["completion_tokens"] < 600 and set(outs[1]["text"]) == {"x"}
    assert plain_x["meta_info"]["finish_reason"]["type"] == "length"


def test_a_text_surely_longer_than_the_context_is_refused_without_tokenizing_it(engine, monkeypatch):
    """A 50 MB prompt took the tokenizer 40 s and 6.6 GB before its length was checked (a few hundred MB more and
    the host kills the engine). A text longer than the context times the vocabulary's longest token cannot fit:
    it is refused before the tokenizer sees it. A text within that bound is still measured in tokens: a
    prediction of 81-character tokens (a newline and 80 spaces: this vocabulary's longest) that fits the context
    is served, where a fixed 64 characters a token refused it."""
    ctx = engine.scheduler.config.context_len
    longest = "\n" + " " * 80
    assert engine.tokenizer(longest * 3, add_special_tokens=False)["input_ids"] == \
        engine.tokenizer(longest, add_special_tokens=False)["input_ids"] * 3
    real_tokenizer = engine.tokenizer

    class Guard:
        def __call__(self, text, *args, **kwargs):
            assert len(text) <= ctx * len(longest), "the tokenizer was given a text that cannot fit"
            return real_tokenizer(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(real_tokenizer, name)

    monkeypatch.setattr(engine, "tokenizer", Guard())
    too_long = "hello world " * (ctx * len(longest) // 12 + 1)
    with pytest.raises(ValueError, match="prompt of at least .* does not fit the context length"):
        engine.generate(too_long, GREEDY)
    with pytest.raises(ValueError, match="prediction of .* longer than the context length"):
        engine.generate("a", dict(GREEDY, prediction=too_long))
    prediction = longest * (ctx - 64)  # more than 64 characters a token, fewer tokens than the context
    assert len(prediction) > 64 * ctx
    out = engine.generate("a", dict(GREEDY, prediction=prediction))
    assert out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("costs_ms, ends_at", [([30, 30, 1] * 10, None), ([1, 30, 30, 30, 1], 4)])
def test_only_a_streak_of_slow_grammar_tokens_ends_a_request(tiny_model_dir, monkeypatch, costs_ms, ends_at):
    """A huge enum's first tokens can each take a few milliseconds to match and then almost none; an ambiguous
    grammar's cost only grows. A request ends at its third slow token in a row, not at scattered slow ones (the
    scheduler's clock replaced by one that charges each token's match these costs)."""
    import specjet.scheduler.scheduler as scheduler_module

    costs, now, calls = iter(costs_ms), [0.0], [0]

    def clock():
        calls[0] += 1
        if calls[0] % 2 == 0:  # the second reading of a token's match
            now[0] += next(costs, 1) / 1000
        return now[0]

    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, grammar_token_timeout=0.02,
                        disable_guided_drafting=True) as eng:
        monkeypatch.setattr(scheduler_module, "grammar_clock", clock)
        out = eng.generate("x", {"temperature": 0, "max_new_tokens": 20, "regex": "[a-z ]+",
                                 "logit_bias": {"0": -100.0, "1": -100.0, "2": -100.0}})
        assert_healthy(eng)
    reason = out["meta_info"]["finish_reason"]
    if ends_at is None:
        assert reason["type"] == "length", reason
    else:
        assert reason["type"] == "abort" and "3 tokens in a row" in reason["message"], reason
        assert out["meta_info"]["completion_tokens"] == ends_at
