"""GSM8K answers as numbers: the gold one after ``####`` in a reference solution, and a model's
prediction, the last number in its output (as SGLang's benchmark/gsm8k scores it, made exact for
what its ``\\d+`` gets wrong: thousands commas, negatives, decimals).

Numbers are ``Decimal``s, so ``5.0 == 5`` and ``1,234 == 1234`` compare equal without float error.
"""
from __future__ import annotations

import re
from decimal import Decimal

# A number: an optional minus (not one that joins two numbers, as in "16-3"), an optional "$", then
# digits with thousands commas ("1,234,567") or without, and an optional decimal part. A trailing
# sentence period is not a decimal part ("is 18." -> 18); a comma not followed by a group of three
# digits ends the number ("3,4" -> 3 and 4).
_NUMBER = re.compile(
    r"(?:(?<![\w.)])(?P<minus>[-\u2212]))?\$?"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?!\d)"
)


def numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order."""
    return [Decimal(("-" if m["minus"] else "") + m["digits"].replace(",", "")) for m in _NUMBER.finditer(text)]


def last_number(text: str) -> Decimal | None:
    """The prediction in a model's output: its last number, or None when it has none (invalid)."""
    found = numbers(text)
    return found[-1] if found else None


def gold_answer(solution: str) -> Decimal:
    """The reference answer of a GSM8K solution: the number after its last ``####``."""
    head, sep, tail = solution.rpartition("####")
    value = last_number(tail) if sep else None
    if value is None:
        raise ValueError(f"no '#### <number>' at the end of the solution: {solution[-80:]!r}")
    return value


def number_str(value: Decimal | None) -> str | None:
    """``value`` without exponent or trailing zeros ("5.0" -> "5", "1.50" -> "1.5"), for records."""
    if value is None:
        return None
    text = format(value.normalize(), "f")
    return "0" if text == "-0" else text
