"""Run calls that cannot be interrupted (xgrammar compiles, in C++) with a wall-clock limit.

A call runs in a thread of its own, at most `slots` at once; the rest wait in order. A call that
is still running after `timeout_s` is reported as timed out and *abandoned*: its thread runs on
(nothing can stop it), but its slot is handed to the next call, so quick calls never queue behind a
stalled one. Abandoned calls still use CPU, so new calls start only while fewer than `max_abandoned`
of them run; at that cap, calls fail at once (`Overloaded`) instead of starting, until one ends.

Call threads are not daemon threads: one that returns from C++ into Python while the interpreter
is finalizing aborts the whole process ("terminate called without an active exception"), so
interpreter exit waits for calls still running, as it does for a ThreadPoolExecutor's.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Callable

# (result, error): error is None when the call returned `result`.
Outcome = tuple[Any, BaseException | None]


class TimedOut(Exception):
    """The call ran past the timeout; it was abandoned."""


class Overloaded(Exception):
    """Too many abandoned calls are still running to start another."""


class Closed(Exception):
    """The runner was shut down before the call finished."""


class _Call:
    __slots__ = ("fn", "on_done", "on_late", "wake", "outcome", "abandoned")

    def __init__(self, fn, on_done, on_late):
        self.fn, self.on_done, self.on_late = fn, on_done, on_late
        self.wake = threading.Event()  # set when the call returns, or at shutdown
        self.outcome: Outcome | None = None
        self.abandoned = False


class TimedRunner:
    def __init__(self, slots: int, timeout_s: float | None, max_abandoned: int, name: str = "timed-call"):
        if slots < 1 or max_abandoned < 1:
            raise ValueError("slots and max_abandoned must be at least 1")
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._slots = slots
        self._name = name
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: deque[_Call] = deque()
        self._running: set[_Call] = set()  # calls holding a slot
        self._abandoned = 0
        self._closed = False

    @property
    def abandoned(self) -> int:
        """How many timed-out calls are still running."""
        with self._lock:
            return self._abandoned

    def submit(self, fn: Callable[[], Any], on_done: Callable[[Outcome], None],
               on_late: Callable[[Outcome], None] | None = None) -> None:
        """Run `fn()`; `on_done` gets its outcome once, in some thread: (result, None), (None, the
        exception it raised), or (None, TimedOut() / Overloaded() / Closed()). If the call was
        abandoned, `on_late` gets what it finally returned. Neither may raise."""
        call = _Call(fn, on_done, on_late)
        with self._lock:
            if self._closed:
                to_start, rejected = [], [(call, Closed())]
            else:
                self._pending.append(call)
                to_start, rejected = self._take_startable()
        self._start(to_start, rejected)

    def shutdown(self) -> None:
        """Fail waiting calls and stop waiting for running ones (their threads run on); prompt."""
        with self._lock:
            self._closed = True
            pending, running = list(self._pending), list(self._running)
            self._pending.clear()
        for call in pending:
            call.on_done((None, Closed()))
        for call in running:
            call.wake.set()

    # -- internals -------------------------------------------------------------------------

    def _take_startable(self) -> tuple[list[_Call], list[tuple[_Call, BaseException]]]:
        # With the lock held: the pending calls that get a free slot now, and those that fail at
        # once because the abandoned calls are at their cap (or all of them, at the cap).
        started, rejected = [], []
        while self._pending and (len(self._running) < self._slots or self._abandoned >= self.max_abandoned):
            call = self._pending.popleft()
            if self._abandoned >= self.max_abandoned:
                rejected.append((call, Overloaded(self._abandoned)))
            else:
                self._running.add(call)
                started.append(call)
        return started, rejected

    def _start(self, calls: list[_Call], rejected: list[tuple[_Call, BaseException]]) -> None:
        # Called without the lock: on_done may take locks of its own.
        calls, rejected = list(calls), list(rejected)
        while calls or rejected:
            for call, error in rejected:
                call.on_done((None, error))
            rejected = []
            while calls:
                call = calls.pop(0)
                # The supervisor only waits, in Python: a daemon thread is safe for it.
                supervisor = threading.Thread(target=self._supervise, args=(call,), name=f"{self._name}-wait",
                                              daemon=True)
                try:
                    supervisor.start()
                except RuntimeError as error:  # no thread to be had: fail this call, free its slot
                    rejected.append((call, error))
                    with self._lock:
                        self._running.discard(call)
                        more, refused = ([], []) if self._closed else self._take_startable()
                    calls += more
                    rejected += refused

    def _supervise(self, call: _Call) -> None:
        # daemon=False said outright: a thread started from a daemon thread (the supervisor) is a
        # daemon by default, and a daemon returning from C++ during interpreter exit aborts it.
        worker = threading.Thread(target=self._work, args=(call,), name=f"{self._name}-{next(self._ids)}",
                                  daemon=False)
        try:
            worker.start()
        except RuntimeError as error:  # no thread to be had
            call.outcome = (None, error)
            call.wake.set()
        call.wake.wait(self.timeout_s)
        with self._lock:
            outcome = call.outcome
            if outcome is None:
                call.abandoned = True
                self._abandoned += 1
                outcome = (None, Closed() if self._closed else TimedOut())
            self._running.discard(call)
            to_start, rejected = ([], []) if self._closed else self._take_startable()
        call.on_done(outcome)
        self._start(to_start, rejected)

    def _work(self, call: _Call) -> None:
        try:
            outcome: Outcome = (call.fn(), None)
        except BaseException as error:  # handed to on_done; this thread has nobody else to tell
            outcome = (None, error)
        with self._lock:
            call.outcome = outcome
            late = call.abandoned
        call.wake.set()
        if late:
            # on_late first: whoever sees the count drop also sees what the late call delivered.
            if call.on_late is not None:
                call.on_late(outcome)
            with self._lock:
                self._abandoned -= 1
