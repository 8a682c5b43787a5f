"""argparse types for the command lines' flags (the draft trainers', `specjet serve`'s): a value out of range is
refused when the command is read, with the flag's name, not by a division or a reshape after a trainer's data and
feature stages, or by the server after its engine has loaded."""
from __future__ import annotations

import argparse
import math
import pathlib


def int_in(least: int, most: int | None = None):
    """An integer in [least, most] (no upper bound where ``most`` is None)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least or (most is not None and value > most):
            bounds = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text}")
        return value
    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
MIN_SEQUENCE_TOKENS = 32  # --max-len: a prompt and a reply of some length (fewer left nothing to train on)
sequence_len = int_in(MIN_SEQUENCE_TOKENS)
block_size = int_in(2)  # a DFlash block: the root and at least one draft
port = int_in(0, 65535)  # 0: any free port


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


def existing_path(text: str) -> str:
    """A file or folder that is there (a model: a .gguf file or a model folder), as given."""
    if not pathlib.Path(text).expanduser().exists():  # as the engine reads it
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return text


def existing_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path
