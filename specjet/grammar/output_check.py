"""Check a completed `json_schema` output against its schema with `jsonschema`.

xgrammar does not enforce every JSON Schema keyword (some it ignores with a warning, e.g.
`minLength` beside `pattern`, or `oneOf` read as `anyOf`), so an output that the grammar accepted
to its end may still break the schema. This check is the independent oracle that says so.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

# Validators are built once per schema text: building one parses the schema and its $refs.
_VALIDATOR_CACHE_SIZE = 128

# CPU seconds the schema's pattern matches may take on one output, all together: a real schema's take a few
# microseconds a string (thousands of matches in a long output: milliseconds), and a backtracking one stalls the
# scheduler's thread at most this long.
PATTERN_BUDGET_S = 0.25

# jsonschema's messages quote the offending value, which may be the whole output.
_MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class OutputCheck:
    """`valid` is True (the output validates), False (it is not JSON, or breaks the schema), or
    None (it could not be checked: jsonschema cannot use the schema). `message` says why when
    `valid` is not True."""

    valid: bool | None
    message: str | None = None


def check_json_output(schema: str | dict | bool, text: str) -> OutputCheck:
    """Whether `text` is JSON that validates against `schema` (the request's `json_schema`, str
    or dict). Never raises.

    For the scheduler, when a `json_schema` request finishes with "stop" (a "length" finish is
    cut short, so not expected to validate): call it with the request's `json_schema` and its
    output text, and report `valid` and `message` in `meta_info`. A False should not pass as a
    valid output: its message reads like "output does not match the schema at $.age: 'x' is not
    of type 'integer'" or "output is not JSON: Expecting value: line 1 column 1".

    The schema's own `$schema` picks the draft (2020-12 when it names none); `format` is not
    asserted (jsonschema's default, and what bench.json measures). The schema's patterns run on the
    `regex` module, their matches within ``PATTERN_BUDGET_S`` together (an output past it is not checked):
    the check runs on the scheduler thread, and a backtracking pattern that xgrammar does not enforce
    (under `not`, say) took Python's `re` hours on a 40-character output, every request waiting.
    """
    try:
        key = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        validator = _validator(key)
        if isinstance(validator, str):
            return OutputCheck(None, f"output not checked: {validator}")
        try:
            instance = json.loads(text)
        except json.JSONDecodeError as error:
            return OutputCheck(False, f"output is not JSON: {error.msg}: line {error.lineno} column {error.colno}")
        _clock.left = PATTERN_BUDGET_S
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except _PatternBudgetSpent as spent:
        return OutputCheck(None, _clip(f"output not checked: the schema's patterns took more than "
                                       f"{PATTERN_BUDGET_S * 1e3:.0f} ms on it (the last: {spent.args[0]!r})"))
    except Exception as error:  # noqa: BLE001 (a RecursionError, an unresolvable $ref, a bad pattern, ...)
        return OutputCheck(None, _clip(f"output not checked: jsonschema failed: {type(error).__name__}: {error}"))
    if error is None:
        return OutputCheck(True)
    return OutputCheck(False, _clip(f"output does not match the schema at {error.json_path}: {error.message}"))


@functools.lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _validator(schema_text: str) -> Any:
    """A validator for the schema, or a str saying why jsonschema cannot use it (cached too)."""
    try:
        schema = json.loads(schema_text)
        with warnings.catch_warnings():  # an unknown $schema URI warns and falls back to the default
            warnings.simplefilter("ignore")
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        # The root's draft, chosen above, without its "$schema": jsonschema gives a subschema that names a draft
        # (the root, reached again through "$ref": "#") that draft's stock class, whose patterns run on `re`.
        if isinstance(schema, dict):
            schema = {k: v for k, v in schema.items() if k != "$schema"}
        keys = _keys(schema)
        if "$schema" in keys:
            return "a \"$schema\" below the root (its subschemas' patterns would run without a time bound)"
        if "patternProperties" in keys and "unevaluatedProperties" in keys:  # jsonschema matches these with `re`
            return "patternProperties beside unevaluatedProperties (their patterns' time could not be bounded)"
        bounded = {k: f for k, f in _BOUNDED_KEYWORDS.items() if k in cls.VALIDATORS}
        return jsonschema.validators.extend(cls, bounded)(schema)
    except jsonschema.exceptions.SchemaError as error:
        return _clip(f"the schema is not valid {cls.__name__.removesuffix('Validator')}: "
                     f"{error.message} at {error.json_path}")
    except Exception as error:  # noqa: BLE001
        return _clip(f"jsonschema cannot read the schema: {type(error).__name__}: {error}")


def _clip(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[: _MAX_MESSAGE_CHARS - 3] + "..."


class _PatternBudgetSpent(Exception):
    """The check's patterns ran past PATTERN_BUDGET_S (args: the pattern running then)."""


_clock = threading.local()  # .left: seconds the running check's patterns may still take


def _search(pattern: str, text: str) -> bool:
    """``re.search`` as jsonschema does it, on the `regex` module (Python's `re` syntax, and it can stop):
    within what is left of the check's pattern budget (the matches' CPU time alone: jsonschema's own work on a
    long output is not counted), the GIL released while it matches."""
    if _clock.left <= 0:
        raise _PatternBudgetSpent(pattern)
    started = time.thread_time()  # this thread's CPU time: a busy machine does not spend the budget
    try:
        return _compiled(pattern).search(text, concurrent=True, timeout=_clock.left) is not None
    except TimeoutError:
        raise _PatternBudgetSpent(pattern) from None
    finally:
        _clock.left -= time.thread_time() - started


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str):
    return regex.compile(pattern)


# The keywords whose jsonschema implementations call `re.search`, as jsonschema writes them, on ``_search``.
def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [key for key in instance if key not in known and not any(_search(p, key) for p in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        names = ", ".join(repr(each) for each in sorted(extras))
        if patterns:
            yield ValidationError(f"{names} {'does' if len(extras) == 1 else 'do'} not match any of the regexes: "
                                  + ", ".join(repr(each) for each in sorted(patterns)))
        else:
            yield ValidationError(f"Additional properties are not allowed ({names} "
                                  f"{'was' if len(extras) == 1 else 'were'} unexpected)")


_BOUNDED_KEYWORDS = {"pattern": _pattern, "patternProperties": _pattern_properties,
                     "additionalProperties": _additional_properties}


def _keys(schema: Any) -> set[str]:
    """Every object key anywhere in the schema (iterative: no recursion limit)."""
    keys, todo = set(), [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            keys.update(k for k in node if isinstance(k, str))
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return keys
