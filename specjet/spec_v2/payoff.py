"""Whether drafting pays for a request without a grammar: measured while it decodes, not assumed.

A verify row costs more as the context grows (its attention reads every cached key) and drafts are
accepted less on text unlike the draft's training data, so over a long conversation speculation can be
slower than plain decoding. For a request decoding alone, the speculator keeps drafting while what it
measured says it pays: the request's accepted tokens per verify (``accept``, a running mean over its
drafting iterations) against the ratio of a drafting iteration's time to a root-only one's (a plain step
through the verify), both running means kept per context length bucket (the costs move with it). A
request whose ``accept * t_root < t_tree`` verifies its root alone for ``PAUSE`` iterations, then drafts
again to measure anew. Until a bucket has a root-only time, a request that has drafted ``MIN_SAMPLES``
times spends ``PROBE`` iterations root-only to measure it. Trees only shrink to their root, so the output
never depends on any of this.
"""
from __future__ import annotations

from dataclasses import dataclass

# Drafting iterations of a request before it is judged (its running mean settles).
MIN_SAMPLES = 4
# Root-only iterations that measure a bucket's plain step, and those of a pause once drafting lost.
PROBE = 4
PAUSE = 32
# Weight of a new sample in the running means.
WEIGHT = 0.25
# Context lengths below this share the first bucket; above it a bucket spans a factor of 2.
FIRST_BUCKET = 512


def bucket(context_len: int) -> int:
    """The context length bucket of ``context_len`` tokens: 0 below FIRST_BUCKET, then one per doubling."""
    b = 0
    while context_len >= FIRST_BUCKET << b:
        b += 1
    return b


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


@dataclass
class _Request:
    accept: float | None = None  # running mean of tokens accepted per drafting verify
    samples: int = 0  # drafting iterations since it was last judged
    root_only_left: int = 0  # iterations it still verifies its root alone


class DraftPayoff:
    """Per-request decisions (``wants_draft``) from the iterations the speculator reports (``record``)."""

    def __init__(self):
        self._requests: dict[str, _Request] = {}
        self._tree_s: dict[int, float] = {}  # bucket -> running mean of a drafting iteration's seconds
        self._root_s: dict[int, float] = {}  # bucket -> running mean of a root-only iteration's seconds

    def wants_draft(self, rid: str, context_len: int) -> bool:
        """Whether the request should draft this iteration (it decodes alone, without a grammar)."""
        r = self._requests.setdefault(rid, _Request())
        if r.root_only_left > 0:
            return False
        if r.samples < MIN_SAMPLES or r.accept is None:
            return True
        b = bucket(context_len)
        r.samples = 0  # judged now; judged again after MIN_SAMPLES more drafting iterations
        if b not in self._root_s:
            r.root_only_left = PROBE
            return False
        if b in self._tree_s and r.accept * self._root_s[b] < self._tree_s[b]:
            r.root_only_left = PAUSE
            return False
        return True

    def record(self, rid: str, context_len: int, drafted: bool, accepted: int, seconds: float) -> None:
        """One iteration of the request alone: whether it drafted, the tokens it committed, its seconds."""
        r = self._requests.setdefault(rid, _Request())
        b = bucket(context_len)
        if drafted:
            r.accept = _mean(r.accept, float(accepted))
            r.samples += 1
            self._tree_s[b] = _mean(self._tree_s.get(b), seconds)
        else:
            r.root_only_left = max(0, r.root_only_left - 1)
            self._root_s[b] = _mean(self._root_s.get(b), seconds)

    def drop(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def summary(self) -> dict:
        """The running means by bucket (ms), for get_server_info."""
        return {"tree_ms": {b: 1000 * s for b, s in sorted(self._tree_s.items())},
                "root_ms": {b: 1000 * s for b, s in sorted(self._root_s.items())}}
