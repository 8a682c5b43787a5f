"""Compile grammars with xgrammar, off the scheduler's thread, behind one shared cache.

A request's constraint (`json_schema`, `regex`, `ebnf`, or any-JSON) becomes an
`xgr.CompiledGrammar` through `GrammarBackend.compile`, which returns a Future at once: the
scheduler keeps stepping other requests while the compile runs in a thread of its own (xgrammar
releases the GIL while it compiles), and admits the request when the future is done.

Limits keep one bad spec from hurting other requests: a spec too big or too deeply nested, or a
regex or EBNF grammar that does not parse, fails before any compile (`check_spec`), and a compile
that runs past `compile_timeout_s` fails its requests and gives its compile slot to the next
grammar (see `timed_runner`). The engine's door also waits a moment for the compile itself
(`check_compiles`), so that what the compile refuses is the caller's error at once.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, wait
from typing import Any

import xgrammar as xgr

from specjet.grammar.ebnf_text import ebnf_text
from specjet.grammar.forced_text import grammar_lengths, mark_jump_forward_safe, token_budget_rules
from specjet.grammar.forced_tokens import ForcedTokens, text_to_ids
from specjet.grammar.spec import (DEFAULT_MAX_SPEC_BYTES, DEFAULT_MAX_SPEC_DEPTH, GRAMMAR_KINDS, GrammarError,
                                  canonical_text)
from specjet.grammar.timed_runner import Closed, Outcome, Overloaded, TimedOut, TimedRunner

__all__ = ["GRAMMAR_KINDS", "JSON_SCHEMA_OPTIONS", "GrammarBackend", "GrammarBusyError", "GrammarClosedError",
           "GrammarError", "GrammarTimeoutError"]

# How JSON schemas are laid out. With any_whitespace=True (xgrammar's default) whitespace is legal
# between every pair of tokens, and a small model (or a random walk) can spend its whole budget
# on newlines and spaces without ever breaking the grammar. Fixing the layout to one line with
# json.dumps' default separators removes that freedom: the output is compact, and ", " / ": "
# is the JSON layout models have seen most in training, so the forced tokens are likely ones.
# strict_mode=True keeps a model from inventing properties or items the schema does not list
# (the schema's own additionalProperties would otherwise allow them); a schema that strict mode
# cannot express (e.g. minProperties above the number of listed properties) falls back to
# strict_mode=False rather than failing, see `_compile_json_schema`. Because strict mode writes
# only listed properties, `required` names are listed first (`schema_rewrite`).
JSON_SCHEMA_OPTIONS: dict[str, Any] = {
    "any_whitespace": False,
    "indent": None,
    "separators": (", ", ": "),
    "strict_mode": True,
}

# Two compiles at once, so that one slow schema (some take seconds) does not hold up a quick one
# queued behind it; more would only compete with the model for the same cores.
_COMPILE_SLOTS = 2

# The slowest schema of the dev set takes about 2.5 s of CPU to compile (one server core); on a
# small machine where the model and a second compile share the cores, its wall time is 2-4x that.
# 10 s serves it there, and bounds how long a pathological schema holds its requests.
DEFAULT_COMPILE_TIMEOUT_S = 10.0

# How long the engine's door waits for a request's grammar to compile, so that a spec the compile refuses is the
# caller's error at once rather than an abort later. The request could not start before its compile anyway.
DOOR_COMPILE_WAIT_S = 1.0

# Timed-out compiles still burn a core until they end; new compiles start only while fewer run.
DEFAULT_MAX_ABANDONED_COMPILES = 2

# How many timed-out specs are remembered (by digest) to fail again at once.
_TIMED_OUT_MEMORY = 1024

# xgrammar prefixes its messages with a timestamp and a C++ source location, and failed checks
# with "Check failed: (...) is false:". Neither helps the user who wrote the schema.
_XGRAMMAR_MESSAGE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarTimeoutError(GrammarError):
    """The grammar's compile ran past the backend's compile_timeout_s (now, or an earlier time)."""


class GrammarBusyError(GrammarError):
    """No compile was started: too many timed-out compiles still run (max_abandoned_compiles). It may
    pass: the spec itself is not known to be at fault."""


class GrammarClosedError(GrammarError):
    """The backend was shut down before the grammar was compiled."""


class _Compile:
    """One compile, shared by every request of its cache key until it is evicted."""

    __slots__ = ("waiters", "grammar", "done")

    def __init__(self) -> None:
        self.waiters: list[Future] = []  # the futures handed to requests while it runs
        self.grammar: xgr.CompiledGrammar | None = None
        self.done = False


class GrammarBackend:
    """Compiles grammars for one tokenizer and caches the results.

    The cache is keyed by (kind, canonical text), so concurrent requests for the same grammar
    share one compile; each request still gets a Future of its own, which it may cancel without
    touching the others'. A failed compile is evicted when it fails (a later request recompiles);
    successful ones are evicted least-recently-used beyond `cache_limit_bytes`.

    Limits, each failing the request with a GrammarError that names it:
    - `max_spec_bytes`: the spec's text (a JSON schema as compact JSON); `max_spec_depth`: how
      deep a JSON schema's objects and arrays nest. Both checked before compiling (`check_spec`).
    - `compile_timeout_s` (None: no limit): wall time of one compile from its start (not its
      wait for a slot). A compile past it fails its requests with `GrammarTimeoutError` and gives
      up its slot; its thread runs on in C++, which cannot be stopped, and if it completes, its
      grammar is cached. The spec is remembered: until then a request for it fails at once.
    - `max_abandoned_compiles`: new compiles start only while fewer timed-out ones still run;
      beyond that they fail at once (cached grammars are still served).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_threads: int = 1,
        cache_limit_bytes: int = 256 << 20,
        compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
        max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
        max_spec_depth: int = DEFAULT_MAX_SPEC_DEPTH,
        max_abandoned_compiles: int = DEFAULT_MAX_ABANDONED_COMPILES,
        canonical_forced_text: bool = True,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        if compile_timeout_s is not None and not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be positive or None, got {compile_timeout_s!r}")
        if compile_timeout_s == float("inf"):
            compile_timeout_s = None  # no limit (a wait cannot take an infinite timeout)
        for name, value in (("max_spec_bytes", max_spec_bytes), ("max_spec_depth", max_spec_depth),
                            ("max_abandoned_compiles", max_abandoned_compiles)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # vocab_size is the model's: its LM head may be wider than the tokenizer's vocabulary
        # (padding rows), and the token bitmask must cover every logit.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The model's own end-of-turn ids (generation_config.json's: Llama 3's <|eot_id|>) end a grammar too, beside
        # those xgrammar finds in the tokenizer.
        stops = sorted(set(self.tokenizer_info.stop_token_ids) | {t for t in stop_token_ids if 0 <= t < vocab_size})
        if stops != sorted(self.tokenizer_info.stop_token_ids):
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                     stop_token_ids=stops)
        self._token_bytes: list[bytes] | None = None
        # Text -> the tokenizer's ids, cached: the forced-text rule's, jump-forward's and the drafters' one split.
        self.tokenize = text_to_ids(tokenizer)
        # The forced-text rule every request's grammar applies (forced_tokens.py), or None: the model chooses.
        self.forced_tokens = ForcedTokens(self.tokenize, self.token_bytes) if canonical_forced_text else None
        # xgrammar's own cache stays on: it shares compiled sub-rules across different schemas
        # (about 2.5x faster over the dev set). max_threads is xgrammar's parallelism inside one
        # compile.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes
        )
        self._max_threads = max_threads
        self._uncached_compiler: xgr.GrammarCompiler | None = None
        self.compile_timeout_s = compile_timeout_s
        self.door_compile_wait_s = DOOR_COMPILE_WAIT_S  # check_compiles' wait (0: refuse only what check_spec finds)
        self.max_spec_bytes = max_spec_bytes
        self.max_spec_depth = max_spec_depth
        self._runner = TimedRunner(_COMPILE_SLOTS, compile_timeout_s, max_abandoned_compiles, "specjet-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit_bytes = cache_limit_bytes
        self._timed_out: OrderedDict[bytes, None] = OrderedDict()
        self._closed = False
        # Compiles that ran (cache misses; a timed-out one counts when it ends) and their seconds.
        self.compile_stats = {"compiles": 0, "compile_seconds": 0.0}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def token_bytes(self) -> list[bytes]:
        """The bytes each token id spells (xgrammar's decoded vocabulary), made once."""
        if self._token_bytes is None:
            self._token_bytes = [bytes(b) for b in self.tokenizer_info.decoded_vocab]
        return self._token_bytes

    def exact_token_bytes(self) -> list[bytes] | None:
        """``token_bytes`` where the tokenizer is not byte-level BPE (a byte-fallback or raw vocabulary, whose
        pieces a byte alphabet does not read), None where it is (its pieces spell their bytes already)."""
        if self.tokenizer_info.vocab_type == xgr.VocabType.BYTE_LEVEL:
            return None
        return self.token_bytes()

    @property
    def abandoned_compiles(self) -> int:
        """How many compiles that timed out are still running."""
        return self._runner.abandoned

    def check_spec(self, kind: str, spec: str | dict | bool | None = None) -> None:
        """Raise GrammarError for what is wrong with a spec without compiling it: an unknown kind,
        the wrong type, a JSON schema that is not JSON, text over `max_spec_bytes`, a schema nested
        deeper than `max_spec_depth`, a regex or EBNF grammar that xgrammar cannot parse (its message),
        and a spec whose earlier compile timed out. Synchronous and linear in the spec's text (xgrammar
        parses a regex or EBNF grammar in milliseconds; skipped for one already compiled), so a caller
        learns of a bad spec at the door, not from an abort later. A JSON schema's conversion is left to
        the compile: for some patterns it takes seconds, which the compile bounds (compile_timeout_s)
        off the caller's thread; what it refuses ends its request alone."""
        key = (kind, self._canonical(kind, spec))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.done:
                return  # compiled: it parses
            if _digest(key) in self._timed_out:
                raise self._timeout_error(kind, earlier=True)
        if kind in ("regex", "ebnf"):
            self._parse(*key)

    def check_compiles(self, keys: list[tuple[str, Any]]) -> list[Future] | None:
        """Start the compiles of ``keys`` ((kind, spec) pairs that passed `check_spec`) and wait up to
        ``door_compile_wait_s`` for them together: the first spec a finished compile refused (xgrammar's
        converter, a grammar with no finite output) raises its GrammarError here, at the door, where it would
        have ended its request with an abort. Otherwise returns the compiles' futures, one a key, for the
        requests to wait on (None when the wait is 0: nothing started). A compile still running after the wait
        goes on (its request waits for it, as it must anyway, so the wait costs it nothing; requests of the same
        call without a grammar are queued with it, so up to the wait later); timeouts and a busy compiler are not
        the spec's fault and stay with the request."""
        if self.door_compile_wait_s <= 0:
            return None
        futures = [self.compile(kind, spec) for kind, spec in keys]  # one compile a spec: the cache shares it
        done, _ = wait(futures, timeout=self.door_compile_wait_s)
        for future in futures:
            if future in done:
                error = future.exception()
                if isinstance(error, GrammarError) and not isinstance(
                        error, (GrammarTimeoutError, GrammarBusyError, GrammarClosedError)):
                    raise GrammarError(str(error)) from None  # a fresh one: the compile's is shared
        return futures

    def compile(self, kind: str, spec: str | dict | bool | None = None) -> Future:
        """Future[xgr.CompiledGrammar] for a grammar of `kind`; errors arrive as GrammarError.

        `spec` is a JSON schema (str, dict or bool) for "json_schema", a regex for "regex", an
        EBNF grammar for "ebnf", and ignored for "json" (any JSON value). The Future is this
        caller's own: cancelling it (while the compile runs) affects no other request.
        """
        request: Future = Future()
        try:
            key = (kind, self._canonical(kind, spec))
        except GrammarError as error:
            request.set_exception(error)
            return request
        error, grammar, start = None, None, False
        with self._lock:
            entry = self._cache.get(key)
            if self._closed:
                error = GrammarClosedError("the grammar backend is shut down")
            elif entry is not None:
                self._cache.move_to_end(key)
                if entry.done:  # a cached entry is a successful one
                    grammar = entry.grammar
                else:
                    entry.waiters.append(request)  # settled by _on_done
            elif _digest(key) in self._timed_out:
                error = self._timeout_error(kind, earlier=True)
            else:
                entry = self._cache[key] = _Compile()
                entry.waiters.append(request)
                start = True
        if start:
            self._runner.submit(
                lambda: self._compile(*key),
                on_done=lambda outcome: self._on_done(key, entry, outcome),
                on_late=lambda outcome: self._on_late(key, outcome),
            )
        elif error is not None:
            request.set_exception(error)
        elif grammar is not None:
            request.set_result(grammar)
        return request

    def shutdown(self, wait: bool = True) -> None:
        """Fail every compile not yet done and drop the cache. Prompt: it never waits for a
        compile (`wait` is accepted for compatibility); compiles still running finish in their
        own threads, which interpreter exit waits for."""
        with self._lock:
            self._closed = True
            entries = [(key, entry) for key, entry in self._cache.items() if not entry.done]
        self._runner.shutdown()
        for key, entry in entries:
            self._on_done(key, entry, (None, Closed()))
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    # -- spec and compile ------------------------------------------------------------------

    def _canonical(self, kind: str, spec: Any) -> str:
        return canonical_text(kind, spec, max_bytes=self.max_spec_bytes, max_depth=self.max_spec_depth)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            return self._compile_kind(kind, text)
        finally:
            with self._lock:
                self.compile_stats["compiles"] += 1
                self.compile_stats["compile_seconds"] += time.perf_counter() - start

    def _compile_kind(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind == "json":
            compiled = self._compiler.compile_builtin_json_grammar()
            mark_jump_forward_safe(compiled, grammar_lengths(xgr.Grammar.builtin_json_grammar()))
            return compiled
        try:
            if kind == "json_schema":
                grammar, compiled = self._compile_json_schema(text)
            else:
                grammar = self._parse(kind, text)
                compiled = self._compiler.compile_grammar(ebnf_text(grammar))
        except RuntimeError as error:
            raise GrammarError(f"{kind} could not be compiled: {xgrammar_message(error)}") from None
        # Read from the source grammar: the compiled one's serialization holds its automata.
        lengths = grammar_lengths(grammar)
        if lengths is not None and not lengths.has_finite_output:
            raise GrammarError(
                f"{kind} admits no finite output: every text it allows goes on for ever (e.g. an object that "
                f"requires a property of its own type, or a rule that always refers to itself)")
        mark_jump_forward_safe(compiled, lengths)
        return compiled

    @staticmethod
    def _parse(kind: str, text: str) -> xgr.Grammar:
        """A regex or EBNF grammar as xgrammar's grammar (no tokenizer work); GrammarError with
        xgrammar's message if it cannot be parsed."""
        try:
            grammar = xgr.Grammar.from_regex(text) if kind == "regex" else xgr.Grammar.from_ebnf(text)
        except RuntimeError as error:
            raise GrammarError(f"{kind} could not be parsed: {xgrammar_message(error)}") from None
        budgeted = token_budget_rules(grammar)
        if budgeted:
            # xgrammar enforces a token budget through state its mask fill leaves behind (and counts tokens, not
            # text): the forced text and the state after a token depend on whether a mask was filled first, which
            # plain decoding does at every token and a draft tree's walk does not, so speculation would not
            # reproduce plain decoding's tokens.
            raise GrammarError(f"{kind} rule budgets in tokens are not supported ([max_tokens=...] on "
                               f"{', '.join(budgeted)}): bound the rule's text instead (a counted repeat)")
        return grammar

    def _compile_json_schema(self, text: str) -> tuple[xgr.Grammar, xgr.CompiledGrammar]:
        try:
            grammar = xgr.Grammar.from_json_schema(text, **JSON_SCHEMA_OPTIONS)
            # As text: given the grammar, the cached compiler would compile its printed form as xgrammar reads
            # it back, where "ü" before a hex digit becomes another character (ebnf_text.py).
            return grammar, self._compiler.compile_grammar(ebnf_text(grammar))
        except RuntimeError as first_error:
            # Two known ways a valid schema fails in xgrammar 0.2.8, each with a retry:
            # (1) a bug of the compiler's cache ("Check failed: per_rule_fsm_hashes[...]"):
            #     those schemas compile on a compiler without cache;
            # (2) strict mode cannot express the schema (e.g. {"type": "object",
            #     "minProperties": 1} with no listed properties): compile it non-strict.
            # If neither helps, the first error is the one that describes the schema.
            options = dict(JSON_SCHEMA_OPTIONS)
            for strict_mode in (True, False):
                options["strict_mode"] = strict_mode
                try:
                    grammar = xgr.Grammar.from_json_schema(text, **options)
                    return grammar, self._get_uncached_compiler().compile_grammar(ebnf_text(grammar))
                except RuntimeError:
                    pass
            raise first_error

    def _get_uncached_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._uncached_compiler is None:
                self._uncached_compiler = xgr.GrammarCompiler(
                    self.tokenizer_info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._uncached_compiler

    # -- outcomes --------------------------------------------------------------------------

    def _on_done(self, key: tuple[str, str], entry: _Compile, outcome: Outcome) -> None:
        grammar, raised = outcome
        error = None if raised is None else self._as_grammar_error(key[0], raised)
        with self._lock:
            if entry.done:
                return  # already failed by shutdown
            entry.done, entry.grammar = True, grammar
            waiters, entry.waiters = entry.waiters, []
            if isinstance(raised, TimedOut):
                self._remember_timeout(key)
            if self._cache.get(key) is entry:
                if error is not None:
                    del self._cache[key]
                else:
                    self._cache_bytes += grammar.memory_size_bytes
                    self._evict_least_recently_used()
        for request in waiters:
            _settle(request, grammar, error)

    def _on_late(self, key: tuple[str, str], outcome: Outcome) -> None:
        # A timed-out compile that completes after all: cache its grammar, so that the spec is
        # served from now on instead of failing as timed out. One that fails stays remembered.
        grammar, raised = outcome
        if raised is not None:
            return
        with self._lock:
            if self._closed or key in self._cache:
                return
            self._timed_out.pop(_digest(key), None)
            entry = self._cache[key] = _Compile()
            entry.done, entry.grammar = True, grammar
            self._cache_bytes += grammar.memory_size_bytes
            self._evict_least_recently_used()

    def _remember_timeout(self, key: tuple[str, str]) -> None:
        # Called with the lock held. Digests, not texts: specs may be large.
        self._timed_out[_digest(key)] = None
        while len(self._timed_out) > _TIMED_OUT_MEMORY:
            self._timed_out.popitem(last=False)

    def _timeout_error(self, kind: str, earlier: bool = False) -> GrammarTimeoutError:
        when = "an earlier compile of this grammar" if earlier else "its compile"
        return GrammarTimeoutError(
            f"{kind} compile timed out: {when} ran past {self.compile_timeout_s:g} s "
            f"(compile_timeout_s); the grammar is too complex to compile in time"
        )

    def _as_grammar_error(self, kind: str, raised: BaseException) -> GrammarError:
        if isinstance(raised, GrammarError):
            return raised
        if isinstance(raised, TimedOut):
            return self._timeout_error(kind)
        if isinstance(raised, Overloaded):
            return GrammarBusyError(
                f"{kind} not compiled: {raised.args[0]} compiles that timed out are still running "
                f"(max_abandoned_compiles); try again later"
            )
        if isinstance(raised, Closed):
            return GrammarClosedError("the grammar backend is shut down")
        return GrammarError(f"{kind} could not be compiled: {type(raised).__name__}: {raised}")

    def _evict_least_recently_used(self) -> None:
        # Called with the lock held. Running compiles are skipped: their size is not known yet
        # and their waiters need them.
        for key in list(self._cache):
            if self._cache_bytes <= self._cache_limit_bytes or len(self._cache) <= 1:
                return
            entry = self._cache[key]
            if entry.done:
                del self._cache[key]
                self._cache_bytes -= entry.grammar.memory_size_bytes


def _settle(request: Future, grammar: xgr.CompiledGrammar | None, error: GrammarError | None) -> None:
    if request.cancelled():
        return
    try:
        if error is not None:
            # A copy per request: raising one exception object from many threads would grow its
            # traceback with each.
            request.set_exception(type(error)(*error.args))
        else:
            request.set_result(grammar)
    except InvalidStateError:  # cancelled between the check and the set
        pass


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.sha256(f"{key[0]}\0{key[1]}".encode("utf-8")).digest()


def xgrammar_message(error: RuntimeError) -> str:
    """xgrammar's error text without its time stamp and source location."""
    return _XGRAMMAR_MESSAGE_PREFIX.sub("", str(error).strip())
