"""A grammar's EBNF text that xgrammar reads back as the same grammar.

xgrammar 0.2.9 prints a character below U+0100 that it escapes (a control character, or one of
U+0080-U+00FF such as "ü" or "ß") as ``\\xNN``, but its EBNF parser reads every hex digit after
``\\x``: "über" prints as ``"\\xfcber"`` and reads back as U+FCBE followed by "r". The text is
what a caching ``GrammarCompiler.compile_grammar(grammar)`` compiles (it keys its cache on the
printed grammar and parses the key), and what the server's tool grammars splice together, so a
schema whose strings, names or enums hold such a letter before a hex digit ("España", "Größe")
would be enforced as a different character. ``\\u00NN`` has a fixed length and reads back right.
"""
from __future__ import annotations

import re

import xgrammar as xgr

# Every backslash escape in order, so that an escaped backslash before "x" ("\\\\x41") is consumed
# whole and never taken for a \x escape.
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|.)", re.DOTALL)


def fixed_width_escapes(text: str) -> str:
    """``text`` (xgrammar's EBNF) with each ``\\xNN`` escape written as ``\\u00NN``."""
    return _ESCAPE.sub(lambda m: "\\u00" + m.group(1) if m.group(1) else m.group(0), text)


def ebnf_text(grammar: xgr.Grammar) -> str:
    """The grammar as EBNF that ``xgr.Grammar.from_ebnf`` and ``compile_grammar`` read as the same grammar."""
    return fixed_width_escapes(str(grammar))
