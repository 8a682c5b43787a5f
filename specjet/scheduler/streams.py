"""Where forwards run: one ordered queue of work, on a worker thread (CPU) or a CUDA stream.

The overlap loop submits iteration N's work and goes on with iteration N-1's host work (grammar,
stop checks, streaming) while N runs. Work items run in submission order, so N+1's forward can read
what N wrote (the worker's compute state) without the host looking at it in between. ``submit`` returns a
``concurrent.futures.Future``: ``.result()`` is the host's sync point, and it re-raises the work's
exception on the caller's thread.

- ``CpuStream``: torch ops on the CPU are synchronous, so the work runs on one worker thread; torch
  releases the GIL inside its kernels, so the host's Python and xgrammar run beside them (specjet's C++
  CPU kernels keep it: on a CPU whose cores they all use, the host's work measured cheaper between
  forwards than beside them; csrc/module.cpp).
- ``CudaStream``: the host thread itself launches the work on a compute stream (launches are
  asynchronous); the returned future is already resolved and its tensors become valid once the
  stream reaches them, so results meant for the host are copied with ``non_blocking`` and an event.
  The host's own device writes (the scheduler's slot table: a new request's cached prefix, a decode
  step's next slot) go to the host thread's stream, which the compute stream does not otherwise
  wait for: each item first makes the compute stream wait for everything the host launched before
  it, or its forward could read a table entry before the host's write lands.

Both stamp each item (submitted, started, ended) so the loop can report how long the compute side
waited for the host; an item submitted with ``timed=False`` (housekeeping between batches, such as
dropping ended requests' state) leaves no timing, so the loop's count of items per batch stays right.
Nothing above this module branches on the device type.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specjet.kernels.openmp_teams import IdleTeam

# An idle compute thread looks this often whether to give its OpenMP team back (kernels/openmp_teams.py
# IdleTeam: when another engine computes, whose workers an idle team puts to sleep, or after a long idle).
IDLE_POLL_S = 0.05


@dataclass
class WorkTiming:
    submitted: float
    started: float = 0.0
    ended: float = 0.0


class Stream:
    """An ordered queue of work for the compute side."""

    def submit(self, fn: Callable[..., Any], *args: Any, timed: bool = True) -> Future:
        """Run ``fn(*args)`` after everything submitted before; ``timed``: record its timing."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until everything submitted so far has run."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def take_timings(self) -> list[WorkTiming]:
        """Timings of the items that ended since the last call, in order."""
        with self._timings_lock:
            out, self._timings = self._timings, []
        return out

    def _init_timings(self) -> None:
        self._timings: list[WorkTiming] = []
        self._timings_lock = threading.Lock()

    def _record(self, timing: WorkTiming | None) -> None:
        if timing is None:  # an untimed item
            return
        with self._timings_lock:
            self._timings.append(timing)


class InlineStream(Stream):
    """The plain loop's 'stream': work runs at once on the calling thread (timed the same way)."""

    def __init__(self):
        self._init_timings()

    def submit(self, fn: Callable[..., Any], *args: Any, timed: bool = True) -> Future:
        timing = WorkTiming(time.perf_counter())
        timing.started = timing.submitted
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        timing.ended = time.perf_counter()
        self._record(timing if timed else None)
        return future

    def synchronize(self) -> None:
        pass


class CpuStream(Stream):
    """One worker thread that runs submitted work in order."""

    def __init__(self, name: str = "specjet-compute"):
        self._init_timings()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, timed: bool = True) -> Future:
        future: Future = Future()
        self._queue.put((fn, args, future, WorkTiming(time.perf_counter()) if timed else None))
        return future

    def synchronize(self) -> None:
        self.submit(lambda: None, timed=False).result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        team = IdleTeam()
        while True:
            try:
                item = self._queue.get() if team.released else self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                team.idle()
                continue
            if item is None:
                team.close()
                return
            team.busy()
            fn, args, future, timing = item
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                self._stamp(timing, started)
                future.set_exception(exc)
            else:
                self._stamp(timing, started)
                future.set_result(result)

    def _stamp(self, timing: WorkTiming | None, started: float) -> None:
        """Record a timed item's run (before its future resolves: whoever waits on it sees its timing)."""
        if timing is not None:
            timing.started, timing.ended = started, time.perf_counter()
            self._record(timing)


class CudaStream(Stream):
    """Work is launched from the calling thread onto a dedicated compute stream."""

    def __init__(self, device: torch.device):
        self._init_timings()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, fn: Callable[..., Any], *args: Any, timed: bool = True) -> Future:
        timing = WorkTiming(time.perf_counter())
        future: Future = Future()
        timing.started = time.perf_counter()
        try:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                result = fn(*args)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        timing.ended = time.perf_counter()  # launch time; the GPU may still be busy
        self._record(timing if timed else None)
        return future

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_stream(device: torch.device, overlap: bool = True) -> Stream:
    """The overlap loop's stream for ``device``; without overlap, work runs inline."""
    if not overlap:
        return InlineStream()
    return CudaStream(device) if device.type == "cuda" else CpuStream()
