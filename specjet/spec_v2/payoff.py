"""Whether drafting pays for a request without a grammar: measured while it decodes, not assumed.

A verify row costs more as the context grows (its attention reads every cached key) and drafts are
accepted less on text unlike the draft's training data, so over a long conversation speculation can be
slower than plain decoding. For a request decoding alone, the speculator drafts while what it measured
says drafting pays at the request's context length: per context bucket, running means of the tokens a
drafting verify commits (``accept``), of a drafting iteration's seconds (``tree``) and of a root-only
one's (``root``: a plain step through the verify). Drafting is ``accept * root / tree`` times as fast
as plain steps. Where even the accept mean one standard error higher leaves that below ``MARGIN``, a
request verifies its root alone for ``PAUSE`` iterations, then drafts ``EXPLORE`` times so the means keep
up with the text. A bucket's first ``root`` is measured by a
``PROBE`` of root-only iterations once it holds ``EXPLORE`` drafting samples.

The means pool every request of a bucket: one request's handful of verifies (1 to 10 tokens each) is
too noisy to judge, and pausing a request that would have paid costs as much as drafting one that does
not. Trees only shrink to their root, so the output never depends on any of this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Drafting iterations a request runs before it may pause, and after each pause (the means' fresh samples).
EXPLORE = 4
# Root-only iterations that measure a bucket's plain step, and those of a pause.
PROBE = 4
PAUSE = 32
# Pause only where drafting measures this much slower than plain steps or worse: a bucket whose drafts
# pay about what they cost keeps drafting (its means' noise would otherwise pause it half the time).
MARGIN = 0.95
# The running means: the plain mean of the first 1 / LEAST_WEIGHT samples, then this weight for a new one.
LEAST_WEIGHT = 0.05
# Context lengths below this share the first bucket; above it a bucket spans a factor of 2.
FIRST_BUCKET = 512


def bucket(context_len: int) -> int:
    """The context length bucket of ``context_len`` tokens: 0 below FIRST_BUCKET, then one per doubling."""
    b = 0
    while context_len >= FIRST_BUCKET << b:
        b += 1
    return b


@dataclass
class _Mean:
    value: float = 0.0
    square: float = 0.0  # the same running mean of the samples' squares
    count: int = 0

    def add(self, sample: float) -> None:
        self.count += 1
        weight = max(1.0 / self.count, LEAST_WEIGHT)
        self.value += weight * (sample - self.value)
        self.square += weight * (sample * sample - self.square)

    def stderr(self) -> float:
        """The mean's standard error, over the samples it effectively averages (at most ~2 / LEAST_WEIGHT)."""
        n = min(self.count, 2.0 / LEAST_WEIGHT - 1.0)
        return math.sqrt(max(self.square - self.value * self.value, 0.0) / n) if n > 1 else math.inf


@dataclass
class _Bucket:
    accept: _Mean = field(default_factory=_Mean)
    tree: _Mean = field(default_factory=_Mean)
    root: _Mean = field(default_factory=_Mean)

    def speedup(self, optimistic: bool = False) -> float | None:
        """Drafting's measured rate against plain steps (``optimistic``: with the accept mean one standard
        error higher); None until both kinds of iteration were timed."""
        if not self.tree.count or not self.root.count or self.tree.value <= 0:
            return None
        accept = self.accept.value + (self.accept.stderr() if optimistic else 0.0)
        return accept * self.root.value / self.tree.value


@dataclass
class _Request:
    explored: int = 0  # drafting iterations since it last paused (or started)
    root_only_left: int = 0  # iterations it still verifies its root alone
    judged_slower: bool = False  # its current pause is a verdict (drafting measured slower), not a probe


class DraftPayoff:
    """Per-request decisions (``wants_draft``) from the iterations the speculator reports (``record``)."""

    def __init__(self):
        self._requests: dict[str, _Request] = {}
        self._buckets: dict[int, _Bucket] = {}

    def wants_draft(self, rid: str, context_len: int) -> bool:
        """Whether the request should draft this iteration (it decodes alone, without a grammar)."""
        r = self._requests.setdefault(rid, _Request())
        if r.root_only_left > 0:
            return False
        stats = self._buckets.setdefault(bucket(context_len), _Bucket())
        if r.explored < EXPLORE or stats.tree.count < EXPLORE:
            return True
        if not stats.root.count:
            r.root_only_left, r.judged_slower = PROBE, False
            return False
        speedup = stats.speedup(optimistic=True)
        if speedup is not None and speedup < MARGIN:
            r.root_only_left, r.explored, r.judged_slower = PAUSE, 0, True
            return False
        return True

    def judged_slower(self, rid: str) -> bool:
        """Whether the request's drafting is paused because it measured slower than plain steps (not to probe)."""
        r = self._requests.get(rid)
        return r is not None and r.root_only_left > 0 and r.judged_slower

    def record(self, rid: str, context_len: int, drafted: bool, accepted: int, seconds: float) -> None:
        """One iteration of the request alone: whether it drafted, the tokens it committed, its seconds."""
        r = self._requests.setdefault(rid, _Request())
        stats = self._buckets.setdefault(bucket(context_len), _Bucket())
        if drafted:
            r.explored += 1
            stats.accept.add(float(accepted))
            stats.tree.add(seconds)
        else:
            r.root_only_left = max(0, r.root_only_left - 1)
            stats.root.add(seconds)

    def drop(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def summary(self) -> dict:
        """Per bucket: the running means (ms, tokens) and drafting's measured speed-up over plain steps."""
        return {b: {"accept": s.accept.value, "tree_ms": 1000 * s.tree.value, "root_ms": 1000 * s.root.value,
                    "speedup": s.speedup()}
                for b, s in sorted(self._buckets.items()) if s.tree.count or s.root.count}
