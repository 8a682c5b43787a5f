"""A soak test: one Engine, many callers, valid and invalid requests, aborts and cancellations.

    python -m bench.soak --minutes N [--threads 12] [--async-tasks 12] [--seed 0] [--call-timeout 120]
                         [--speculative-algorithm {none,NGRAM,EAGLE,DFLASH} ...] [--fault-rate P]
                         [engine flags] [--result-file F]

For N minutes (per configuration: ``--speculative-algorithm none NGRAM EAGLE DFLASH`` runs four soaks, one
engine each), ``--threads`` threads and ``--async-tasks`` anyio tasks (one event loop on a thread of
its own) each send one random call after another to the same Engine:

- valid requests: greedy and seeded sampled text (some with penalties), ``json_schema`` (the JSON-schema dev set, as a dict
  or as text), ``regex``, ``ebnf``, stop strings, ``stop_token_ids``, ``input_ids``, lists of prompts,
  a long prompt, ``max_new_tokens`` 0 to 96 (mostly under 25), streamed (sync and async iterators) or not;
  with a context of at most 2048 (``--context-length``), prompts that end a few tokens short of it;
- invalid requests, which must raise TypeError/ValueError at the door: bad types and values of every
  sampling parameter, unknown parameter names, duplicate rids (in one list, and of a live request),
  malformed grammars, a 5000-deep schema, over-long prompts, bad prompts and input ids;
- aborts and cancellations: ``abort_request`` on a running request, ``anyio.fail_after`` /
  ``move_on_after`` around calls and streams, streams closed, broken out of or dropped unread.

Every call runs under a watchdog: one that has not returned after ``--call-timeout`` seconds is a
HANG. Outcomes per request: served (stop/length), refused at the door (by exception type), aborted
or cancelled by us, grammar-compile aborts, other aborts, INTERNAL ERRORS (an abort whose err_type
is internal_error, or an exception other than TypeError/ValueError), engine died (RuntimeError),
hangs; and validation mismatches (an invalid request served, a valid one refused). At the end the
engine must go idle; then its KV invariant is checked, the prefix cache flushed, and leaked slots =
pool - free. PASS iff no
hang, no leaked slot, no internal error and the engine alive (exit status 1 otherwise).

``--fault-rate P`` (bench/faults.py) makes each compute item (a batch's forward, a speculative iteration) fail with
chance P, before it runs or after it has written its KV: the engine re-runs the requests of a failed batch and ends
only one whose own batches fail twice in a row, with a message naming the fault. Such ends are counted apart
("ended by injected faults") and do not fail the run; every other outcome is judged as without faults. The process's
resident memory is printed with each progress line, and its growth over the soak's second half (MB per
minute, once caches have filled) is reported beside the verdict, not judged. Appends one
JSON line per configuration to ``--result-file``.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import uuid

from bench import common
from bench.engine_info import describe_engine, speculation_str
from bench.faults import MARKER as FAULT_MARKER, FaultInjector
from specjet.arg_types import positive_float
from specjet.scheduler import finish_reasons

# Outcome labels, per request.
SERVED = "served"
REFUSED = "refused"              # TypeError/ValueError at the door (expected for invalid requests)
ABORTED_BY_US = "aborted_by_us"  # abort_request, a cancelled task, a stream closed/broken/dropped
GRAMMAR_ABORT = "grammar_abort"  # a grammar that cannot be compiled: the request's own error
OTHER_ABORT = "other_abort"      # an abort we did not ask for that names no internal error
INTERNAL = "internal_error"      # an abort of err_type internal_error
INJECTED = "injected_fault"      # an abort naming a fault --fault-rate injected (the engine's answer to it)
UNEXPECTED = "unexpected_exception"  # an exception other than TypeError/ValueError (or engine stopped)
ENGINE_DEAD = "engine_dead"      # RuntimeError: the engine is not running
HANG = "hang"
INVALID_ACCEPTED = "invalid_accepted"  # an invalid request that was not refused
VALID_REFUSED = "valid_refused"        # a valid request refused at the door

TEXTS = [
    "Write a haiku about the sea.",
    "What is 17 times 23? Think step by step.",
    "List three colors, one per line.",
    "Explain what a CPU cache is in one sentence.",
    "Say hello in French, Spanish and German.",
    "Describe a cat as a JSON object.",
    "Continue the sequence: 1, 2, 3, 4, 5,",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps",
    "Give me a short recipe for pancakes.",
    "Who wrote Hamlet?",
]
# Used where ../shared/data/jsonschema is missing.
INLINE_SCHEMAS = [
    {"name": "person", "prompt": "Describe a person as JSON with name and age.",
     "schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer"}}, "required": ["name", "age"]}},
    {"name": "colors", "prompt": "Give a JSON list of colors.",
     "schema": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
    {"name": "flag", "prompt": "Is the sky blue? Answer as JSON.",
     "schema": {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}},
]
REGEXES = [r"[A-Z][a-z]{1,10}( [a-z]{1,10}){0,4}\.", r"\d{3}-\d{3}-\d{4}", r"(yes|no|maybe)",
           r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"]
# The last: once "[" is written the grammar forces "a" for ever (a grammar whose jump-forward text never ends).
EBNFS = ['root ::= "yes" | "no"', 'root ::= [0-9]+ ("," [0-9]+)*', 'root ::= [0-9]+ | "[" more\nmore ::= "a" more']
# An object that must hold an object of its own kind: no finite JSON text is an instance.
ENDLESS_SCHEMA = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                  "$ref": "#/$defs/n"}
DEEP = 5000
# The "context_limit" case (a prompt a few tokens short of the context) runs only up to this context.
NEAR_LIMIT_MAX_CONTEXT = 2048


def _deep_schema_dict() -> dict:
    schema: dict = {"type": "string"}
    for _ in range(DEEP):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_SCHEMA_TEXT = '{"type": "array", "items": ' * DEEP + '{"type": "string"}' + "}" * DEEP


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------- workload
class Workload:
    """What the calls are made of, built once per engine: chat prompts, schemas, token ids."""

    def __init__(self, engine, schema_dir):
        self.engine = engine
        tok = engine.tokenizer
        self.prompts = [engine.apply_chat_template(t) for t in TEXTS]
        try:
            entries = common.jsonschema_prompts(folder=schema_dir)
            self.schemas = [{"name": e["name"], "prompt": e["prompt"], "schema": json.loads(e["schema"])}
                            for e in entries]
            self.schema_source = f"{len(self.schemas)} schemas from {schema_dir}"
        except (OSError, ValueError, KeyError):
            self.schemas = INLINE_SCHEMAS
            self.schema_source = f"{len(self.schemas)} inline schemas ({schema_dir} not readable)"
        for s in self.schemas:
            s["chat"] = engine.apply_chat_template(s["prompt"])
        self.vocab = engine.scheduler.vocab_size
        self.context = engine.scheduler.config.context_len
        self.pool = engine.scheduler.allocator.size
        self.stop_ids = sorted({ids[0] for t in (".", "\n", ",", " the")
                                if (ids := tok(t, add_special_tokens=False)["input_ids"])})
        self.prompt_ids = [tok(p)["input_ids"] for p in self.prompts[:4]]
        # A long but valid prompt: a few hundred tokens, well inside the context and the pool.
        paragraph = " ".join(TEXTS) + " "
        words = (paragraph * 40).split()
        target = max(16, min(600, self.context // 4, self.pool // 8))
        text = " ".join(words[:target])
        while len(tok(text)["input_ids"]) > target and len(text) > 10:
            text = text[: int(len(text) * 0.9)]
        self.long_prompt = engine.apply_chat_template("Summarise this: " + text)
        # Over-long: more tokens than the context holds.
        self.too_long_ids = [self.prompt_ids[0][0] if self.prompt_ids[0] else 1] * (self.context + 8)
        self.too_long_text = "hello " * (self.context + 64)
        # Prompts that end a few tokens short of the context (where speculation must cut its trees):
        # only where the context is short enough for such a prefill to be cheap (--context-length).
        self.near_limit_ids = None
        if self.context <= NEAR_LIMIT_MAX_CONTEXT and self.pool >= 4 * self.context:
            ids = [t for p in self.prompt_ids for t in p]
            self.near_limit_ids = (ids * (self.context // max(1, len(ids)) + 1))[: self.context - 1]

    # -- building blocks
    def prompt(self, rng) -> str:
        return rng.choice(self.prompts)

    @staticmethod
    def max_new(rng) -> int:
        r = rng.random()
        if r < 0.8:
            return rng.randint(1, 24)
        if r < 0.95:
            return rng.randint(32, 64)
        return rng.randint(65, 96)

    def sampled(self, rng) -> dict:
        params = {"temperature": rng.choice([0.5, 0.8, 1.0, 1.3]), "top_p": rng.choice([1.0, 0.95, 0.8]),
                  "top_k": rng.choice([-1, 20, 50]), "min_p": rng.choice([0.0, 0.05])}
        if rng.random() < 0.8:
            params["seed"] = rng.randrange(2**32)
        if rng.random() < 0.25:  # penalised rows take the worker's and the verifier's penalty paths
            params.update(frequency_penalty=rng.choice([0.0, 0.5, -0.3]), presence_penalty=rng.choice([0.0, 0.4]),
                          repetition_penalty=rng.choice([1.0, 1.2, 0.9]))
        return params

    def valid_params(self, rng, kind: str | None = None) -> tuple[str, dict, str | None]:
        """(kind, sampling params, a prompt that fits them or None)."""
        kind = kind or rng.choice(["greedy", "sampled", "json_schema", "regex", "ebnf", "stop", "stop_token_ids",
                                   "ignore_eos"])
        base = {"max_new_tokens": self.max_new(rng)}
        if kind == "greedy":
            return kind, dict(base, temperature=0), None
        if kind == "sampled":
            return kind, dict(base, **self.sampled(rng)), None
        if kind == "json_schema":
            s = rng.choice(self.schemas)
            schema = s["schema"] if rng.random() < 0.5 else json.dumps(s["schema"])
            params = {"max_new_tokens": rng.randint(32, 96), "json_schema": schema}
            params.update({"temperature": 0} if rng.random() < 0.6 else self.sampled(rng))
            return kind, params, s["chat"]
        if kind == "regex":
            return kind, dict(base, regex=rng.choice(REGEXES), temperature=rng.choice([0, 0.8])), None
        if kind == "ebnf":
            return kind, dict(base, ebnf=rng.choice(EBNFS), temperature=rng.choice([0, 0.8])), None
        if kind == "stop":
            stop = rng.choice([".", "\n", [".", "!", "?"], " the", ["\n\n", "fox"]])
            return kind, dict(base, stop=stop, temperature=rng.choice([0, 0.7])), None
        if kind == "stop_token_ids":
            ids = rng.sample(self.stop_ids, k=rng.randint(1, len(self.stop_ids)))
            return kind, dict(base, stop_token_ids=ids, temperature=rng.choice([0, 0.7])), None
        if kind == "ignore_eos":
            return kind, {"max_new_tokens": rng.randint(16, 64), "ignore_eos": True, "temperature": 0}, None
        raise ValueError(kind)

    def valid_call(self, rng) -> tuple[str, dict]:
        """(case name, keyword arguments of generate/async_generate) of a valid request."""
        r = rng.random()
        if r < 0.55:
            kind, params, prompt = self.valid_params(rng)
            return kind, {"prompt": prompt or self.prompt(rng), "sampling_params": params}
        if r < 0.65:  # a list of prompts, one params dict for all or one each
            n = rng.randint(2, 3)
            if rng.random() < 0.5:
                kind, params, _ = self.valid_params(rng, rng.choice(["greedy", "sampled", "stop", "regex"]))
                return f"list[{kind}]", {"prompt": [self.prompt(rng) for _ in range(n)], "sampling_params": params}
            picked = [self.valid_params(rng, rng.choice(["greedy", "sampled", "stop", "json_schema"])) for _ in range(n)]
            return "list[mixed]", {"prompt": [p or self.prompt(rng) for _, _, p in picked],
                                   "sampling_params": [params for _, params, _ in picked]}
        if r < 0.75:
            kind, params, _ = self.valid_params(rng, rng.choice(["greedy", "sampled", "stop_token_ids"]))
            ids = rng.choice(self.prompt_ids)
            if rng.random() < 0.3:
                return f"input_ids_list[{kind}]", {"input_ids": [ids, rng.choice(self.prompt_ids)],
                                                   "sampling_params": params}
            return f"input_ids[{kind}]", {"input_ids": ids, "sampling_params": params}
        if r < 0.79 and self.near_limit_ids is not None:  # ends at the context limit: "length", no abort
            room = rng.randint(1, 24)  # what the context leaves: asked for exactly, or as None (up to the context)
            return "context_limit", {"input_ids": self.near_limit_ids[: self.context - room],
                                     "sampling_params": {"temperature": rng.choice([0, 0.8]), "ignore_eos": True,
                                                         "max_new_tokens": rng.choice([room, None])}}
        if r < 0.82:
            return "long_prompt", {"prompt": self.long_prompt,
                                   "sampling_params": {"temperature": 0, "max_new_tokens": rng.randint(1, 16)}}
        if r < 0.86:
            return "max_new_tokens=0", {"prompt": self.prompt(rng), "sampling_params": {"max_new_tokens": 0}}
        if r < 0.9:
            return "default_params", {"prompt": self.prompt(rng),
                                      "sampling_params": {"max_new_tokens": rng.randint(1, 16)}}
        return "with_rid", {"prompt": self.prompt(rng), "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                            "rid": f"soak-{uuid.uuid4().hex}"}

    def invalid_calls(self) -> list[tuple[str, dict, bool]]:
        """(case name, keyword arguments, whether a grammar-compile abort is an acceptable answer)."""
        p = self.prompts[0]
        short = {"max_new_tokens": 4}

        def sp(**kw):
            return {"prompt": p, "sampling_params": dict(short, **kw)}

        cases = [
            ("stop=[None]", sp(stop=[None])), ("stop=5", sp(stop=5)), ("stop=[['x']]", sp(stop=[["x"]])),
            ('stop=""', sp(stop="")), ('stop=["a", ""]', sp(stop=["a", ""])),
            ('seed="42"', sp(seed="42", temperature=0.8)), ("seed=1.5", sp(seed=1.5, temperature=0.8)),
            ("seed=True", sp(seed=True, temperature=0.8)), ("seed=2**64", sp(seed=2**64, temperature=0.8)),
            ("seed=-1", sp(seed=-1, temperature=0.8)),
            ("top_k=2**63", sp(top_k=2**63, temperature=0.8)), ("top_k=0", sp(top_k=0)), ("top_k=-2", sp(top_k=-2)),
            ("top_k=2.5", sp(top_k=2.5)), ('top_k="5"', sp(top_k="5")),
            ("temperature=nan", sp(temperature=float("nan"))), ("temperature=inf", sp(temperature=float("inf"))),
            ("temperature=-1", sp(temperature=-1.0)), ('temperature="0.5"', sp(temperature="0.5")),
            ("temperature=1e39", sp(temperature=1e39)),
            ("top_p=0", sp(top_p=0.0, temperature=0.8)), ("top_p=1.5", sp(top_p=1.5)), ("top_p=nan", sp(top_p=float("nan"))),
            ("min_p=-0.1", sp(min_p=-0.1)), ("min_p=2", sp(min_p=2.0)), ("min_p=None", sp(min_p=None)),
            ("frequency_penalty=3", sp(frequency_penalty=3.0)), ("presence_penalty=nan", sp(presence_penalty=float("nan"))),
            ("repetition_penalty=0", sp(repetition_penalty=0.0)), ('repetition_penalty="1.2"', sp(repetition_penalty="1.2")),
            ("max_new_tokens=-1", sp(max_new_tokens=-1)), ('max_new_tokens="8"', sp(max_new_tokens="8")),
            ("max_new_tokens=8.0", sp(max_new_tokens=8.0)), ("max_new_tokens=10**6", sp(max_new_tokens=10**6)),
            ("stop_token_ids=5", sp(stop_token_ids=5)), ("stop_token_ids=[-1]", sp(stop_token_ids=[-1])),
            ("stop_token_ids=[10**9]", sp(stop_token_ids=[10**9])), ('stop_token_ids=["a"]', sp(stop_token_ids=["a"])),
            ("stop_token_ids=[2**70]", sp(stop_token_ids=[2**70])), ("stop_token_ids=[True]", sp(stop_token_ids=[True])),
            ('ignore_eos="yes"', sp(ignore_eos="yes")), ("skip_special_tokens=1", sp(skip_special_tokens=1)),
            ("unknown max_tokens", sp(max_tokens=8)), ("unknown bogus", sp(bogus=1)),
            ("json_schema=7", sp(json_schema=7)), ("regex=5", sp(regex=5)), ("ebnf=[]", sp(ebnf=[])),
            ("json_schema+regex", sp(json_schema={"type": "string"}, regex="a+")),
            ("json_schema deep dict", sp(json_schema=_deep_schema_dict())),
            ("sampling_params=str", {"prompt": p, "sampling_params": "greedy"}),
            ("sampling_params=[{}]*2 for 1", {"prompt": [p], "sampling_params": [{}, {}]}),
            ("prompt=5", {"prompt": 5, "sampling_params": short}),
            ('prompt=["a", 3]', {"prompt": ["a", 3], "sampling_params": short}),
            ("prompt=[]", {"prompt": [], "sampling_params": short}),
            ("prompt+input_ids", {"prompt": p, "input_ids": [1, 2], "sampling_params": short}),
            ("no prompt", {"sampling_params": short}),
            ("input_ids=[]", {"input_ids": [], "sampling_params": short}),
            ("input_ids=[-1]", {"input_ids": [-1], "sampling_params": short}),
            ("input_ids=[vocab]", {"input_ids": [self.vocab], "sampling_params": short}),
            ("input_ids=[1.0]", {"input_ids": [1.0], "sampling_params": short}),
            ("input_ids=[[1], 2]", {"input_ids": [[1], 2], "sampling_params": short}),
            ("rid=5", {"prompt": p, "sampling_params": short, "rid": 5}),
            ("rids of wrong length", {"prompt": [p, p], "sampling_params": short, "rid": ["a"]}),
            ("duplicate rids in a list", {"prompt": [p, p], "sampling_params": short,
                                          "rid": ["soak-dup", "soak-dup"]}),
            ("over-long input_ids", {"input_ids": self.too_long_ids, "sampling_params": short}),
            ("over-long prompt", {"prompt": self.too_long_text, "sampling_params": short}),
        ]
        grammar_cases = [  # refused at the door, or a per-request grammar-compile abort
            ('json_schema="{bad"', sp(json_schema="{bad")), ("json_schema=[1]", sp(json_schema="[1]")),
            ("json_schema deep text", sp(json_schema=DEEP_SCHEMA_TEXT)),
            ('regex="("', sp(regex="(")), ('regex="[z-a]"', sp(regex="[z-a]")), ('ebnf="root ::= "', sp(ebnf="root ::= ")),
            ("ebnf no root", sp(ebnf='start ::= "a"')),
            ("json_schema bad type", sp(json_schema={"type": "nonsense"})),
            ("json_schema with no finite instance", sp(json_schema=ENDLESS_SCHEMA)),
            ("ebnf with no finite output", sp(ebnf='root ::= "a" root')),
        ]
        return [(n, kw, False) for n, kw in cases] + [(n, kw, True) for n, kw in grammar_cases]


# ---------------------------------------------------------------------------------------------- bookkeeping
class Tracker:
    """Calls in flight, for the watchdog: one running longer than the bound is counted as a hang once;
    if it returns after that, ``end`` says so and its outcome is not counted again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[int, list] = {}  # id -> [start, case, worker, counted]
        self._next = 0

    def begin(self, case: str, worker: str) -> int:
        with self._lock:
            self._next += 1
            self._calls[self._next] = [time.monotonic(), case, worker, False]
            return self._next

    def end(self, token: int) -> bool:
        with self._lock:
            entry = self._calls.pop(token)
        return not entry[3]

    def overdue(self, bound: float) -> list[tuple[str, str, float]]:
        """Calls newly past the bound: (case, worker, seconds so far); each reported once."""
        now, out = time.monotonic(), []
        with self._lock:
            for entry in self._calls.values():
                if not entry[3] and now - entry[0] > bound:
                    entry[3] = True
                    out.append((entry[1], entry[2], now - entry[0]))
        return out

    def in_flight(self) -> tuple[int, int]:
        """(calls in flight, of which already counted as hangs)."""
        with self._lock:
            return len(self._calls), sum(1 for e in self._calls.values() if e[3])


class Stats:
    MAX_EXAMPLES = 5

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()          # label -> requests
        self.by_case = collections.defaultdict(collections.Counter)  # case -> label -> requests
        self.refused_by_type = collections.Counter()
        self.finish_types = collections.Counter()
        self.latency = collections.defaultdict(list)    # label -> call latencies (s)
        self.examples = collections.defaultdict(list)   # label -> [(case, message)]
        self.calls = collections.Counter()              # "sync"/"async" -> calls
        self.tokens = 0

    def record(self, case: str, mode: str, outcomes: list[tuple[str, int, str | None]], latency: float) -> None:
        with self.lock:
            self.calls[mode] += 1
            labels = {label for label, _, _ in outcomes}
            call_label = labels.pop() if len(labels) == 1 else "mixed"
            self.latency[call_label].append(latency)
            for label, tokens, message in outcomes:
                self.requests[label] += 1
                self.by_case[case][label] += 1
                self.tokens += tokens
                if label == REFUSED and message:
                    self.refused_by_type[message.split(":", 1)[0]] += 1
                if label not in (SERVED, REFUSED, ABORTED_BY_US) and message is not None:
                    examples = self.examples[label]
                    if len(examples) < self.MAX_EXAMPLES and (case, message) not in examples:
                        examples.append((case, message))

    def hang(self, case: str, worker: str, seconds: float) -> None:
        with self.lock:
            self.requests[HANG] += 1
            self.by_case[case][HANG] += 1
            if len(self.examples[HANG]) < self.MAX_EXAMPLES:
                self.examples[HANG].append((case, f"{worker}: no answer after {seconds:.0f} s"))

    def total(self, *labels) -> int:
        return sum(self.requests[label] for label in labels)


def classify_exception(exc: BaseException) -> tuple[str, str]:
    message = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, (TypeError, ValueError)):
        return REFUSED, message
    if isinstance(exc, RuntimeError) and ("not running" in str(exc) or "shut down" in str(exc)):
        return ENGINE_DEAD, message
    return UNEXPECTED, message


def classify_finish(reason: dict | None, we_aborted: bool) -> tuple[str, str | None]:
    if not isinstance(reason, dict):
        return OTHER_ABORT, f"no finish_reason: {reason!r}"
    kind = reason.get("type")
    if kind in ("stop", "length"):
        return SERVED, kind
    message = str(reason.get("message", ""))
    if kind != "abort":
        return OTHER_ABORT, f"finish_reason {reason!r}"
    err_type = reason.get("err_type")  # the engine's kind of abort (specjet/scheduler/finish_reasons.py)
    if FAULT_MARKER in message:
        return INJECTED, message[:300]
    if err_type == finish_reasons.INTERNAL_ERROR:
        return INTERNAL, message[:300]
    if err_type == finish_reasons.ABORTED:
        return (ABORTED_BY_US, None) if we_aborted else (OTHER_ABORT, message[:300])
    # A grammar the compile refused, or one decoding cannot go on under (a token the grammar rejected after its own
    # mask allowed it is an internal error, above).
    if err_type in (finish_reasons.INVALID_GRAMMAR, finish_reasons.GRAMMAR_COMPILER_BUSY,
                    finish_reasons.GRAMMAR_REFUSED):
        return GRAMMAR_ABORT, message[:300]
    return OTHER_ABORT, message[:300] or "abort with an empty message"


def results_outcomes(out, we_aborted: bool = False) -> list[tuple[str, int, str | None]]:
    """Outcomes of a non-streamed result (a dict, or a list of them)."""
    outs = out if isinstance(out, list) else [out]
    result = []
    for o in outs:
        label, message = classify_finish(o["meta_info"]["finish_reason"], we_aborted)
        result.append((label, len(o.get("output_ids") or []), message))
    return result


class StreamTally:
    """Chunks of a stream (possibly of several prompts), tallied per prompt."""

    def __init__(self, n: int):
        self.tokens = [0] * n
        self.finish: list[dict | None] = [None] * n
        self.chunks = 0

    def add(self, chunk: dict) -> None:
        i = chunk.get("index", 0)
        self.chunks += 1
        self.tokens[i] += len(chunk.get("output_ids") or [])
        reason = chunk["meta_info"]["finish_reason"]
        if reason is not None:
            self.finish[i] = reason

    def outcomes(self, we_aborted: bool) -> list[tuple[str, int, str | None]]:
        result = []
        for tokens, reason in zip(self.tokens, self.finish):
            if reason is None:  # we stopped reading before its end
                result.append((ABORTED_BY_US, tokens, None) if we_aborted else
                              (OTHER_ABORT, tokens, "stream ended without a finish_reason"))
            else:
                label, message = classify_finish(reason, we_aborted)
                result.append((label, tokens, message))
        return result


def _num_requests(kwargs: dict) -> int:
    value = kwargs.get("prompt", kwargs.get("input_ids"))
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 1


def _long_params(rng) -> dict:
    # Long enough to still be running when the abort or cancellation lands.
    return {"temperature": rng.choice([0, 0.8]), "max_new_tokens": rng.randint(200, 400), "ignore_eos": True}


# ---------------------------------------------------------------------------------------------- callers
class Soak:
    def __init__(self, engine, workload: Workload, args, stats: Stats, tracker: Tracker, stop: threading.Event):
        self.engine, self.wl, self.args = engine, workload, args
        self.stats, self.tracker, self.stop = stats, tracker, stop
        self.invalid = workload.invalid_calls()

    def pick(self, rng) -> str:
        r = rng.random()
        return "valid" if r < 0.6 else "invalid" if r < 0.8 else "abort"

    # -- one call, classified; the caller times it and records it
    def _finish_call(self, token, case, mode, outcomes, started) -> None:
        latency = time.monotonic() - started
        if self.tracker.end(token):  # not already counted as a hang by the watchdog
            self.stats.record(case, mode, outcomes, latency)

    @staticmethod
    def _expectation(outcomes, group: str, grammar_ok: bool):
        """Maps outcomes onto validation mismatches: an invalid request must be refused (or, for a bad
        grammar, aborted by its compile); a valid one must not be refused."""
        mapped = []
        for label, tokens, message in outcomes:
            if group == "invalid" and label == SERVED:
                mapped.append((INVALID_ACCEPTED, tokens, f"served ({message})"))
            elif group == "invalid" and label in (OTHER_ABORT, GRAMMAR_ABORT) and not (grammar_ok and label == GRAMMAR_ABORT):
                mapped.append((INVALID_ACCEPTED, tokens, f"not refused at the door, aborted: {message}"))
            elif group == "valid" and label == REFUSED:
                mapped.append((VALID_REFUSED, tokens, message))
            else:
                mapped.append((label, tokens, message))
        return mapped

    # ------------------------------------------------------------------ sync
    def sync_worker(self, wid: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + wid)
        name = f"thread-{wid}"
        while not self.stop.is_set():
            group = self.pick(rng)
            case, fn, n, grammar_ok = self._sync_case(group, rng)
            token, started = self.tracker.begin(case, name), time.monotonic()
            try:
                outcomes = fn()
            except Exception as exc:  # noqa: BLE001 - every failure is an outcome here
                label, message = classify_exception(exc)
                outcomes = [(label, 0, message)] * n
            outcomes = self._expectation(outcomes, group, grammar_ok)
            self._finish_call(token, case, "sync", outcomes, started)

    def _sync_case(self, group, rng):
        eng, wl = self.engine, self.wl
        if group == "invalid":
            case, kwargs, grammar_ok = rng.choice(self.invalid)
            return case, lambda: results_outcomes(eng.generate(**kwargs)), _num_requests(kwargs), grammar_ok
        if group == "valid":
            case, kwargs = wl.valid_call(rng)
            n = _num_requests(kwargs)
            if rng.random() < 0.3:
                def streamed():
                    tally = StreamTally(n)
                    for chunk in eng.generate(**kwargs, stream=True):
                        tally.add(chunk)
                    return tally.outcomes(False)
                return f"stream:{case}", streamed, n, False
            return case, lambda: results_outcomes(eng.generate(**kwargs)), n, False
        kind = rng.choice(["abort_request", "abort_request_stream", "stream_break", "stream_close",
                           "stream_drop_unread", "stream_drop_after_chunks", "duplicate_live_rid"])
        prompt, params, delay = wl.prompt(rng), _long_params(rng), rng.uniform(0.05, 2.0)
        chunks_wanted = rng.randint(1, 6)

        def abort_request():
            rid = f"soak-{uuid.uuid4().hex}"
            timer = threading.Timer(delay, eng.abort_request, args=(rid,))
            timer.start()
            try:
                return results_outcomes(eng.generate(prompt, params, rid=rid), we_aborted=True)
            finally:
                timer.cancel()

        def abort_request_stream():
            rid, tally = f"soak-{uuid.uuid4().hex}", StreamTally(1)
            for chunk in eng.generate(prompt, params, stream=True, rid=rid):
                tally.add(chunk)
                if tally.chunks == chunks_wanted:
                    eng.abort_request(rid)
            return tally.outcomes(True)

        def stream_break():
            tally = StreamTally(1)
            for chunk in eng.generate(prompt, params, stream=True):
                tally.add(chunk)
                if tally.chunks >= chunks_wanted:
                    break
            return tally.outcomes(True)

        def stream_close():
            tally = StreamTally(1)
            stream = eng.generate(prompt, params, stream=True)
            for chunk in stream:
                tally.add(chunk)
                if tally.chunks >= chunks_wanted:
                    stream.close()
                    break
            return tally.outcomes(True)

        def stream_drop_unread():
            eng.generate(prompt, params, stream=True)  # never read: dropping it must abort it
            return [(ABORTED_BY_US, 0, None)]

        def stream_drop_after_chunks():
            tally, stream = StreamTally(1), eng.generate(prompt, params, stream=True)
            for _ in range(chunks_wanted):
                chunk = next(stream, None)
                if chunk is None:
                    break
                tally.add(chunk)
            del stream
            return tally.outcomes(True)

        def duplicate_live_rid():
            rid, tally = f"soak-{uuid.uuid4().hex}", StreamTally(1)
            with eng.generate(prompt, params, stream=True, rid=rid) as stream:
                tally.add(next(stream))
                outcomes = []
                try:
                    out = eng.generate(prompt, {"max_new_tokens": 4}, rid=rid)
                except (TypeError, ValueError) as exc:
                    outcomes.append((REFUSED, 0, f"{type(exc).__name__}: {exc}"))
                else:  # the first may have ended already (it is long: unlikely): then this is valid
                    label, message = classify_finish(out["meta_info"]["finish_reason"], False)
                    if label == SERVED and tally.finish[0] is None:
                        label, message = INVALID_ACCEPTED, f"a second request with a live rid was served ({message})"
                    outcomes.append((label, len(out["output_ids"]), message))
            return tally.outcomes(True) + outcomes

        fns = {"abort_request": abort_request, "abort_request_stream": abort_request_stream,
               "stream_break": stream_break, "stream_close": stream_close, "stream_drop_unread": stream_drop_unread,
               "stream_drop_after_chunks": stream_drop_after_chunks, "duplicate_live_rid": duplicate_live_rid}
        return kind, fns[kind], 2 if kind == "duplicate_live_rid" else 1, False

    # ------------------------------------------------------------------ async
    def async_main(self) -> None:
        import anyio

        async def main():
            async with anyio.create_task_group() as tg:
                for i in range(self.args.async_tasks):
                    tg.start_soon(self.async_worker, i)

        anyio.run(main)

    async def async_worker(self, wid: int) -> None:
        import anyio

        rng = random.Random(self.args.seed * 1_000_003 + 500_000 + wid)
        name = f"task-{wid}"
        while not self.stop.is_set():
            group = self.pick(rng)
            case, fn, n, grammar_ok = self._async_case(group, rng)
            token, started = self.tracker.begin(case, name), time.monotonic()
            outcomes = None
            # The watchdog counts the hang; this only frees the task afterwards.
            with anyio.move_on_after(self.args.call_timeout + 5):
                try:
                    outcomes = await fn()
                except Exception as exc:  # noqa: BLE001
                    label, message = classify_exception(exc)
                    outcomes = [(label, 0, message)] * n
            if outcomes is None:
                outcomes = [(HANG, 0, f"{name}: no answer after {self.args.call_timeout + 5:.0f} s")] * n
            outcomes = self._expectation(outcomes, group, grammar_ok)
            self._finish_call(token, case, "async", outcomes, started)
            await anyio.sleep(0)

    def _async_case(self, group, rng):
        import anyio

        eng, wl = self.engine, self.wl
        if group == "invalid":
            case, kwargs, grammar_ok = rng.choice(self.invalid)

            async def invalid():
                return results_outcomes(await eng.async_generate(**kwargs))
            return case, invalid, _num_requests(kwargs), grammar_ok
        if group == "valid":
            case, kwargs = wl.valid_call(rng)
            n = _num_requests(kwargs)
            if rng.random() < 0.3:
                async def streamed():
                    tally = StreamTally(n)
                    async for chunk in await eng.async_generate(**kwargs, stream=True):
                        tally.add(chunk)
                    return tally.outcomes(False)
                return f"async_stream:{case}", streamed, n, False

            async def plain():
                return results_outcomes(await eng.async_generate(**kwargs))
            return case, plain, n, False
        kind = rng.choice(["fail_after", "move_on_after_stream", "async_for_break", "aclose", "abort_request_async",
                           "drop_unread_async", "fail_after_list"])
        prompt, params, delay = wl.prompt(rng), _long_params(rng), rng.uniform(0.05, 2.0)
        chunks_wanted = rng.randint(1, 6)

        async def fail_after(prompts=prompt):
            try:
                with anyio.fail_after(delay):
                    out = await eng.async_generate(prompts, params)
            except TimeoutError:
                return [(ABORTED_BY_US, 0, None)] * (len(prompts) if isinstance(prompts, list) else 1)
            return results_outcomes(out)

        async def fail_after_list():
            return await fail_after([prompt, wl.prompt(rng)])

        async def move_on_after_stream():
            tally = StreamTally(1)
            with anyio.move_on_after(delay):
                async for chunk in await eng.async_generate(prompt, params, stream=True):
                    tally.add(chunk)
            return tally.outcomes(True)

        async def async_for_break():
            tally = StreamTally(1)
            async for chunk in await eng.async_generate(prompt, params, stream=True):
                tally.add(chunk)
                if tally.chunks >= chunks_wanted:
                    break
            return tally.outcomes(True)

        async def aclose():
            tally = StreamTally(1)
            stream = await eng.async_generate(prompt, params, stream=True)
            async for chunk in stream:
                tally.add(chunk)
                if tally.chunks >= chunks_wanted:
                    break
            await stream.aclose()
            return tally.outcomes(True)

        async def abort_request_async():
            rid = f"soak-{uuid.uuid4().hex}"
            timer = threading.Timer(delay, eng.abort_request, args=(rid,))
            timer.start()
            try:
                return results_outcomes(await eng.async_generate(prompt, params, rid=rid), we_aborted=True)
            finally:
                timer.cancel()

        async def drop_unread_async():
            await eng.async_generate(prompt, params, stream=True)
            return [(ABORTED_BY_US, 0, None)]

        fns = {"fail_after": fail_after, "fail_after_list": fail_after_list,
               "move_on_after_stream": move_on_after_stream, "async_for_break": async_for_break, "aclose": aclose,
               "abort_request_async": abort_request_async, "drop_unread_async": drop_unread_async}
        return f"async:{kind}", fns[kind], 2 if kind == "fail_after_list" else 1, False


# ---------------------------------------------------------------------------------------------- the run
def _bounded(fn, timeout: float):
    """``fn()`` on a daemon thread: (result, None), (None, exception) or (None, TimeoutError)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, TimeoutError(f"no answer within {timeout:.0f} s")
    return box.get("result"), box.get("error")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, required=True, help="how long each configuration is soaked")
    parser.add_argument("--threads", type=int, default=12, help="sync caller threads")
    parser.add_argument("--async-tasks", type=int, default=12, help="anyio caller tasks (one event loop)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the callers' random choices")
    parser.add_argument("--call-timeout", type=positive_float, default=120.0,
                        help="a call still out after this many seconds (finite) is a HANG")
    parser.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--schema-dir", default=str(common.JSONSCHEMA_DIR))
    parser.add_argument("--result-file", default="bench/out/soak.jsonl")
    parser.add_argument("--fault-rate", type=float, default=0.0,
                        help="chance that a compute item fails (injected; default 0: none)")
    parser.add_argument("--context-length", type=int, default=None,
                        help=f"the engine's context length; up to {NEAR_LIMIT_MAX_CONTEXT} the soak also sends "
                             "prompts that end a few tokens short of it (default: the model's)")
    common.add_engine_args(parser)
    for action in parser._actions:  # one soak per algorithm named; "none" is the plain engine
        if action.dest == "speculative_algorithm":
            action.choices, action.nargs, action.default = ["none", "NGRAM", "EAGLE", "DFLASH"], "+", ["none"]
            action.help = "one soak per value, each --minutes long (default: none)"
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error("--minutes must be > 0")
    if args.threads < 0 or args.async_tasks < 0 or args.threads + args.async_tasks == 0:
        parser.error("--threads and --async-tasks must be >= 0, and not both 0")
    if not 0 <= args.fault_rate < 1:
        parser.error("--fault-rate must be in [0, 1)")
    return args


def soak_one(args, algorithm: str, kwargs: dict) -> dict:
    import specjet

    label = algorithm
    if algorithm != "none":
        kwargs = dict(kwargs, speculative_algorithm=algorithm)
    started_load = time.monotonic()
    engine = specjet.Engine(**kwargs)
    desc = describe_engine(engine)
    wl = Workload(engine, args.schema_dir)
    print(f"# [{label}] engine: {desc['dtype']} on {desc['device']}, speculative {speculation_str(desc)}, "
          f"max_running_requests {desc['max_running_requests']}, KV pool {wl.pool} slots, context {wl.context}; "
          f"loaded in {time.monotonic() - started_load:.1f} s", flush=True)
    print(f"# [{label}] soak: {args.minutes:g} min, {args.threads} threads + {args.async_tasks} async tasks, "
          f"seed {args.seed}, call bound {args.call_timeout:g} s; {wl.schema_source}", flush=True)
    _bounded(lambda: engine.generate(wl.prompts[0], {"temperature": 0, "max_new_tokens": 4}), args.call_timeout)
    faults = FaultInjector(engine, args.fault_rate, args.seed) if args.fault_rate > 0 else None

    stats, tracker, stop = Stats(), Tracker(), threading.Event()
    soak = Soak(engine, wl, args, stats, tracker, stop)
    workers = [threading.Thread(target=soak.sync_worker, args=(i,), name=f"soak-thread-{i}", daemon=True)
               for i in range(args.threads)]
    if args.async_tasks:
        workers.append(threading.Thread(target=soak.async_main, name="soak-event-loop", daemon=True))
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    for w in workers:
        w.start()

    def watch() -> None:
        for case, worker, seconds in tracker.overdue(args.call_timeout):
            stats.hang(case, worker, seconds)
            print(f"# [{label}] HANG: {worker}'s {case} call has not returned after {seconds:.0f} s", flush=True)

    next_progress, died = t0 + args.progress_s, False
    rss = [(0.0, rss_mb())]  # the process's resident memory at each progress line: a leak grows it steadily
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        watch()
        if not engine.is_alive():
            died = True
            print(f"# [{label}] the engine died: {engine.get_server_info()['error']}; stopping early", flush=True)
            break
        if time.monotonic() >= next_progress:
            next_progress += args.progress_s
            rss.append((time.monotonic() - t0, rss_mb()))
            print(f"# [{label}] {rss[-1][0]:5.0f} s: " + _progress(stats, tracker)
                  + ("" if rss[-1][1] is None else f", RSS {rss[-1][1]:.0f} MB"), flush=True)
    stop.set()
    # Wait for the calls in flight: each returns, or is counted as a hang at the bound.
    while True:
        watch()
        in_flight, hung = tracker.in_flight()
        if in_flight == hung:
            break
        time.sleep(0.2)
    for w in workers:
        w.join(timeout=0.1)
    wall = time.monotonic() - t0

    # The engine must drain, hold no KV and still live.
    end: dict = {"idle": False, "idle_s": None, "kv_invariant": None, "kv_pool_size": None, "kv_free": None,
                 "leaked_slots": None, "alive": engine.is_alive(), "error": None}
    idle_started = time.monotonic()
    _, error = _bounded(lambda: engine.wait_idle(timeout=args.call_timeout), args.call_timeout + 10)
    if error is None:
        end["idle"], end["idle_s"] = True, time.monotonic() - idle_started
    else:
        end["error"] = f"did not go idle: {type(error).__name__}: {error}"
    _, error = _bounded(engine.check_kv_invariant, 60)
    end["kv_invariant"] = "ok" if error is None else f"{type(error).__name__}: {error}"[:300]
    # Idle, no request holds a cached prefix: flushing the prefix cache must free every slot.
    _bounded(engine.flush_cache, 60)
    info, error = _bounded(engine.get_server_info, 60)
    if info is not None:
        end["kv_pool_size"], end["kv_free"] = info["kv_pool_size"], info["kv_free"]
        end["leaked_slots"] = info["kv_pool_size"] - info["kv_free"]
        end["alive"], end["engine_error"] = info["alive"], info["error"]
        end["engine_stats"] = {k: v for k, v in info["stats"].items() if isinstance(v, (int, float))}
    end["alive"] = end["alive"] and engine.is_alive()
    _bounded(engine.shutdown, 60)

    internal = stats.total(INTERNAL, UNEXPECTED)
    hangs = stats.total(HANG) + (0 if end["idle"] else 1)
    passed = (hangs == 0 and end["leaked_slots"] == 0 and end["kv_invariant"] == "ok" and internal == 0
              and end["alive"] and not died and stats.total(ENGINE_DEAD) == 0)
    record = {
        "config": label, "engine": desc, "minutes": args.minutes, "wall_s": round(wall, 1),
        "threads": args.threads, "async_tasks": args.async_tasks, "seed": args.seed,
        "call_timeout_s": args.call_timeout, "calls": dict(stats.calls), "requests": dict(stats.requests),
        "refused_by_type": dict(stats.refused_by_type), "tokens": stats.tokens,
        "latency_s": {lab: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)}
                      for lab, v in stats.latency.items()},
        "by_case": {case: dict(c) for case, c in sorted(stats.by_case.items())},
        "examples": {lab: ex for lab, ex in stats.examples.items()},
        "hangs": hangs, "internal_errors": internal, "end": end, "engine_died": died, "pass": bool(passed),
        "faults": None if faults is None else faults.summary(),
        "rss_mb": [(round(t, 1), None if m is None else round(m, 1)) for t, m in rss],
        "rss_growth_mb_per_min": rss_growth(rss),
    }
    for line in report_lines(record):
        print(line, flush=True)
    return record


def rss_mb() -> float | None:
    """This process's resident memory in MB (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def rss_growth(samples: list[tuple[float, float | None]]) -> float | None:
    """MB per minute over the soak's second half (the first fills caches: grammars, the prefix cache), by a
    least-squares line through its samples; None with fewer than three there. Reported, not judged: an
    allocator's caches move it a few MB either way."""
    points = [(t, m) for t, m in samples if m is not None]
    if not points:
        return None
    half = points[-1][0] / 2
    late = [(t, m) for t, m in points if t >= half]
    if len(late) < 3:
        return None
    return 60 * statistics.linear_regression([t for t, _ in late], [m for _, m in late]).slope


def _progress(stats: Stats, tracker: Tracker) -> str:
    r = stats.requests
    in_flight, _ = tracker.in_flight()
    injected = f"ended by injected faults {r[INJECTED]}, " if r[INJECTED] else ""
    return (f"calls {sum(stats.calls.values())}, served {r[SERVED]}, refused {r[REFUSED]}, "
            f"aborted by us {r[ABORTED_BY_US]}, grammar aborts {r[GRAMMAR_ABORT]}, other aborts {r[OTHER_ABORT]}, "
            f"{injected}internal errors {r[INTERNAL] + r[UNEXPECTED]}, hangs {r[HANG]}, tokens {stats.tokens}, "
            f"in flight {in_flight}")


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.2f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def report_lines(rec: dict) -> list[str]:
    r = collections.Counter(rec["requests"])
    lat = rec["latency_s"]
    end = rec["end"]
    tag = f"[{rec['config']}]"
    lines = [f"## soak {tag}: {sum(rec['calls'].values())} calls ({rec['calls'].get('sync', 0)} sync, "
             f"{rec['calls'].get('async', 0)} async) in {rec['wall_s']:.0f} s"]
    lines.append(f"requests served: {r[SERVED]}; tokens generated: {rec['tokens']} "
                 f"({rec['tokens'] / max(rec['wall_s'], 1e-9):.1f} tok/s)")
    by_type = ", ".join(f"{k} {v}" for k, v in sorted(rec["refused_by_type"].items())) or "-"
    lines.append(f"refused at the door: {r[REFUSED]} ({by_type})")
    lines.append(f"aborted/cancelled by us: {r[ABORTED_BY_US]}; grammar-compile aborts: {r[GRAMMAR_ABORT]}; "
                 f"other aborts: {r[OTHER_ABORT]}")
    lines.append(f"validation mismatches: invalid accepted {r[INVALID_ACCEPTED]}, valid refused {r[VALID_REFUSED]}")
    faults = rec.get("faults")
    if faults:
        stats = end.get("engine_stats") or {}
        lines.append(f"injected faults: {faults['fired']} of {faults['items']} compute items ({faults['rate']:g}), "
                     f"{faults['fired_in_shared_batches']} in batches of several; requests re-run "
                     f"{stats.get('requests_isolated', '-')}; ended by injected faults {r[INJECTED]}")
    lines.append(f"INTERNAL ERRORS: {rec['internal_errors']} ({r[INTERNAL]} internal_error aborts, "
                 f"{r[UNEXPECTED]} unexpected exceptions); engine died (RuntimeError): {r[ENGINE_DEAD]}")
    lines.append(f"hangs: {rec['hangs']}" + ("" if end["idle"] else " (the engine never went idle)"))
    served, refused = lat.get(SERVED, {}), lat.get(REFUSED, {})
    lines.append(f"latency of served calls: p50 {_ms(served.get('p50'))}, p99 {_ms(served.get('p99'))} "
                 f"(n={served.get('n', 0)}); of door refusals: p50 {_ms(refused.get('p50'))}, "
                 f"p99 {_ms(refused.get('p99'))} (n={refused.get('n', 0)})")
    lines.append(f"end: idle {'yes' if end['idle'] else 'NO'}"
                 + (f" after {end['idle_s']:.1f} s" if end["idle_s"] is not None else "")
                 + f"; KV invariant {end['kv_invariant']}; KV free {end['kv_free']} / pool {end['kv_pool_size']} "
                 f"-> leaked slots {end['leaked_slots']}; engine alive {'yes' if end['alive'] else 'NO'}"
                 + (f" ({end.get('engine_error')})" if end.get("engine_error") else ""))
    for label in (HANG, INTERNAL, UNEXPECTED, ENGINE_DEAD, OTHER_ABORT, GRAMMAR_ABORT, INVALID_ACCEPTED,
                  VALID_REFUSED):
        for case, message in rec["examples"].get(label, []):
            lines.append(f"  {label} [{case}]: {message}")
    growth = rec.get("rss_growth_mb_per_min")
    samples = [m for _, m in rec.get("rss_mb", []) if m is not None]
    if samples:
        lines.append(f"resident memory: {samples[0]:.0f} MB at the start, {samples[-1]:.0f} MB at the end; second half "
                     + ("-" if growth is None else f"{growth:+.1f} MB/min"))
    lines.append(f"RESULT {tag}: {'PASS' if rec['pass'] else 'FAIL'} "
                 f"(hangs {rec['hangs']}, leaked slots {end['leaked_slots']}, internal errors {rec['internal_errors']}, "
                 f"engine alive {'yes' if end['alive'] else 'no'})")
    return lines


def main(argv=None) -> dict:
    args = parse_args(argv)
    kwargs = common.engine_kwargs(args)
    kwargs.pop("speculative_algorithm", None)
    if args.context_length is not None:
        kwargs["context_length"] = args.context_length
    command, date, machine = common.command_line(), common.now(), common.machine_info()
    print("\n".join(common.report_header_lines(command, date, machine)), flush=True)
    records = [soak_one(args, algorithm, kwargs) for algorithm in args.speculative_algorithm]
    passed = all(r["pass"] for r in records)
    if len(records) > 1:
        print("RESULT: " + ("PASS" if passed else "FAIL") + " ("
              + ", ".join(f"{r['config']} {'PASS' if r['pass'] else 'FAIL'}" for r in records) + ")", flush=True)
    result = {"command": command, "date": date, "machine": machine, "configs": records, "pass": passed}
    for record in records:
        common.append_jsonl(args.result_file, {"command": command, "date": date, "machine": machine, **record})
    return result


if __name__ == "__main__":
    sys.exit(0 if common.run_cli(main)["pass"] else 1)
