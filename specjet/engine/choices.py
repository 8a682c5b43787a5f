"""Several samples of one prompt (SGLang's ``n`` in the sampling parameters, OpenAI's ``n``): each choice one
engine request of its own, the prompt's prefill shared through the prefix cache."""
from __future__ import annotations

from typing import Any

# The most choices a request may ask for (each is a request of its own, held until all are done).
MAX_CHOICES = 128


def parallel_samples(params: list) -> int:
    """The ``n`` of a call's sampling parameters (one dict a prompt): the same in every dict that gives it, an int in
    [1, MAX_CHOICES]; 1 where none does. What is not a dict is left for the parameters' own check."""
    values = [d["n"] for d in params if isinstance(d, dict) and d.get("n") is not None]
    if not values:
        return 1
    n = values[0]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if len(values) != len(params) or any(v != n or type(v) is not int for v in values):
        raise ValueError("n must be the same in every sampling_params")
    return n


def choice_params(sp: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The engine's sampling parameters of each of ``n`` choices (``n`` itself left out). With a seed, choice i
    samples with seed + i (mod 2**64): the choices differ from each other, and the same request gives the same
    ones. A seed that is no seed the engine takes (not an int in [0, 2**64)) is left as it is, for the engine to
    refuse."""
    sp = {k: v for k, v in sp.items() if k != "n"}
    seed = sp.get("seed")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64):
        return [dict(sp) for _ in range(n)]
    return [dict(sp, seed=(seed + i) % 2**64) for i in range(n)]
