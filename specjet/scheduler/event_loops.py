"""The scheduler's two event loops and the bookkeeping of launched batches.

Plain loop (``disable_overlap_schedule=True``): schedule N, run N, process N, one after the other.

Overlap loop (the default), one iteration (DESIGN.md, "The loop, one iteration"):

1. schedule batch N from the host's state, which lags by the one batch still in flight (N-1):
   KV is reserved for N-1's possible growth too, and requests N-1 finishes still ride along in N
   (their N results are dropped, their KV is released once N is processed);
2. launch N's forward on the compute stream; it reads N-1's tokens and lengths from the future map;
3. process N-1's results on the host (grammar ``accept_token``, stop checks, detokenize, stream,
   commit ``kv_committed_len``, finish) while N's forward runs;
4. build N's grammar masks from the now-current grammar state and submit N's sampling.

Speculative batches run draft + verify + accept as one work item. One that holds a constrained
request reads the grammar while drafting and verifying, so it is launched after N-1 is processed
(the compute side then waits for the host's step 3; ``stats["overlap"]`` shows how long).
Retraction needs the exact state, so it first processes the batch in flight.
"""
from __future__ import annotations

import logging
import statistics
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from specjet.scheduler.batch import BatchKind, ScheduledBatch
from specjet.scheduler.streams import Stream, WorkTiming, make_stream

logger = logging.getLogger(__name__)

_MAX_ITERATION_RECORDS = 4096


class InlineStream(Stream):
    """The plain loop's 'stream': work runs at once on the calling thread (timed the same way)."""

    def __init__(self):
        self._init_timings()

    def submit(self, fn, *args) -> Future:
        timing = WorkTiming(time.perf_counter())
        timing.started = timing.submitted
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        timing.ended = time.perf_counter()
        self._record(timing)
        return future

    def synchronize(self) -> None:
        pass


@dataclass
class Launched:
    batch: ScheduledBatch
    views: list
    forward: Future | None = None  # plain batches: the forward, then the sampling
    result: Future | None = None  # list[list[int]]: new tokens per request
    num_items: int = 0  # work items submitted for it (to attribute the stream's timings)
    # Launched while the batch before it failed on the compute side: it read that batch's
    # compute-side state, so if it fails too its other requests are re-run, not aborted.
    after_failure: bool = False


class EventLoopsMixin:
    """Mixed into Scheduler: the loops, launching and completing batches, waits accounting."""

    def _init_loop_state(self) -> None:
        self._inflight: Launched | None = None
        self._stream: Stream | None = None
        self._iteration_records: list[dict] = []  # per batch: compute time and compute-side wait
        self._pending_timings: list[WorkTiming] = []  # stream timings of batches not processed yet
        self._last_compute_end: float | None = None

    # ---------------------------------------------------------------- loops
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None)

    def event_loop(self) -> None:
        if self.config.overlap:
            self._stream = make_stream(self.device)
            step = self._iteration_overlap
        else:
            self._stream = InlineStream()
            step = self._iteration_normal
        reason = "the engine has been shut down"
        try:
            while not self._stop.is_set():
                try:
                    step()
                except Exception as exc:  # last resort: never let the scheduler thread die
                    logger.error("scheduler iteration failed: %s", traceback.format_exc())
                    self._abort_everything(f"internal error: {exc!r}")
            self._flush_inflight()
        except BaseException as exc:  # the loop cannot go on (even the last resort failed)
            reason = f"the scheduler stopped after an internal error: {exc!r}"
            logger.critical("scheduler thread stopping: %s", traceback.format_exc())
            raise
        finally:
            try:
                self._close(reason)
            finally:
                self._stream.close()

    def _iteration_normal(self) -> None:
        self._drain_inbox(block=not self.has_work())
        if self._stop.is_set():
            return
        batch = self.get_next_batch()
        if batch is None:
            if self.waiting:  # e.g. grammars still compiling
                time.sleep(0.001)
            return
        launched = self._launch(batch)
        self._complete_launch(launched)
        self._process_launched(launched)

    def _iteration_overlap(self) -> None:
        self._drain_inbox(block=not self.has_work())
        if self._stop.is_set():
            return
        if self._inflight is not None and self._inflight.after_failure:  # N-1 failed: settle N first
            self._flush_inflight()
        batch = self.get_next_batch()
        launched = None
        if batch is not None:
            if self._needs_current_grammar(batch) and self._flush_inflight():
                batch.reqs = [r for r in batch.reqs if not r.finished]  # N-1 may have finished some
            launched = self._launch(batch) if batch.reqs else None
        elif self._inflight is None and self.waiting:
            time.sleep(0.001)  # e.g. grammars still compiling
        # N is recorded before N-1 is processed, so no failure in N-1's host work can orphan it
        # (its KV would never be released).
        previous, self._inflight = self._inflight, launched
        try:
            if previous is not None:
                self._process_launched(previous)  # N-1's host work runs while N's forward does
        finally:
            if launched is not None:
                self._complete_launch(launched)

    def _needs_current_grammar(self, batch: ScheduledBatch) -> bool:
        """A speculative batch reads constrained requests' grammar state on the compute side."""
        return (batch.kind is BatchKind.DECODE and self.spec is not None
                and any(r.grammar is not None for r in batch.reqs))

    # ---------------------------------------------------------------- launching and completing
    def _launch(self, batch: ScheduledBatch) -> Launched:
        if batch.kind is BatchKind.PREFILL:
            views = [self.future_map.start(r) for r in batch.reqs]
            for req in batch.reqs:  # nothing can reject a prefill's KV: commit it now, so the next
                req.kv_committed_len = len(req.fill_ids)  # batch's reservation starts from it
            self.running.extend(batch.reqs)
        else:
            views = [self.future_map.view(r) for r in batch.reqs]
        for req in batch.reqs:
            req.inflight += 1
        launched = Launched(batch, views)
        if batch.kind is BatchKind.DECODE and self.spec is not None:
            launched.result = self._stream.submit(self.compute_spec, views)
        else:
            launched.forward = self._stream.submit(self.compute_forward, batch.kind, views)
        launched.num_items = 1
        return launched

    def _complete_launch(self, launched: Launched) -> None:
        """Plain batches: the grammar masks (host state now includes every earlier token), then
        the sampling."""
        if launched.result is not None:
            return
        try:
            mask = self.grammar_mask(launched.batch.reqs)
        except Exception as exc:  # no sampling without the masks: the batch fails like a compute item
            failed: Future = Future()
            failed.set_exception(exc)
            launched.result = failed
            return
        launched.result = self._stream.submit(self.compute_sample, launched.batch.kind, launched.views,
                                              launched.forward, mask)
        launched.num_items += 1

    def _flush_inflight(self) -> bool:
        """Process the launched batch whose results the host has not seen; False if there is none."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return False
        self._process_launched(launched)
        return True

    def _process_launched(self, launched: Launched) -> None:
        batch = launched.batch
        error = None
        try:
            new_tokens = launched.result.result()
        except Exception as exc:  # one failing batch must not take the engine down
            new_tokens, error = None, exc
        try:
            self._record_iteration(launched)
        except Exception:
            logger.error("recording the iteration's timings failed: %s", traceback.format_exc())
        for req in batch.reqs:
            req.inflight -= 1
        if error is not None:
            self._on_compute_failure(launched, error)
        else:
            self.process_batch_result(batch, new_tokens)
        for req in batch.reqs:
            if req.release_pending and req.inflight == 0:
                self._release(req)

    def _on_compute_failure(self, launched: Launched, exc: Exception) -> None:
        """A batch's forward, sampling or verify raised: its requests end with the error. The batch
        launched after it (overlap) read its compute-side state, so it is settled before anything
        else launches, and if it failed too its other requests are re-run from the host's state
        (retracted: re-prefilled from their committed tokens) instead of aborted."""
        batch = launched.batch
        logger.error("%s batch of %d failed: %s", batch.kind.value, len(batch.reqs),
                     "".join(traceback.format_exception(exc)))
        if launched.after_failure:
            self.stats["batch_retries"] += 1
            for req in batch.reqs:
                if not req.finished and req in self.running:
                    self._retract(req)
            return
        self.stats["batch_failures"] += 1
        for req in batch.reqs:
            self._finish(req, {"type": "abort", "message": f"internal error in the {batch.kind.value} batch: {exc!r}"})
        if self._inflight is not None:  # the next iteration settles it before launching anything
            self._inflight.after_failure = True

    def _pending_release(self) -> list:
        """Finished requests whose KV waits for a launched batch (the invariant counts them)."""
        return [r for r in (self._inflight.batch.reqs if self._inflight else []) if r.release_pending]

    def _abort_everything(self, message: str) -> None:
        """The last resort after an unexpected failure of the loop itself: settle the batch in flight
        and end every request, so the loop starts again from a clean state."""
        try:
            self._flush_inflight()
        except Exception:
            logger.error("settling the batch in flight failed: %s", traceback.format_exc())
            launched, self._inflight = self._inflight, None
            for req in launched.batch.reqs if launched is not None else []:
                req.inflight = 0  # the stream runs in order: later work cannot overtake what it wrote
                if req.release_pending:
                    self._release(req)
        for req in self.waiting + self.running:
            self._finish(req, {"type": "abort", "message": message})

    # ---------------------------------------------------------------- how long compute waits
    def _record_iteration(self, launched: Launched) -> None:
        """The compute side's time for this batch and how long it sat idle waiting for the host
        since the previous batch's work ended (the figure the overlap loop exists to shrink)."""
        self._pending_timings += self._stream.take_timings()
        n = launched.num_items
        items, self._pending_timings = self._pending_timings[:n], self._pending_timings[n:]
        if not items:
            return
        compute = sum(t.ended - t.started for t in items)
        # Work runs in order, so an item starts when the previous one ended, unless the compute side
        # had nothing to run: that gap is time it waited for the host.
        wait, prev_end = 0.0, self._last_compute_end
        for t in items:
            if prev_end is not None:
                wait += max(0.0, t.started - prev_end)
            prev_end = t.ended
        self._last_compute_end = prev_end
        if len(self._iteration_records) < _MAX_ITERATION_RECORDS:
            self._iteration_records.append({"kind": launched.batch.kind.value, "batch_size": len(launched.batch.reqs),
                                            "compute_s": compute, "wait_s": wait})

    def overlap_stats(self, reset: bool = False) -> dict:
        """Decode iterations: median compute time, median compute-side wait for the host, and the
        wait as a fraction of the iteration (wait + compute)."""
        records = [r for r in self._iteration_records if r["kind"] == "decode"]
        if reset:
            self._iteration_records = []
        if not records:
            return {"iterations": 0}
        fractions = [r["wait_s"] / (r["wait_s"] + r["compute_s"]) for r in records if r["wait_s"] + r["compute_s"] > 0]
        return {
            "iterations": len(records),
            "compute_ms_median": 1e3 * statistics.median(r["compute_s"] for r in records),
            "wait_ms_median": 1e3 * statistics.median(r["wait_s"] for r in records),
            "wait_fraction_median": statistics.median(fractions) if fractions else 0.0,
            "wait_fraction_mean": sum(r["wait_s"] for r in records) / sum(r["wait_s"] + r["compute_s"] for r in records),
        }
