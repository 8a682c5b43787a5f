"""argparse types for the draft trainers' flags: a value out of range is refused when the command is read,
with the flag's name, not by a division or a reshape after the data and feature stages (or never)."""
from __future__ import annotations

import argparse
import math
import pathlib


def _at_least(least: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text}")
        return value
    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


positive_int = _at_least(1)
non_negative_int = _at_least(0)
MIN_SEQUENCE_TOKENS = 32  # --max-len: a prompt and a reply of some length (fewer left nothing to train on)
sequence_len = _at_least(MIN_SEQUENCE_TOKENS)
block_size = _at_least(2)  # a DFlash block: the root and at least one draft


def positive_float(text: str) -> float:
    """A finite float > 0 (a learning rate, a decay length)."""
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (refused here rather than by the optimizer after the data and feature stages)."""
    value = float(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A float in [0, 1] (NaN refused)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def existing_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path
