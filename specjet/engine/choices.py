"""Several samples of one prompt (SGLang's ``n`` in the sampling parameters, OpenAI's ``n``): each choice one
engine request of its own, the prompt's prefill shared through the prefix cache."""
from __future__ import annotations

from typing import Any

# The most choices a request may ask for (each is a request of its own, held until all are done).
MAX_CHOICES = 128


def parallel_samples(params: list) -> int:
    """The ``n`` of a call's sampling parameters (one dict a prompt): an int in [1, MAX_CHOICES], the same in every
    dict (1 where a dict gives none). What is not a dict is left for the parameters' own check."""
    values = [d["n"] if isinstance(d, dict) and d.get("n") is not None else 1 for d in params] or [1]
    for n in values:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if len(set(values)) > 1:  # SGLang's rule: one n for the whole call (a dict without one says 1)
        raise ValueError("n must be the same in every sampling_params")
    return values[0]


def choice_rids(rid: Any, prompts: int, n: int) -> Any:
    """The request ids of ``prompts`` x ``n`` choices, prompt-major, from the caller's: a string r names them r_0,
    r_1, ...; one id a prompt r names its choices r_0 .. r_{n-1}; None (fresh ids) and anything not a string (for
    the caller's own check) as given. A list of another length than the prompts' is a ValueError."""
    if rid is None or n == 1:
        return rid
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(prompts * n)]
    if isinstance(rid, (list, tuple)) and len(rid) != prompts:
        raise ValueError(f"{len(rid)} rids for {prompts} prompts")
    if isinstance(rid, (list, tuple)) and all(isinstance(r, str) for r in rid):
        return [f"{r}_{j}" for r in rid for j in range(n)]
    return rid


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
