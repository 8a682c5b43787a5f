"""A grammar spec as the text xgrammar compiles, checked before any compile starts.

`canonical_text` is everything that can be known about a spec without compiling it: its kind and
type, whether a JSON schema parses, its size and nesting depth, and the features the compiler would
enforce as something else (compiler_holes.py). It raises `GrammarError` for each,
so the engine can refuse a bad spec at the door (`GrammarBackend.check_spec`), and the text it
returns keys the compile cache.
"""

from __future__ import annotations

import json
from typing import Any

from specjet.grammar.compiler_holes import ebnf_hole, regex_hole, schema_hole
from specjet.grammar.schema_rewrite import reachable_required

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "json")

# The size limit bounds what one request can make the host parse, rewrite, hash and keep as a
# cache key; the compile timeout bounds the compile itself. 128 KiB is 8x the largest schema of
# the dev set (15 KB as compact JSON), room for a many-tool schema; schema text like the dev set's
# compiles at 50-100 KB/s on one core, so a spec at the limit still compiles within the default
# timeout, while specs much larger would mostly time out after holding a compile slot.
DEFAULT_MAX_SPEC_BYTES = 128 << 10

# Nesting of the schema's JSON (every object and array counts). Python's json raises RecursionError
# near 1000 levels and the schema rewrite recurses once per level; xgrammar's compile time grows
# steeply with inline nesting (hundreds of levels take minutes). The dev set nests at most 15
# levels; 128 leaves real schemas (64 levels of nested objects) plenty of room.
DEFAULT_MAX_SPEC_DEPTH = 128


class GrammarError(ValueError):
    """A grammar spec that cannot be used; the message names the problem."""


def canonical_text(kind: str, spec: Any, *, max_bytes: int, max_depth: int) -> str:
    """The text that is compiled and that keys the cache; GrammarError if it cannot be used.

    `spec` is a JSON schema (str, dict or bool) for "json_schema", a regex for "regex", an EBNF
    grammar for "ebnf", and ignored for "json" (any JSON value). A JSON schema is laid out as
    compact JSON in its own key order (xgrammar writes properties in schema order, so order is
    part of the grammar), after `reachable_required`.
    """
    if kind == "json_schema":
        text = _schema_text(spec, max_depth)
    elif kind in ("regex", "ebnf"):
        if not isinstance(spec, str):
            raise GrammarError(f"{kind} must be a string, got {type(spec).__name__}")
        text = spec
        hole = regex_hole(text) if kind == "regex" else ebnf_hole(text)
        if hole is not None:
            raise GrammarError(hole)
    elif kind == "json":
        return ""
    else:
        raise GrammarError(f"unsupported grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as error:  # a lone surrogate: no compiler can take it
        raise GrammarError(f"{kind} is not valid Unicode: {error.reason} at index {error.start}") from None
    if size > max_bytes:
        raise GrammarError(f"{kind} is {size} bytes; the limit is {max_bytes} bytes (max_spec_bytes)")
    return text


def _schema_text(spec: Any, max_depth: int) -> str:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as error:
            raise GrammarError(
                f"invalid json_schema: {error.msg}: line {error.lineno} column {error.colno}"
            ) from None
        except RecursionError:
            raise _too_deep(max_depth) from None
    if not isinstance(spec, (dict, bool)):
        raise GrammarError(f"invalid json_schema: expected an object or a boolean, got {type(spec).__name__}")
    if _deeper_than(spec, max_depth):
        raise _too_deep(max_depth)
    hole = schema_hole(spec)
    if hole is not None:
        raise GrammarError(hole)
    try:
        return json.dumps(reachable_required(spec), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:  # a value JSON cannot hold (a set, NaN, ...)
        raise GrammarError(f"invalid json_schema: {error}") from None


def check_schema_depth(spec: Any, max_depth: int = DEFAULT_MAX_SPEC_DEPTH) -> None:
    """GrammarError if a parsed JSON schema nests deeper than ``max_depth``: for a caller that must walk
    the schema recursively (a meta-schema check) before the engine would refuse it."""
    if _deeper_than(spec, max_depth):
        raise _too_deep(max_depth)


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether objects and arrays nest more than `max_depth` levels; iterative, so any depth (and a
    structure that contains itself) is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _too_deep(max_depth: int) -> GrammarError:
    return GrammarError(
        f"json_schema nests objects and arrays more than {max_depth} levels deep (max_spec_depth)"
    )
