"""Specs the grammar compiler accepts but enforces as something else are refused at the door with a message naming
what is not supported (a pattern's literal quote or backslash, an integer const beyond 2**53, a NUL in an EBNF
literal, a regex anchor inside the pattern); the specs beside them that it enforces exactly stay served, and their
outputs obey them. The tiny random model, which writes what a grammar allows rather than what is likely."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specjet.grammar.compiler_holes import regex_hole, schema_hole
from specjet.grammar.spec import GrammarError

REFUSED = [
    ({"json_schema": {"type": "object", "properties": {"p": {"type": "string", "pattern": '^"[a-z]"$'}},
                      "required": ["p"]}}, "literal quote or backslash"),
    ({"json_schema": {"type": "object", "properties": {"p": {"type": "string", "pattern": "^\\\\[a-z]$"}},
                      "required": ["p"]}}, "literal quote or backslash"),
    ({"json_schema": {"const": 12345678901234567890}}, "beyond 2**53"),
    ({"json_schema": {"type": "object", "properties": {"n": {"enum": [1, -(2 ** 60)]}}}}, "beyond 2**53"),
    ({"ebnf": 'root ::= "x\\x00"'}, "NUL"),
    ({"regex": "a$b"}, "anchor '$' of 'a$b'"),
    ({"regex": "ab^c"}, "anchor '^' of 'ab^c'"),
    ({"regex": "(a$)b"}, "anchor '$' of '(a$)b'"),  # inside a group that consuming text follows
    ({"regex": "(^a)+"}, "anchor '^' of '(^a)+'"),  # a repeat's second pass follows its first
    ({"json_schema": {"type": "string", "pattern": "^(a$)b"}}, "pattern the anchor '$' of '^(a$)b'"),
]


@pytest.mark.parametrize("constraint, words", REFUSED)
def test_what_the_compiler_would_enforce_otherwise_is_refused_at_the_door(plain, constraint, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        plain.generate(["a", "b"], [dict(constraint, max_new_tokens=8), {"max_new_tokens": 2}])
    assert plain.generate("b", {"max_new_tokens": 2, "ignore_eos": True})["meta_info"]["completion_tokens"] == 2
    plain.check_kv_invariant()


SERVED = [
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": '^[^"]{1,4}$'}}, "required": ["p"]}, None),
    ({"type": "object", "properties": {"n": {"enum": [1, 2 ** 53, "x"]}}, "required": ["n"]}, None),
    (None, "^(ab|cd)$|^x+$"),
    (None, "[$^]{2}(a|b$)"),
]


@pytest.mark.parametrize("schema, regex", SERVED)
def test_their_neighbours_stay_served_and_obeyed(plain, schema, regex):
    params = {"temperature": 1.0, "max_new_tokens": 32, "seed": 3}
    if schema is not None:
        out = plain.generate("x", dict(params, json_schema=schema))
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), schema)
    else:
        out = plain.generate("x", dict(params, regex=regex))
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        assert re.fullmatch(regex, out["text"]), out["text"]
    plain.check_kv_invariant()


def test_the_scanners_by_hand():
    assert [regex_hole(r) is None for r in ("^a$", "^a$|^b$", "(^a|b)$", "[^a]+", "[$^]x", "a\\$b", "^(?:^a)$",
                                            "^[a-z]+($|,)", "^(ab|^c)$", "(a$)?", "((a)|(^b))c")] == [True] * 11
    assert [regex_hole(r) is None for r in ("a$b", "x^y", "a^|b", "(a$)b", "(^a)+", "a(^b)", "(a$)*", "a$b?",
                                            "(a|b$)c")] == [False] * 9
    # Syntax Python's parser does not read (a JavaScript named group) is scanned as text instead.
    assert regex_hole("(?<n>a)$") is None and "at index 7" in regex_hole("(?<n>a)$b")
    holes = [schema_hole({"pattern": p}) is None for p in ("^[a-z]$", "^\\d+$", "^\\.$", '^[^"]*$', '^[^\\\\"]+$',
                                                           '^"$', "^\\\\$", '^["a]$', "^[a\\\\]$")]
    assert holes == [True] * 5 + [False] * 4
    assert schema_hole({"properties": {"pattern": {"type": "string"}}, "default": 2 ** 70}) is None
