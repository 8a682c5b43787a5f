"""The reason a request ends with when it is not served to its end: an abort, in SGLang's shape
``{"type": "abort", "message", "status_code", "err_type"}``.

``message`` is for people; ``status_code`` (an HTTP status) and ``err_type`` say whose fault it is and
what the caller can do, so a front end (the OpenAI server) answers from them and never parses the
message: a 400 for the request's own fault (a grammar that cannot be compiled or leads nowhere), a 503
for a condition that may pass (the KV pool, the grammar compiler's slots, an engine shutting down), a
500 for the engine's own failure.
"""

from __future__ import annotations

from specjet.grammar import GrammarBusyError, GrammarClosedError, GrammarError

# err_type values, each with its status_code (ABORT_STATUS).
ABORTED = "request_aborted"                   # the caller aborted it (abort_request, a stream closed unread)
INVALID_GRAMMAR = "invalid_grammar"           # its grammar did not compile (an error, its time limit, no finite output)
GRAMMAR_COMPILER_BUSY = "grammar_compiler_busy"  # too many timed-out compiles still run: try again later
GRAMMAR_REFUSED = "request_refused"           # decoding under its grammar cannot go on (no legal token, too slow)
KV_POOL_EXHAUSTED = "kv_pool_exhausted"       # it outgrew the KV pool while running alone
ENGINE_NOT_ALIVE = "engine_not_alive"         # the engine is shutting down, or its scheduler thread stopped
INTERNAL_ERROR = "internal_error"             # a failure of the engine's own (host or compute side)

ABORT_STATUS = {
    ABORTED: 400,
    INVALID_GRAMMAR: 400,
    GRAMMAR_REFUSED: 400,
    GRAMMAR_COMPILER_BUSY: 503,
    KV_POOL_EXHAUSTED: 503,
    ENGINE_NOT_ALIVE: 503,
    INTERNAL_ERROR: 500,
}


def abort_reason(err_type: str, message: str) -> dict:
    """The finish reason of a request ended by ``err_type`` (one of the names above)."""
    return {"type": "abort", "message": message, "status_code": ABORT_STATUS[err_type], "err_type": err_type}


def grammar_err_type(error: GrammarError) -> str:
    """The err_type of a request whose grammar's compile failed with ``error``."""
    if isinstance(error, GrammarBusyError):
        return GRAMMAR_COMPILER_BUSY
    if isinstance(error, GrammarClosedError):
        return ENGINE_NOT_ALIVE
    return INVALID_GRAMMAR
