"""A batch the scheduler chose: its kind and its requests (the worker builds the tensors)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from specjet.scheduler.request import Req


class BatchKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ScheduledBatch:
    kind: BatchKind
    reqs: list[Req]
