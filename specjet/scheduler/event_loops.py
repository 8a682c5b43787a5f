"""The scheduler's two event loops: what runs when, between the scheduler (host) and the worker
(compute side).

Which one runs: ``disable_overlap_schedule``, by default (None) the overlap loop on CUDA and the plain
loop on the CPU (engine/loading.py ``use_overlap_schedule``).

Plain loop: schedule N, run N, process N, one after the other, the compute inline on the scheduler thread.

Overlap loop, one iteration (docs/architecture.md walks it file by file):

1. schedule batch N from the host's state, which lags by the one batch still in flight (N-1):
   KV is reserved for N-1's possible growth too, and requests N-1 finishes still ride along in N
   (their N results are dropped, their KV is released once N is processed);
2. launch N on the compute stream: a plain forward, or a whole speculative iteration (draft,
   verify, accept); it reads N-1's tokens from the worker's compute state;
3. process N-1's results on the host (grammar ``accept_token``, stop checks, detokenize, stream,
   commit ``kv_committed_len``, finish) while N runs;
4. plain batches: build N's grammar masks from the now-current grammar state and submit N's sampling.

The batch in flight is a value the loop passes from one iteration to the next
(``last = self._overlap_iteration(last)``). Retraction needs the exact state: when the scheduler
asks for it (``SETTLE_FIRST``), the loop processes the batch in flight before scheduling again.
"""
from __future__ import annotations

import logging
import statistics
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from specjet.kernels.openmp_teams import IdleTeam, release_calling_thread_team
from specjet.scheduler.batch import BatchKind, ScheduledBatch
from specjet.scheduler.scheduler import SETTLE_FIRST, Scheduler
from specjet.scheduler.streams import WorkTiming, make_stream
from specjet.scheduler.worker import ModelWorker, WorkerBatch

logger = logging.getLogger(__name__)

_MAX_ITERATION_RECORDS = 4096


@dataclass
class Launched:
    """A batch submitted to the compute stream whose results the host has not processed."""

    batch: ScheduledBatch
    work: WorkerBatch
    forward: Future | None = None  # plain batches: the forward, then the sampling
    result: Future | None = None  # list[list[int]]: new tokens per request
    num_items: int = 0  # work items submitted for it (to attribute the stream's timings)
    # Launched while the batch before it failed on the compute side: it read that batch's
    # compute-side state, so if it fails too its other requests are re-run, not aborted.
    after_failure: bool = False


class EventLoop:
    def __init__(self, scheduler: Scheduler, worker: ModelWorker, overlap: bool):
        self.scheduler = scheduler
        self.worker = worker
        self.overlap = overlap
        self.stream = make_stream(worker.device, overlap)
        self._iteration_records: list[dict] = []  # per batch: compute time and compute-side wait
        self._pending_timings: list[WorkTiming] = []  # stream timings of batches not processed yet
        self._last_compute_end: float | None = None
        # The plain loop's forwards run on the loop's thread: its team (bound to CPUs where they are the CPU's).
        self._team = IdleTeam(pin=worker.device.type == "cpu")

    # ---------------------------------------------------------------- the thread
    def run(self) -> None:
        """The scheduler thread's body: iterate until stopped; whatever ends the loop, every request
        it holds and every call queued for it is answered (``Scheduler.close``)."""
        sched = self.scheduler
        reason = "the engine has been shut down"
        last: Launched | None = None
        try:
            while not sched.stop_requested():
                try:
                    if self.overlap:
                        last = self._overlap_iteration(last)
                    else:
                        self._normal_iteration()
                except Exception as exc:  # last resort: never let the scheduler thread die
                    logger.error("scheduler iteration failed: %s", traceback.format_exc())
                    last = None
                    self._recover(f"internal error: {exc!r}")
            if last is not None:
                self._process(last)
            reason = sched.stop_message or reason
        except BaseException as exc:  # the loop cannot go on (even the last resort failed)
            reason = f"the scheduler stopped after an internal error: {exc!r}"
            logger.critical("scheduler thread stopping: %s", traceback.format_exc())
            raise
        finally:
            try:
                sched.close(reason)
            finally:
                self._team.close()
                self.stream.close()

    def _normal_iteration(self) -> None:
        sched = self.scheduler
        self._drain_inbox(idle=not sched.has_work())
        if sched.stop_requested():
            return
        batch = sched.next_batch(exact=True)
        if batch is None:
            if sched.waiting:  # e.g. grammars still compiling
                time.sleep(0.001)
            return
        launched = self._launch(batch)
        if launched is None:  # every request of it ended while it was launched
            return
        self._submit_sampling(launched)
        self._process(launched)

    def _overlap_iteration(self, last: Launched | None) -> Launched | None:
        """One iteration; ``last`` is the batch in flight (N-1), the return value is N."""
        sched = self.scheduler
        self._drain_inbox(idle=not (sched.has_work() or last is not None))
        if sched.stop_requested():
            return last
        if last is not None and last.after_failure:  # N-1 failed: settle the batch after it first
            self._process(last)
            last = None
        batch = sched.next_batch(exact=last is None)
        if batch is SETTLE_FIRST:  # retraction needs the exact state
            self._process(last)
            last = None
            batch = sched.next_batch(exact=True)
        launched = self._launch(batch) if batch is not None else None
        if batch is None and last is None and sched.waiting:
            time.sleep(0.001)  # e.g. grammars still compiling
        # N is launched before N-1 is processed, and neither processing N-1 nor submitting N's
        # sampling raises (failures are confined to requests and batches), so no failure in N-1's
        # host work can orphan N.
        if last is not None:
            self._process(last, next_batch=launched)
        if launched is not None:
            self._submit_sampling(launched)
        return launched

    def _drain_inbox(self, idle: bool) -> None:
        """New requests and calls; an idle loop waits for them. The plain loop's forwards run on this
        thread, which keeps its OpenMP team while idle unless another engine computes (``IdleTeam``); the
        overlap loop's host thread computes nothing, and frees whatever team it made at once."""
        if idle:
            self._release_ended()
        self.scheduler.drain_inbox(block=idle)
        if idle and not self.scheduler.has_work():
            if self.overlap:
                release_calling_thread_team()
            else:
                self._team.idle()
        elif not self.overlap:
            self._team.busy()

    def _release_ended(self) -> None:
        """With nothing in flight, hand the compute side the requests that ended since the last launch (which
        would otherwise wait for the next batch): an idle engine holds no ended request's state, such as a long
        request's n-gram index or its draft state."""
        rids = self.scheduler.take_released()
        if rids:
            try:
                self.stream.submit(self.worker.release, rids, timed=False).result()
            except Exception:  # dropping state cannot fail a request; a bug here must not stop the loop
                logger.exception("dropping the compute-side state of %d ended requests failed", len(rids))

    # ---------------------------------------------------------------- launching and completing
    def _launch(self, batch: ScheduledBatch) -> Launched | None:
        work = self.scheduler.start_batch(batch)
        if work is None:
            return None
        launched = Launched(batch, work, num_items=1)
        if batch.kind is BatchKind.DECODE and batch.speculative:
            launched.result = self.stream.submit(self.worker.speculate, work)
        else:
            launched.forward = self.stream.submit(self.worker.forward, work)
        return launched

    def _submit_sampling(self, launched: Launched) -> None:
        """Plain batches: the grammar masks (host state now includes every earlier token), then the
        sampling. Never raises: a failure becomes the batch's result."""
        if launched.result is not None:
            return
        try:
            mask = self.scheduler.grammar_mask(launched.batch.reqs)
        except Exception as exc:  # no sampling without the masks: the batch fails like a compute item
            failed: Future = Future()
            failed.set_exception(exc)
            launched.result = failed
            return
        launched.result = self.stream.submit(self.worker.sample, launched.work, launched.forward, mask)
        launched.num_items += 1

    def _process(self, launched: Launched, next_batch: Launched | None = None) -> None:
        """Hand a launched batch's results (or its failure) to the scheduler. A failed batch's
        successor ``next_batch`` read its compute-side state, so it is marked to be settled
        before anything else launches; if it was itself such a successor, its requests are re-run
        instead of aborted."""
        error = None
        try:
            new_tokens = launched.result.result()
        except Exception as exc:  # one failing batch must not take the engine down
            new_tokens, error = None, exc
            logger.error("%s batch of %d failed: %s", launched.batch.kind.value, len(launched.batch.reqs),
                         "".join(traceback.format_exception(exc)))
        try:
            self._record_iteration(launched)
        except Exception:
            logger.error("recording the iteration's timings failed: %s", traceback.format_exc())
        self.scheduler.batch_done(launched.batch, new_tokens, error, retry=launched.after_failure)
        if error is not None and not launched.after_failure and next_batch is not None:
            next_batch.after_failure = True

    def _recover(self, message: str) -> None:
        """The last resort after an unexpected failure of the loop itself: wait for the compute side
        to finish what was launched and end every request, so the loop starts again from a clean
        state (the launched batches' results are dropped)."""
        try:
            self.stream.synchronize()
        except Exception:
            logger.error("waiting for the compute side failed: %s", traceback.format_exc())
        self._pending_timings = []
        self.stream.take_timings()
        self.scheduler.abort_all(message)

    # ---------------------------------------------------------------- how long compute waits
    def _record_iteration(self, launched: Launched) -> None:
        """The compute side's time for this batch and how long it sat idle waiting for the host
        since the previous batch's work ended (the figure the overlap loop exists to shrink)."""
        self._pending_timings += self.stream.take_timings()
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
        # A plain batch's first item is its model forward (then the sampling); a speculative batch
        # is one item, its phases timed by the speculator.
        forward = None
        if launched.forward is not None:  # the forward item, and its head where the sampling ran it
            forward = items[0].ended - items[0].started
            if launched.forward.done() and launched.forward.exception() is None:
                forward += launched.forward.result().head_seconds
        if len(self._iteration_records) < _MAX_ITERATION_RECORDS:
            self._iteration_records.append({"kind": launched.batch.kind.value, "batch_size": len(launched.batch.reqs),
                                            "compute_s": compute, "wait_s": wait, "forward_s": forward})

    def overlap_stats(self, reset: bool = False) -> dict:
        """Decode iterations: median compute time, median compute-side wait for the host, and the
        wait as a fraction of the iteration (wait + compute); for plain decoding also the median
        model forward and iteration (wait + compute), whose ratio says what an iteration costs
        beyond its forward. Call it on the loop's thread (``Engine`` does, through ``run_in_loop``)."""
        records = [r for r in self._iteration_records if r["kind"] == "decode"]
        if reset:
            self._iteration_records = []
        if not records:
            return {"iterations": 0}
        fractions = [r["wait_s"] / (r["wait_s"] + r["compute_s"]) for r in records if r["wait_s"] + r["compute_s"] > 0]
        plain = [r for r in records if r["forward_s"] is not None]
        forward_stats = {} if not plain else {
            "forward_ms_median": 1e3 * statistics.median(r["forward_s"] for r in plain),
            "iteration_ms_median": 1e3 * statistics.median(r["wait_s"] + r["compute_s"] for r in plain),
        }
        return {**forward_stats,
            "iterations": len(records),
            "compute_ms_median": 1e3 * statistics.median(r["compute_s"] for r in records),
            "wait_ms_median": 1e3 * statistics.median(r["wait_s"] for r in records),
            "wait_fraction_median": statistics.median(fractions) if fractions else 0.0,
            "wait_fraction_mean": sum(r["wait_s"] for r in records) / sum(r["wait_s"] + r["compute_s"] for r in records),
        }
