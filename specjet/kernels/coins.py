"""A sampled request's coins: the uniform number that draws the token at each sequence position.

A sampled token is the inverse-CDF draw of its filtered distribution at a coin in [0, 1). The coin of the
token at position p of a request's sequence (prompt positions included) is a hash of the request's key and
p, not the next number of a stream: plain decoding draws position p's token with it, and a speculative verify
draws the token after a tree node of depth d with the coin of the position that token would take
(kernels/tree_verify.py). So a request samples the same tokens whether it drafts or not, whatever its drafts
are, whatever batch it shares, and when it is run again after a retraction or a failed batch: a seeded
request's output depends on its inputs and seed alone.

The hash is SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
2014) over the key plus the position times the golden-ratio increment; a coin keeps the top 24 bits, so it is
exactly a float32 and exactly the same number on every path that reads it.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def coin_key(seed: int) -> int:
    """A request's key from its seed (an int in [0, 2**64)): seeds a step apart (the choices of one call, seed
    + i) get unrelated keys, not sequences shifted against each other."""
    return _mix((seed + _GAMMA) & _MASK)


def coin(key: int, position: int) -> float:
    """The coin of the token at sequence ``position``: a multiple of 2**-24 in [0, 1)."""
    return (_mix((key + (position + 1) * _GAMMA) & _MASK) >> 40) * 2.0 ** -24


def coins(key: int, start: int, count: int) -> list[float]:
    """The coins of positions start, start + 1, ..., start + count - 1."""
    return [coin(key, p) for p in range(start, start + count)]
