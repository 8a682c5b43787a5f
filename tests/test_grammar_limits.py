"""Limits of the grammar backend: compile timeout, spec size and depth, checks at the door, and
per-request futures, with the real SmolLM2 tokenizer.

The slow grammar is a small JSON schema of fixed-length strings: xgrammar needs about a second of
CPU per distinct length (on a 2024 server core), so a few of them outlast a timeout of a fraction of
a second on any CPU, while the schema passes every size and depth check.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import xgrammar as xgr

from specjet.grammar import GrammarBackend, GrammarBusyError, GrammarError, GrammarTimeoutError
from specjet.grammar.timed_runner import Closed, Outcome, Overloaded, TimedOut, TimedRunner

VOCAB_SIZE = 49152  # SmolLM2's LM head
TIMEOUT_S = 0.25


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    """Default limits, for the tests that do not depend on what was compiled before."""
    backend = GrammarBackend(tokenizer, VOCAB_SIZE)
    yield backend
    backend.shutdown()


@pytest.fixture
def make_backend(tokenizer):
    """GrammarBackend factory; at the end each is shut down and its timed-out compiles are waited
    for, so that none is left burning a core (or running at interpreter exit)."""
    made = []

    def make(**kwargs) -> GrammarBackend:
        backend = GrammarBackend(tokenizer, VOCAB_SIZE, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.shutdown()
        wait_until(lambda: backend.abandoned_compiles == 0, timeout_s=120)


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def slow_schema(tag: int, properties: int = 3) -> dict:
    """Seconds to compile (about 0.8 s a property); each `tag` gives other lengths, so xgrammar's cache cannot
    share them. A pattern's long bounded repetition of alternatives: xgrammar 0.2.9 compiles the fixed-length
    strings this once used (minLength = maxLength = 600) a hundred times faster than 0.2.8 did."""
    lengths = [1200 + 3 * tag + i for i in range(properties)]
    return {
        "type": "object",
        "properties": {f"p{n}": {"type": "string", "pattern": f"^(ab|cd|[0-9]){{{n}}}$"} for n in lengths},
        "required": [f"p{n}" for n in lengths],
    }


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---------------------------------------------------------------- timeout


def test_timed_out_compiles_free_their_slots_for_quick_ones(make_backend):
    backend = make_backend(compile_timeout_s=TIMEOUT_S, max_abandoned_compiles=3)
    start = time.monotonic()
    stalled = [backend.compile("json_schema", slow_schema(tag)) for tag in (0, 1)]  # both slots
    quick = backend.compile("regex", r"[0-9]{3}")  # queued behind them
    assert isinstance(quick.result(timeout=30), xgr.CompiledGrammar)
    for future in stalled:
        with pytest.raises(GrammarTimeoutError, match=rf"^json_schema compile timed out: its compile ran past "
                                                      rf"{TIMEOUT_S:g} s \(compile_timeout_s\)"):
            future.result(timeout=30)
    # Both stalled compiles are still running: the quick one did not wait for them to end.
    assert backend.abandoned_compiles == 2
    assert time.monotonic() - start < 20

    # The same spec again fails at once, without another compile.
    start = time.monotonic()
    again = backend.compile("json_schema", json.dumps(slow_schema(0), indent=2))  # same schema, other layout
    with pytest.raises(GrammarTimeoutError, match="an earlier compile of this grammar ran past"):
        again.result(timeout=0)
    assert time.monotonic() - start < 0.5
    assert backend.abandoned_compiles <= 2
    # ... and at the door, where the engine checks a request's spec before it queues the request.
    with pytest.raises(GrammarTimeoutError, match="an earlier compile of this grammar ran past"):
        backend.check_spec("json_schema", slow_schema(1))


def test_check_compiles_refuses_what_the_compile_refuses_and_leaves_time_limits_to_the_request(make_backend):
    """The door's wait: a spec the compile refuses within it raises (a fresh GrammarError with the compile's
    message); a compile past its time limit does not (load, not the spec, may be why), nor one still running when
    the wait ends; a wait of 0 starts nothing."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    backend = make_backend(compile_timeout_s=TIMEOUT_S)
    with pytest.raises(GrammarError, match="^json_schema admits no finite output"):
        backend.check_compiles([("regex", "[a-z]+"), ("json_schema", endless)])
    timed_out = backend.check_compiles([("json_schema", slow_schema(30))])  # past compile_timeout_s: no raise
    with pytest.raises(GrammarTimeoutError):  # ... the request gets the future, and the time limit with it
        timed_out[0].result(timeout=30)
    roomy = make_backend()  # no time limit: the slow compile is still running when the wait ends
    roomy.door_compile_wait_s = 0.05
    start = time.monotonic()
    (running,) = roomy.check_compiles([("json_schema", slow_schema(31))])
    assert time.monotonic() - start < 0.5 and not running.done()  # the request waits on it
    compiles = []
    real_compile = roomy._compile
    roomy._compile = lambda *key: compiles.append(key) or real_compile(*key)
    roomy.door_compile_wait_s = 0.0
    assert roomy.check_compiles([("json_schema", endless)]) is None  # nothing started, nothing raised
    assert compiles == []


def test_at_the_abandoned_cap_new_compiles_fail_fast_and_cached_ones_are_served(make_backend):
    backend = make_backend(compile_timeout_s=TIMEOUT_S, max_abandoned_compiles=1)
    cached = backend.compile("regex", r"[a-z]+").result(timeout=30)
    stalled = backend.compile("json_schema", slow_schema(2))
    with pytest.raises(GrammarTimeoutError):
        stalled.result(timeout=30)

    start = time.monotonic()
    refused = backend.compile("regex", r"[A-Z]+")
    with pytest.raises(GrammarBusyError, match=r"^regex not compiled: 1 compiles that timed out are still running "
                                               r"\(max_abandoned_compiles\); try again later$"):
        refused.result(timeout=1)
    assert time.monotonic() - start < 0.5
    assert backend.compile("regex", r"[a-z]+").result(timeout=0) is cached

    # Once the stalled compile ends, compiles start again, and its late grammar is served.
    wait_until(lambda: backend.abandoned_compiles == 0, timeout_s=120)
    assert isinstance(backend.compile("regex", r"[A-Z]+").result(timeout=30), xgr.CompiledGrammar)
    assert isinstance(backend.compile("json_schema", slow_schema(2)).result(timeout=0), xgr.CompiledGrammar)


def test_shutdown_does_not_wait_for_a_running_compile(make_backend):
    backend = make_backend(compile_timeout_s=None)
    running = backend.compile("json_schema", slow_schema(3))
    time.sleep(0.1)
    start = time.monotonic()
    backend.shutdown()
    assert time.monotonic() - start < 0.5
    with pytest.raises(GrammarError, match="^the grammar backend is shut down$"):
        running.result(timeout=1)
    with pytest.raises(GrammarError, match="shut down"):
        backend.compile("regex", "x").result(timeout=0)


# ---------------------------------------------------------------- size, depth, check_spec


def test_spec_over_the_size_limit_fails_at_once(make_backend):
    backend = make_backend(max_spec_bytes=100)
    backend.check_spec("regex", "é" * 50)  # 100 bytes in UTF-8
    message = r"^regex is 102 bytes; the limit is 100 bytes \(max_spec_bytes\)$"
    with pytest.raises(GrammarError, match=message):
        backend.check_spec("regex", "é" * 51)
    with pytest.raises(GrammarError, match=message):
        backend.compile("regex", "é" * 51).result(timeout=0)
    # A JSON schema is measured as compact JSON, whatever its layout.
    schema = {"type": "object", "properties": {"name": {"type": "string", "description": "x" * 26}}}
    assert len(json.dumps(schema, separators=(",", ":"))) == 100
    backend.check_spec("json_schema", json.dumps(schema, indent=8))
    schema["properties"]["name"]["description"] += "x"
    with pytest.raises(GrammarError, match=r"^json_schema is 101 bytes; the limit is 100 bytes \(max_spec_bytes\)$"):
        backend.check_spec("json_schema", schema)


def test_default_size_limit(backend):
    assert backend.max_spec_bytes == 128 << 10
    with pytest.raises(GrammarError, match="max_spec_bytes"):
        backend.check_spec("ebnf", 'root ::= "' + "a" * (128 << 10) + '"')


@pytest.mark.parametrize("form", ["dict", "str"])
def test_deeply_nested_schema_is_a_grammar_error_not_a_recursion_error(backend, form):
    schema = nested_schema(5000)  # json.dumps and json.loads raise RecursionError on it
    spec = schema if form == "dict" else '{"properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    message = r"^json_schema nests objects and arrays more than 128 levels deep \(max_spec_depth\)$"
    with pytest.raises(GrammarError, match=message):
        backend.check_spec("json_schema", spec)
    with pytest.raises(GrammarError, match=message):
        backend.compile("json_schema", spec).result(timeout=0)
    backend.check_spec("json_schema", nested_schema(63))  # 127 levels of JSON


def test_schema_that_contains_itself_is_refused(backend):
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    with pytest.raises(GrammarError, match="max_spec_depth"):
        backend.check_spec("json_schema", schema)


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("json_schema", '{"type": "object",}', r"^invalid json_schema: Expecting property name enclosed in double "
                                                r"quotes: line 1 column 19$"),
        ("json_schema", "[1, 2]", r"^invalid json_schema: expected an object or a boolean, got list$"),
        ("json_schema", 5, r"^invalid json_schema: expected an object or a boolean, got int$"),
        ("json_schema", {"maximum": float("nan")}, r"^invalid json_schema: Out of range float values"),
        ("json_schema", {"enum": [{1, 2}]}, r"^invalid json_schema: Object of type set is not JSON serializable$"),
        ("regex", None, r"^regex must be a string, got NoneType$"),
        ("ebnf", {"root": "x"}, r"^ebnf must be a string, got dict$"),
        ("regex", "a\ud800", r"^regex is not valid Unicode: surrogates not allowed at index 1$"),
        ("yaml", "x", r"^unsupported grammar kind 'yaml'"),
    ],
)
def test_check_spec_refuses_what_can_be_known_without_compiling(backend, kind, spec, message):
    with pytest.raises(GrammarError, match=message):
        backend.check_spec(kind, spec)
    with pytest.raises(GrammarError, match=message):
        backend.compile(kind, spec).result(timeout=0)


def test_check_spec_accepts_good_specs_without_compiling(backend, monkeypatch):
    compiles = []
    monkeypatch.setattr(backend, "_compile", lambda *key: compiles.append(key))
    for kind, spec in [("json_schema", {"type": "integer"}), ("json_schema", "true"), ("regex", "a(b)"),
                       ("ebnf", "root ::= [a-z]+"), ("json", None), ("json_schema", {"type": "foo"})]:
        assert backend.check_spec(kind, spec) is None  # a JSON schema's conversion errors come from compiling
    assert compiles == []


@pytest.mark.parametrize("kwargs", [{"compile_timeout_s": 0}, {"compile_timeout_s": -1.0},
                                    {"compile_timeout_s": float("nan")}, {"max_spec_bytes": 0},
                                    {"max_spec_bytes": True}, {"max_spec_depth": 2.5}, {"max_abandoned_compiles": 0}])
def test_bad_limits_are_refused(tokenizer, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GrammarBackend(tokenizer, VOCAB_SIZE, **kwargs)


# ---------------------------------------------------------------- per-request futures


def test_cancelling_one_request_leaves_the_shared_compile_to_the_others(make_backend, monkeypatch):
    backend = make_backend()
    compiles = []
    real_compile = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda *key: compiles.append(key) or real_compile(*key))
    schema = slow_schema(4, properties=1)
    first, second = backend.compile("json_schema", schema), backend.compile("json_schema", schema)
    assert first is not second
    # What the scheduler does when a request is aborted while its grammar compiles.
    assert not first.done() and first.cancel()
    grammar = second.result(timeout=60)
    assert isinstance(grammar, xgr.CompiledGrammar)
    assert first.cancelled()
    third = backend.compile("json_schema", schema)
    assert third.result(timeout=0) is grammar
    assert not third.cancel()  # done: cancelling is a no-op
    assert len(compiles) == 1


# ---------------------------------------------------------------- the runner under it, with Python calls


class Recorder:
    """on_done / on_late callbacks that record outcomes and let a test wait for them."""

    def __init__(self):
        self.done: dict[str, Outcome] = {}
        self.late: dict[str, Outcome] = {}
        self._changed = threading.Condition()

    def on_done(self, name):
        return lambda outcome: self._record(self.done, name, outcome)

    def on_late(self, name):
        return lambda outcome: self._record(self.late, name, outcome)

    def _record(self, into, name, outcome):
        with self._changed:
            assert name not in into, f"{name} reported twice"
            into[name] = outcome
            self._changed.notify_all()

    def wait(self, into, name, timeout_s=10.0) -> Outcome:
        with self._changed:
            assert self._changed.wait_for(lambda: name in into, timeout_s), f"no outcome for {name}"
            return into[name]


def blocked(release: threading.Event, value):
    def call():
        release.wait()
        return value
    return call


def test_runner_hands_the_slot_of_a_timed_out_call_to_the_next():
    runner, seen, release = TimedRunner(slots=1, timeout_s=0.05, max_abandoned=2), Recorder(), threading.Event()
    runner.submit(blocked(release, "stuck"), seen.on_done("stuck"), seen.on_late("stuck"))
    runner.submit(lambda: "quick", seen.on_done("quick"))  # waits for the only slot
    assert seen.wait(seen.done, "quick") == ("quick", None)
    result, error = seen.done["stuck"]
    assert result is None and isinstance(error, TimedOut)
    assert runner.abandoned == 1
    runner.submit(blocked(release, "stuck too"), seen.on_done("stuck too"), seen.on_late("stuck too"))
    assert isinstance(seen.wait(seen.done, "stuck too")[1], TimedOut)
    # At the cap, a new call fails at once instead of starting.
    runner.submit(lambda: "refused", seen.on_done("refused"))
    result, error = seen.done["refused"]
    assert isinstance(error, Overloaded) and error.args == (2,)
    release.set()
    assert seen.wait(seen.late, "stuck") == ("stuck", None)
    assert seen.wait(seen.late, "stuck too") == ("stuck too", None)
    wait_until(lambda: runner.abandoned == 0, timeout_s=10)
    runner.submit(lambda: "again", seen.on_done("again"))
    assert seen.wait(seen.done, "again") == ("again", None)


def test_runner_reports_exceptions_and_runs_calls_in_order():
    runner, seen = TimedRunner(slots=1, timeout_s=None, max_abandoned=1), Recorder()
    order = []
    release = threading.Event()
    runner.submit(blocked(release, "first"), seen.on_done("first"))
    for name in ("a", "b", "c"):
        runner.submit(lambda name=name: order.append(name), seen.on_done(name))
    runner.submit(lambda: 1 / 0, seen.on_done("raises"))
    release.set()
    assert isinstance(seen.wait(seen.done, "raises")[1], ZeroDivisionError)
    assert order == ["a", "b", "c"]


def test_runner_shutdown_fails_waiting_and_running_calls_at_once():
    runner, seen, release = TimedRunner(slots=1, timeout_s=None, max_abandoned=1), Recorder(), threading.Event()
    runner.submit(blocked(release, "running"), seen.on_done("running"), seen.on_late("running"))
    runner.submit(lambda: "waiting", seen.on_done("waiting"))
    start = time.monotonic()
    runner.shutdown()
    for name in ("running", "waiting"):
        assert isinstance(seen.wait(seen.done, name, timeout_s=1)[1], Closed)
    assert time.monotonic() - start < 1
    runner.submit(lambda: "late", seen.on_done("after"))
    assert isinstance(seen.done["after"][1], Closed)
    release.set()
    assert seen.wait(seen.late, "running") == ("running", None)


def test_runner_without_threads_fails_the_call_not_the_runner(monkeypatch):
    runner, seen = TimedRunner(slots=1, timeout_s=None, max_abandoned=1), Recorder()
    real_start = threading.Thread.start

    def start(thread):
        if thread.name.endswith("-wait"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    runner.submit(lambda: "x", seen.on_done("x"))
    assert str(seen.wait(seen.done, "x")[1]) == "can't start new thread"
    monkeypatch.setattr(threading.Thread, "start", real_start)
    runner.submit(lambda: "y", seen.on_done("y"))  # the slot was given back
    assert seen.wait(seen.done, "y") == ("y", None)


def test_requests_racing_the_end_of_a_compile_each_get_one_outcome(backend):
    # Requests arrive and cancel while compiles finish: compile() never raises, and every future
    # not cancelled ends with the one shared grammar.
    for round_ in range(10):
        pattern = rf"round{round_}-[a-z]{{1,{8 + round_}}}"
        barrier = threading.Barrier(8)
        futures, errors = [], []

        def request(index, pattern=pattern, barrier=barrier, futures=futures, errors=errors):
            try:
                barrier.wait()
                for _ in range(5):
                    future = backend.compile("regex", pattern)
                    futures.append(future)
                    if index % 2:
                        future.cancel()
                    time.sleep(0.001)
            except Exception as error:  # noqa: BLE001
                errors.append(error)

        threads = [threading.Thread(target=request, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        grammars = {id(f.result(timeout=30)) for f in futures if not f.cancelled()}
        assert len(grammars) == 1


def test_compile_threads_are_not_daemons(default_model_dir):
    """A compile thread that returns from xgrammar's C++ while the interpreter exits must not be a
    daemon: a daemon thread then aborts the process ("terminate called without an active
    exception", exit code 134). Started from the supervisor, a daemon, it would be one by default."""
    import transformers

    from specjet.grammar import GrammarBackend

    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    backend = GrammarBackend(tok, len(tok), compile_timeout_s=0.05)
    future = backend.compile("json_schema", slow_schema(40))
    with pytest.raises(GrammarTimeoutError):
        future.result(timeout=60)
    workers = [t for t in threading.enumerate() if t.name.startswith("specjet-grammar-") and not t.name.endswith("-wait")]
    assert workers and not any(t.daemon for t in workers)
    for t in workers:
        t.join(timeout=120)
