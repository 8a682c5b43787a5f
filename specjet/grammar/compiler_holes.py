"""Specs xgrammar accepts but enforces as something else: each check returns the message a refusal at the door
gives (``spec.canonical_text`` raises it as a GrammarError), where the engine would otherwise write output the
spec does not allow.

- A JSON schema ``pattern`` with a literal quote or backslash: the converter writes the character raw into the
  JSON string, so the output is not JSON (``"p": ""a""``) or holds an invalid escape.
- An integer beyond 2**53 in a ``const`` or ``enum``: the converter reads schema numbers as doubles and forces
  the float's spelling (1.2345678901234567e+19), which the schema's integer never equals.
- A NUL in an EBNF string literal: the parser ends the literal there (``"x\\x00"`` is compiled as ``"x"``).
- A regex anchor (``^``, ``$``) that consuming text can precede or follow (inside the pattern, in a group, in a
  repeat): the regex dialect drops it, so ``a$b`` and ``(a$)b`` match "ab", which the pattern cannot.
"""
from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11+
    from re import _constants as _sre, _parser as _sre_parser
except ImportError:  # Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parser

# Integers a double holds exactly.
_EXACT_INT = 2 ** 53
# An EBNF escape that spells NUL (xgrammar's escapes: \x.., \u...., \U........), or NUL itself.
_EBNF_NUL = re.compile(r"\\x00|\\u0000|\\U00000000|\x00")


def schema_hole(schema: Any) -> str | None:
    """The first part of a parsed JSON schema the converter would enforce as something else, or None. Iterative
    (the caller bounded the depth already)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        pattern = node.get("pattern")
        if isinstance(pattern, str) and _literal_quote_or_backslash(pattern):
            return (f"json_schema: pattern {pattern!r} matches a literal quote or backslash, which the grammar "
                    f"compiler (xgrammar) writes into the JSON string unescaped: not supported")
        anchor = regex_hole(pattern) if isinstance(pattern, str) else None
        if anchor is not None:  # a pattern goes through the same regex dialect
            return f"json_schema: pattern {anchor.removeprefix('regex: ')}"
        for key in ("const", "enum"):
            if key in node:
                big = _inexact_int(node[key])
                if big is not None:
                    return (f"json_schema: {key} holds the integer {big}, beyond 2**53, which the grammar compiler "
                            f"(xgrammar) can only write as a float: not supported")
        stack.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return None


def ebnf_hole(text: str) -> str | None:
    if _EBNF_NUL.search(text):
        return "ebnf: a NUL character in a string literal ends the literal in the grammar compiler (xgrammar): not " \
               "supported"
    return None


def regex_hole(text: str) -> str | None:
    """The message for an anchor the regex dialect would drop, or None: an anchor is kept only where nothing the
    pattern consumes can come before a ``^`` or after a ``$``. Decided on Python's parse of the pattern (which
    follows groups, alternatives and repeats: ``(a$)b`` and ``(^a)+`` are refused, ``^(ab|^c)$`` served); a
    pattern Python's parser does not read (the dialect's own syntax, such as ``(?<name>...)``) falls back to a
    scan of the text."""
    try:
        tree = _sre_parser.parse(text)
    except Exception:  # re.error, RecursionError on deep nesting: the scan decides
        return _regex_hole_by_scan(text)
    anchor = _misplaced_anchor(list(tree), at_start=True, at_end=True)
    if anchor is None:
        return None
    return (f"regex: the anchor {anchor!r} of {text!r} is inside the pattern, where the regex dialect (xgrammar) "
            f"drops it; anchors are supported at the pattern's ends only")


_STARTS = {_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING}
_ENDS = {_sre.AT_END, _sre.AT_END_STRING}


def _misplaced_anchor(items: list, at_start: bool, at_end: bool) -> str | None:
    """The first start or end anchor in the parsed sequence ``items`` that consuming items precede or follow
    (``at_start`` / ``at_end``: whether the sequence itself begins / ends the whole pattern), as "^" or "$"."""
    zero_width = [op is _sre.AT for op, _ in items]
    for j, (op, av) in enumerate(items):
        first = at_start and all(zero_width[:j])
        last = at_end and all(zero_width[j + 1:])
        if op is _sre.AT:
            if av in _STARTS and not first:
                return "^"
            if av in _ENDS and not last:
                return "$"
            continue
        for sub, start, end in _children(op, av, first, last):
            found = _misplaced_anchor(list(sub), start, end)
            if found is not None:
                return found
    return None


def _children(op, av, first: bool, last: bool) -> list:
    """The sub-sequences of one parsed item, each with whether it begins / ends the whole pattern: an
    alternative or a group where its item does; a repeat's body where the item does and it runs at most once
    (twice or more, a second pass follows the first)."""
    if op is _sre.BRANCH:
        return [(alt, first, last) for alt in av[1]]
    if op is _sre.SUBPATTERN:
        return [(av[-1], first, last)]
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)):
        once = av[1] <= 1
        return [(av[2], first and once, last and once)]
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return [(av, first, last)]
    if op is _sre.GROUPREF_EXISTS:
        return [(branch, first, last) for branch in av[1:] if branch is not None]
    return []  # literals, classes, lookarounds: no anchor the dialect reads


def _regex_hole_by_scan(text: str) -> str | None:
    """An anchor that is not at the pattern's ends or an alternative's (after ``(``, ``(?:`` or ``|``; before ``)``
    or ``|``), outside character classes and escapes, or None."""
    in_class, i = False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if text[i + 1:i + 2] == "^":  # a negated class, not an anchor
                i += 1
            if text[i + 1:i + 2] == "]":  # a literal ] first in the class
                i += 1
        elif (c == "^" and i > 0 and not (text[i - 1] in "(|" or text[:i].endswith("(?:"))) or (
                c == "$" and i + 1 < len(text) and text[i + 1] not in ")|"):
            return (f"regex: the anchor {c!r} at index {i} of {text!r} is inside the pattern, where the regex dialect "
                    f"(xgrammar) drops it; anchors are supported at the pattern's ends only")
        i += 1
    return None


def _literal_quote_or_backslash(pattern: str) -> bool:
    """Whether the regex can match a quote or a backslash as itself: a ``"`` or an escaped backslash (``\\``)
    outside a negated character class (``[^"]`` excludes the quote, which is fine)."""
    negated, in_class, i = False, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1:i + 2] == "\\" and not negated:
                return True
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = negated = False
            elif c == '"' and not negated:
                return True
        elif c == "[":
            in_class, negated = True, pattern[i + 1:i + 2] == "^"
            i += 1 + negated
            continue
        elif c == '"':
            return True
        i += 1
    return False


def _inexact_int(value: Any) -> int | None:
    """The first integer (not a bool) in ``value`` (a const's value or an enum's list, nested) a double does not
    hold exactly, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int) and abs(item) > _EXACT_INT:
            return item
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None
