"""A batch the scheduler chose: its kind and its requests (the worker builds the tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from specjet.scheduler.request import Req


class BatchKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ScheduledBatch:
    kind: BatchKind
    reqs: list[Req]
    # A prefill: where each request's computed positions end (set at launch; a chunk ends before
    # the request's fill_ids do).
    prefill_ends: list[int] = field(default_factory=list)
    # A decode batch that runs as a speculative iteration (draft, verify, accept) rather than a plain step.
    speculative: bool = False
    # Of a speculative batch, whether each request (in ``reqs`` order) may draft in it: its verify counts. Fixed
    # here because a request's ``drafts`` may turn off while the batch is in flight (free text that drafts alone).
    drafting: tuple[bool, ...] = ()
    # Each request's ``retract_count`` at launch: a request requeued since (a batch before this one failed) has
    # dropped the state this batch computed from, and its results here are not used.
    launched_at: list[int] = field(default_factory=list)
