"""Check a completed `json_schema` output against its schema with `jsonschema`.

xgrammar does not enforce every JSON Schema keyword (some it ignores with a warning, e.g.
`minLength` beside `pattern`, or `oneOf` read as `anyOf`), so an output that the grammar accepted
to its end may still break the schema. This check is the independent oracle that says so.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from typing import Any

import jsonschema

# Validators are built once per schema text: building one parses the schema and its $refs.
_VALIDATOR_CACHE_SIZE = 128

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
    asserted (jsonschema's default, and what bench.json measures). Validation runs the schema's
    `pattern`s with Python's `re` on the scheduler thread; the output is bounded by
    max_new_tokens, which bounds the work.
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
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
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
        return cls(schema)
    except jsonschema.exceptions.SchemaError as error:
        return _clip(f"the schema is not valid {cls.__name__.removesuffix('Validator')}: "
                     f"{error.message} at {error.json_path}")
    except Exception as error:  # noqa: BLE001
        return _clip(f"jsonschema cannot read the schema: {type(error).__name__}: {error}")


def _clip(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[: _MAX_MESSAGE_CHARS - 3] + "..."
