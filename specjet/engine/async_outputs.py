"""The scheduler's outputs for async callers: handed to each caller's event loop from a thread of
its own, which also tells every async caller still waiting when the scheduler thread is gone.

One watcher for all callers, not a timeout in each: a waiting caller that woke every second to
check the scheduler thread cost its event loop a timer, a cancel scope and an event per wake-up.
With thousands of requests waiting (a data-generation run, a busy server) the loop's thread then
held the GIL for a large share of the time, and the compute thread, whose kernels keep the GIL
(csrc/module.cpp), waited for it between its calls.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

import anyio

# What a waiting caller receives when the scheduler thread has ended without answering it.
STOPPED = object()


def _send_quietly(send, item) -> None:
    try:
        send.send_nowait(item)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # the caller stopped reading
        pass


def _hand_over(token, send, item) -> None:
    """Schedules the send on the caller's loop and never waits for it: a loop that ends between
    the scheduling and the run (a caller cancelled before its first chunk, whose abort's output is
    still on the way) would otherwise hold this thread, and every later async caller, for ever.
    An item for a loop that has ended is dropped."""
    native = token.native_token  # the asyncio loop, or trio's token
    try:
        if isinstance(native, asyncio.AbstractEventLoop):
            native.call_soon_threadsafe(_send_quietly, send, item)
        else:
            native.run_sync_soon(_send_quietly, send, item)
    except Exception:  # the loop is closed or its run finished: nobody is reading
        pass


class AsyncOutputs:
    """``sink(token, send, i)`` is a request's output callback; ``waiting(send, token)`` .. ``done(send)``
    brackets a caller's wait, so that it receives ``STOPPED`` if the scheduler thread ends first."""

    def __init__(self, scheduler_alive: Callable[[], bool], poll_s: float):
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters: dict = {}  # send stream -> its loop's token
        self._lock = threading.Lock()
        # The thread gets these parts, not the engine: a thread holding the last reference to the
        # engine would free its tensors off the main thread, which aborts at interpreter exit.
        self._thread = threading.Thread(target=_dispatch, name="specjet-async-out", daemon=True,
                                        args=(self._outbox, scheduler_alive, poll_s, self._waiters, self._lock))
        self._thread.start()

    def sink(self, token, send, index: int) -> Callable[[dict], None]:
        return lambda item: self._outbox.put((token, send, (index, item)))

    def waiting(self, send, token) -> None:
        with self._lock:
            self._waiters[send] = token

    def done(self, send) -> None:
        with self._lock:
            self._waiters.pop(send, None)

    def close(self, timeout: float) -> None:
        self._outbox.put((None, None, None))
        self._thread.join(timeout=timeout)


def _dispatch(outbox: queue.SimpleQueue, scheduler_alive: Callable[[], bool], poll_s: float, waiters: dict,
              lock: threading.Lock) -> None:
    while True:
        try:
            token, send, item = outbox.get(timeout=poll_s)
        except queue.Empty:
            # Nothing is on the way. If the scheduler thread has ended too, whoever still waits
            # will never be answered: tell them (after every item the thread did send, which
            # this queue delivered first, in order).
            if not scheduler_alive():
                with lock:
                    orphans = list(waiters.items())
                    waiters.clear()
                for send, token in orphans:
                    _hand_over(token, send, STOPPED)
            continue
        if token is None:
            return
        _hand_over(token, send, item)
