"""Compile grammars with xgrammar, off the scheduler's thread, behind one shared cache.

A request's constraint (`json_schema`, `regex`, `ebnf`, or any-JSON) becomes an
`xgr.CompiledGrammar` through `GrammarBackend.compile`, which returns a Future at once: the
scheduler keeps stepping other requests while the compile runs in a worker thread (xgrammar
releases the GIL while it compiles), and admits the request when the future is done.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "json")

# How JSON schemas are laid out. With any_whitespace=True (xgrammar's default) whitespace is legal
# between every pair of tokens, and a small model (or a random walk) can spend its whole budget
# on newlines and spaces without ever breaking the grammar. Fixing the layout to one line with
# json.dumps' default separators removes that freedom: the output is compact, and ", " / ": "
# is the JSON layout models have seen most in training, so the forced tokens are likely ones.
# strict_mode=True keeps a model from inventing properties or items the schema does not list
# (the schema's own additionalProperties would otherwise allow them); a schema that strict mode
# cannot express (e.g. minProperties above the number of listed properties) falls back to
# strict_mode=False rather than failing, see `_compile_json_schema`.
JSON_SCHEMA_OPTIONS: dict[str, Any] = {
    "any_whitespace": False,
    "indent": None,
    "separators": (", ", ": "),
    "strict_mode": True,
}

# Two workers, so that one slow schema (some take seconds) does not hold up a quick one queued
# behind it; more would only compete with the model for the same cores.
_COMPILE_WORKERS = 2

# xgrammar prefixes its messages with a timestamp and a C++ source location, and failed checks
# with "Check failed: (...) is false:". Neither helps the user who wrote the schema.
_XGRAMMAR_MESSAGE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A grammar spec that cannot be used; the message names the problem."""


class GrammarBackend:
    """Compiles grammars for one tokenizer and caches the results.

    The cache is keyed by (kind, canonical text) and holds futures, so concurrent requests for
    the same grammar share one compile. A failed compile is evicted when it fails (a later
    request recompiles); successful ones are evicted least-recently-used beyond
    `cache_limit_bytes`.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_threads: int = 1,
        cache_limit_bytes: int = 256 << 20,
    ) -> None:
        # vocab_size is the model's: its LM head may be wider than the tokenizer's vocabulary
        # (padding rows), and the token bitmask must cover every logit.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache stays on: it shares compiled sub-rules across different schemas
        # (about 2.5x faster over the dev set). max_threads is xgrammar's parallelism inside one
        # compile.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes
        )
        self._max_threads = max_threads
        self._uncached_compiler: xgr.GrammarCompiler | None = None
        self._executor = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="specjet-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit_bytes = cache_limit_bytes

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def compile(self, kind: str, spec: str | dict | None = None) -> Future:
        """Future[xgr.CompiledGrammar] for a grammar of `kind`; errors arrive as GrammarError.

        `spec` is a JSON schema (str or dict) for "json_schema", a regex for "regex", an EBNF
        grammar for "ebnf", and ignored for "json" (any JSON value).
        """
        try:
            key = (kind, _canonical_text(kind, spec))
        except GrammarError as error:
            failed: Future = Future()
            failed.set_exception(error)
            return failed
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, *key)
            self._cache[key] = future
        future.add_done_callback(lambda done: self._on_compiled(key, done))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Cancel queued compiles, wait for running ones if `wait`, and drop the cache."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    # -- worker side ------------------------------------------------------------------------

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self._compile_json_schema(text)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compiler.compile_builtin_json_grammar()
        except RuntimeError as error:
            raise GrammarError(f"{kind} could not be compiled: {_xgrammar_message(error)}") from None

    def _compile_json_schema(self, text: str) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_json_schema(text, **JSON_SCHEMA_OPTIONS)
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
                    return self._get_uncached_compiler().compile_json_schema(text, **options)
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

    def _on_compiled(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            if self._cache.get(key) is not future:
                return  # already evicted or the cache was cleared
            if future.cancelled() or future.exception() is not None:
                del self._cache[key]
                return
            self._cache_bytes += future.result().memory_size_bytes
            self._evict_least_recently_used()

    def _evict_least_recently_used(self) -> None:
        # Called with the lock held. Pending futures are skipped: their size is not known yet
        # and their waiters need them.
        for key in list(self._cache):
            if self._cache_bytes <= self._cache_limit_bytes or len(self._cache) <= 1:
                return
            future = self._cache[key]
            if future.done():
                del self._cache[key]
                self._cache_bytes -= future.result().memory_size_bytes


def _canonical_text(kind: str, spec: str | dict | None) -> str:
    """The text that is compiled and that keys the cache."""
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as error:
                raise GrammarError(
                    f"invalid json_schema: {error.msg}: line {error.lineno} column {error.colno}"
                ) from None
        if not isinstance(spec, (dict, bool)):
            raise GrammarError(
                f"invalid json_schema: expected an object or a boolean, got {type(spec).__name__}"
            )
        # Key order is kept, not sorted: xgrammar generates properties in the schema's order,
        # so two schemas that differ only in the order of "properties" are different grammars.
        try:
            return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise GrammarError(f"invalid json_schema: {error}") from None
    if kind in ("regex", "ebnf"):
        if not isinstance(spec, str):
            raise GrammarError(f"{kind} must be a string, got {type(spec).__name__}")
        return spec
    if kind == "json":
        return ""
    raise GrammarError(f"unsupported grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")


def _xgrammar_message(error: RuntimeError) -> str:
    return _XGRAMMAR_MESSAGE_PREFIX.sub("", str(error).strip())
