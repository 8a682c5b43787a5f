"""Compute-side faults injected at random into a running Engine, for the soak's ``--fault-rate``: each compute item
(a batch's forward, or a speculative iteration) fails with the given chance, half of them before the item runs and
half after it has written its KV and compute state. The engine must end only the requests a fault keeps following
(README, "Errors, aborts and health"), with a message naming it; everything else must go on as without faults."""
from __future__ import annotations

import random
import threading

MARKER = "injected fault"


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    """Wraps ``engine.worker``'s compute items. Items run one at a time on the compute stream, but the counts are
    read from other threads, hence the lock."""

    ITEMS = ("forward", "speculate")

    def __init__(self, engine, rate: float, seed: int = 0):
        if not 0 <= rate < 1:
            raise ValueError(f"the fault rate must be in [0, 1), got {rate}")
        self.rate, self._rng, self._lock = rate, random.Random(seed), threading.Lock()
        self.items = self.fired = self.fired_shared = 0
        worker = engine.worker
        for name in self.ITEMS:
            setattr(worker, name, self._wrap(getattr(worker, name)))

    def _wrap(self, run):
        def item(batch, *args, **kwargs):
            with self._lock:
                self.items += 1
                draw = self._rng.random()
            if draw < self.rate / 2:
                self._count(batch)
                raise InjectedFault(f"{MARKER} before a batch of {len(batch.inputs)}")
            out = run(batch, *args, **kwargs)
            if draw < self.rate:
                self._count(batch)
                raise InjectedFault(f"{MARKER} after a batch of {len(batch.inputs)}")
            return out
        return item

    def _count(self, batch) -> None:
        with self._lock:
            self.fired += 1
            self.fired_shared += len(batch.inputs) > 1

    def summary(self) -> dict:
        with self._lock:
            return {"rate": self.rate, "items": self.items, "fired": self.fired, "fired_in_shared_batches": self.fired_shared}
