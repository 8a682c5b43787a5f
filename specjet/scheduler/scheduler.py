"""The scheduler: decides which requests run each iteration, runs them, and hands results back.

It owns the waiting queue, the running batch, the KV pools and the per-request grammar matchers.
It runs on its own thread behind the Engine; requests and aborts arrive through an inbox queue
and results leave through each request's sink, so nothing here blocks on a caller.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from specjet.grammar import (RequestGrammar, allocate_token_bitmask, apply_token_bitmask_, check_json_output,
                             fill_token_bitmasks)
from specjet.kernels.sampling import sample
from specjet.models.runner import ModelRunner
from specjet.scheduler.batch import BatchKind, ScheduledBatch, build_decode_batch, build_prefill_batch
from specjet.scheduler.detokenizer import update_text
from specjet.scheduler.event_loops import EventLoopsMixin
from specjet.scheduler.future_map import ComputeView, FutureMap
from specjet.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator, check_kv_invariant
from specjet.scheduler.output import final_output, stream_chunk
from specjet.scheduler.request import Req
from specjet.scheduler.spec_decode import SpecConfig, SpecDecoder, sampling_tensors

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    page_size: int = 1
    max_running_requests: int = 32
    max_prefill_tokens: int = 4096
    context_len: int = 8192
    random_seed: int | None = None
    spec: "SpecConfig | None" = None
    overlap: bool = True  # False: the plain loop (disable_overlap_schedule)


class Scheduler(EventLoopsMixin):
    def __init__(self, runner: ModelRunner, tokenizer, grammar_backend, config: SchedulerConfig):
        self.runner = runner
        self.tokenizer = tokenizer
        self.grammar_backend = grammar_backend
        self.config = config
        self.device = runner.device
        self.allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, config.page_size, self.device)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 1, config.context_len, self.device)
        self.vocab_size = runner.config.vocab_size
        self.eos_token_ids = set(runner.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)

        self.spec = (SpecDecoder(runner, config.spec, self.vocab_size, config.context_len, self.allocator,
                                 tokenizer=tokenizer)
                     if config.spec is not None else None)
        self.future_map = FutureMap(self.req_to_token_pool.num_rows)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seed_rng = random.Random(config.random_seed)
        self._stop = threading.Event()
        # Submission and the loop's last drain of the inbox take this lock, so no request can be
        # queued after the loop has stopped answering (it would wait for ever).
        self._submit_lock = threading.RLock()
        self._live_rids: set[str] = set()  # submitted and not yet answered with a finish
        self.closed_reason: str | None = None  # set when the loop stops for good (shut down or died)
        self.stats = {"iterations": 0, "prefill_batches": 0, "decode_batches": 0, "retractions": 0,
                      "requests_submitted": 0, "request_errors": 0, "batch_failures": 0, "batch_retries": 0}
        self._init_loop_state()

    # ---------------------------------------------------------------- requests in and out
    def submit(self, reqs: list[Req]) -> None:
        """Thread-safe: queue requests, all or none; grammar compilation starts at once, off this
        thread. Raises ValueError for a rid that is live (or repeated in ``reqs``) and RuntimeError
        once the loop has stopped."""
        with self._submit_lock:
            if self.closed_reason is not None:
                raise RuntimeError(f"the engine is not running: {self.closed_reason}")
            rids = [r.rid for r in reqs]
            clash = sorted({r for r in rids if r in self._live_rids or rids.count(r) > 1})
            if clash:
                raise ValueError(f"rid {clash[0]!r} is already in use by a live request (rids must be unique)")
            self._live_rids.update(rids)
            self.stats["requests_submitted"] += len(reqs)
            for req in reqs:
                key = req.sampling.grammar_key
                if key is not None:
                    req.grammar_future = self.grammar_backend.compile(*key)
                self.inbox.put(("add", req))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def run_in_loop(self, fn):
        """Thread-safe: run ``fn`` on the scheduler thread between two iterations; returns a Future
        (failed at once with RuntimeError when the loop has stopped)."""
        from concurrent.futures import Future

        future: Future = Future()
        with self._submit_lock:
            if self.closed_reason is not None:
                future.set_exception(RuntimeError(f"the engine is not running: {self.closed_reason}"))
            else:
                self.inbox.put(("call", (fn, future)))
        return future

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("stop", None))

    def _drain_inbox(self, block: bool) -> None:
        timeout = 0.05 if block else None
        while True:
            try:
                kind, value = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
            except queue.Empty:
                return
            timeout = None
            if kind == "add":
                self._admit(value)
            elif kind == "call":  # run a function between iterations, on this thread
                fn, future = value
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            elif kind == "abort":
                for req in self.waiting + self.running:
                    if req.rid == value:
                        req.to_abort = True

    def _admit(self, req: Req) -> None:
        sp = req.sampling
        if not sp.is_greedy:  # the seed was range-checked at the door (SamplingParams)
            seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
            req.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.waiting.append(req)

    # ---------------------------------------------------------------- the loop (event_loops.py)
    def _close(self, message: str) -> None:
        """The loop is ending for good: answer every request it holds or will never read, and fail
        every queued call, so no caller waits on a loop that is gone."""
        for req in self.waiting + self.running + self._pending_release():
            self._finish(req, {"type": "abort", "message": message})
        with self._submit_lock:
            self.closed_reason = message
            while True:
                try:
                    kind, value = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._finish(value, {"type": "abort", "message": message})
                elif kind == "call":
                    value[1].set_exception(RuntimeError(f"the engine is not running: {message}"))

    # ---------------------------------------------------------------- scheduling
    def get_next_batch(self) -> ScheduledBatch | None:
        self.stats["iterations"] += 1
        self._remove_aborted()
        prefill = self._schedule_prefill()
        if prefill:
            self.stats["prefill_batches"] += 1
            return ScheduledBatch(BatchKind.PREFILL, prefill)
        if self.running:
            decode = self._prepare_decode()
            if decode:
                self.stats["decode_batches"] += 1
                return ScheduledBatch(BatchKind.DECODE, decode)
        return None

    def _remove_aborted(self) -> None:
        for req in [r for r in self.waiting + self.running if r.to_abort]:
            self._finish(req, {"type": "abort", "message": "aborted by the caller"})

    def _grammar_ready(self, req: Req) -> bool:
        """False while the grammar is compiling. A compile error finishes the request (alone)."""
        if req.grammar is not None or req.grammar_future is None:
            return True
        if not req.grammar_future.done():
            return False
        try:
            req.grammar = RequestGrammar(req.grammar_future.result())
        except Exception as exc:  # GrammarError names the problem; it fails this request alone
            self._finish(req, {"type": "abort", "message": str(exc)})
            return False
        return True

    def _schedule_prefill(self) -> list[Req]:
        chosen: list[Req] = []
        budget = self.config.max_prefill_tokens
        for req in list(self.waiting):
            if not self._grammar_ready(req):
                continue
            if len(self.running) + len(chosen) >= self.config.max_running_requests:
                break
            num_tokens = len(req.fill_ids)
            if chosen and num_tokens > budget:
                break
            # Keep one decode iteration's worth of room per running request (a page, or a draft
            # tree and the drafter's scratch with speculation) so admitting this one does not force
            # an immediate retraction of another.
            ahead = self.spec.max_nodes if self.spec is not None else 1
            others = len(self.running) + len(chosen)
            headroom = others * self.allocator.slots_needed(0, ahead)
            if self.spec is not None:
                headroom += self.spec.scratch_slots(others + 1)
            need = self.allocator.slots_needed(0, num_tokens)
            if need + headroom > self.allocator.num_free_slots:
                break
            row = self.req_to_token_pool.alloc()
            if row is None:
                break
            req.req_pool_idx = row
            self._reserve(req, num_tokens)
            self.waiting.remove(req)
            chosen.append(req)
            budget -= num_tokens
        return chosen

    def _reserve(self, req: Req, new_len: int) -> None:
        """Make sure positions [0, new_len) of ``req`` have KV slots (the allocator raises if it cannot)."""
        if new_len <= req.kv_allocated_len:
            return
        row = self.req_to_token_pool.table[req.req_pool_idx]
        slots = self.allocator.extend(row, req.kv_allocated_len, new_len)
        row[req.kv_allocated_len:new_len] = slots
        req.kv_allocated_len = new_len

    def _prepare_decode(self) -> list[Req]:
        """Every running request needs a slot for one more position; retract the newest requests
        (free their KV, requeue them to re-prefill later) until the rest fit."""
        while self.running:
            need = sum(self.allocator.slots_needed(r.kv_allocated_len, self._decode_len(r)) for r in self.running)
            if self.spec is not None:  # the drafter borrows scratch slots for the tree nodes
                need += self.spec.scratch_slots(len(self.running))
            if need <= self.allocator.num_free_slots:
                break
            if self._flush_inflight():  # its finished requests may free enough; decide on exact state
                continue
            if len(self.running) == 1:
                req = self.running[0]
                self._finish(req, {"type": "abort", "message":
                                   f"KV pool exhausted: the request needs more than the pool's {self.allocator.size} slots"})
                return []
            self._retract(self.running[-1])
        for req in self.running:
            self._reserve(req, self._decode_len(req))
        return list(self.running)

    def _decode_len(self, req: Req) -> int:
        """Positions that must have KV slots before this request's next decode iteration: one more,
        or a whole draft tree's worth with speculation, plus as much for each launched iteration the
        host has not processed yet (capped by the context length)."""
        ahead = self.spec.max_nodes if self.spec is not None else 1
        return min(req.kv_committed_len + ahead * (1 + req.inflight), self.config.context_len)

    def _retract(self, req: Req) -> None:
        self.stats["retractions"] += 1
        req.retract_count += 1
        self.running.remove(req)
        self._release_kv(req)
        self.waiting.insert(0, req)

    def slots_to_start(self, num_prompt_tokens: int) -> int:
        """KV slots a request of this prompt length needs to run at all, alone in the pool: its
        prompt and one iteration's growth (a draft tree with speculation) plus the drafter's
        scratch. A prompt that needs more than the pool could never be admitted."""
        ahead = self.spec.max_nodes if self.spec is not None else 1
        scratch = self.spec.scratch_slots(1) if self.spec is not None else 0
        return self.allocator.slots_needed(0, min(num_prompt_tokens + ahead, self.config.context_len)) + scratch

    def _release(self, req: Req) -> None:
        """Give back a finished request's KV and drafter state, once no launched batch uses them."""
        if req.inflight > 0:
            req.release_pending = True
            return
        req.release_pending = False
        self._release_kv(req)
        if self.spec is not None:
            self.spec.release(req)

    def _release_kv(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.future_map.release(req.req_pool_idx)
        row = self.req_to_token_pool.table[req.req_pool_idx]
        self.allocator.free_request(row, req.kv_allocated_len)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_committed_len = req.kv_allocated_len = 0

    # ---------------------------------------------------------------- compute side
    # These run on the compute stream and see requests through ComputeViews (future_map.py): they
    # read and advance the compute side's tokens and lengths, never the host's.
    def compute_forward(self, kind: BatchKind, views: list[ComputeView]):
        table = self.req_to_token_pool.table
        if kind is BatchKind.PREFILL:
            capture = self.spec.target_capture if self.spec is not None else None
            fb = build_prefill_batch(views, table, self.device, capture_hidden=capture)
        else:
            fb = build_decode_batch(views, table, self.device)
        return self.runner.forward(fb)

    def compute_sample(self, kind: BatchKind, views: list[ComputeView], forward, grammar_mask) -> list[list[int]]:
        """Sample each request's next token from the forward's logits (masked by the host-built
        grammar bitmask) and publish it to the compute side's views."""
        out = forward.result()
        logits = out.logits
        if grammar_mask is not None:
            bitmask, rows = grammar_mask
            logits = logits.cpu() if logits.device.type != "cpu" else logits
            apply_token_bitmask_(logits, bitmask, indices=rows)
        tokens = self.sample(views, logits)
        if kind is BatchKind.PREFILL and self.spec is not None and self.spec.target_capture is not None:
            self.spec.after_prefill(views, out.hidden, tokens, self.req_to_token_pool.table)
        for view, token in zip(views, tokens):
            view.kv_committed_len = len(view.fill_ids) if kind is BatchKind.PREFILL else view.kv_committed_len + 1
            view.output_ids.append(token)
        return [[t] for t in tokens]

    def compute_spec(self, views: list[ComputeView]) -> list[list[int]]:
        """One speculative iteration: draft, verify, accept; the root and the accepted draft nodes
        now have KV, and the bonus token is the next root."""
        new_tokens = self.spec.run(views, self.req_to_token_pool.table)
        for view, tokens in zip(views, new_tokens):
            view.kv_committed_len += len(tokens)
            view.output_ids.extend(tokens)
        return new_tokens

    def sample(self, reqs, logits: torch.Tensor) -> list[int]:
        st = sampling_tensors(reqs, logits.device)
        uniforms = None
        if not st.all_greedy:
            uniforms = torch.tensor(
                [float(torch.rand((), generator=r.generator)) if r.generator is not None else 0.0 for r in reqs],
                device=logits.device,
            )
        return sample(logits, st, uniforms).tolist()

    # ---------------------------------------------------------------- host side of a batch
    def grammar_mask(self, reqs: list[Req]):
        """(bitmask, rows) for the constrained requests of a plain batch, from the host's grammar
        state (which must include every token before this batch's), or None."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(reqs), self.vocab_size)
        try:
            fill_token_bitmasks([reqs[i].grammar for i in rows], bitmask, rows)
        except Exception:  # find the request whose grammar failed, one by one; the others go on
            kept = []
            for i in rows:
                try:
                    fill_token_bitmasks([reqs[i].grammar], bitmask, [i])
                    kept.append(i)
                except Exception as exc:
                    self._fail_request(reqs[i], "building its grammar mask", exc)
            rows = kept
        return (bitmask, rows) if rows else None

    # ---------------------------------------------------------------- results
    def process_batch_result(self, batch: ScheduledBatch, new_tokens: list[list[int]]) -> None:
        now = time.perf_counter()
        for req, tokens in zip(batch.reqs, new_tokens):
            if req.finished:
                continue
            try:
                self._commit_tokens(req, batch.kind, tokens, now)
            except Exception as exc:  # this request's host work failed: it alone ends
                self._fail_request(req, "processing its output", exc)

    def _commit_tokens(self, req: Req, kind: BatchKind, tokens: list[int], now: float) -> None:
        """Append one request's new tokens (grammar, stop checks, detokenizing), then finish or stream."""
        if kind is BatchKind.DECODE:  # plain: the input token; speculation: root + accepted nodes
            if not tokens:  # a speculative iteration that had no room for this request (it is ending)
                return
            req.kv_committed_len += len(tokens)
            if self.spec is not None:
                self._count_verify(req, len(tokens))
        if req.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        if req.first_token_at is None:
            req.first_token_at = now
        reason = None
        for token in tokens:  # a finishing token cuts the accepted run: later ones are dropped
            req.output_ids.append(token)
            reason = self._check_finished(req, token)
            if reason is not None:
                break
        if reason is not None:
            self._finish(req, reason)
        elif req.stream and req.sink is not None:
            chunk = stream_chunk(req)
            if chunk is not None:
                req.sink(chunk)

    def _fail_request(self, req: Req, doing: str, exc: BaseException) -> None:
        """A host-side failure that concerns one request: log it, finish that request alone."""
        self.stats["request_errors"] += 1
        logger.error("request %s failed while %s: %s", req.rid, doing, "".join(traceback.format_exception(exc)))
        self._finish(req, {"type": "abort", "message": f"internal error while {doing}: {exc!r}"})

    def _count_verify(self, req: Req, num_tokens: int) -> None:
        req.spec_verify_ct += 1
        req.spec_accept_hist[num_tokens] = req.spec_accept_hist.get(num_tokens, 0) + 1
        self.spec.stats["spec_verify_ct"] += 1
        self.spec.stats["spec_accepted_tokens"] += num_tokens

    def _check_finished(self, req: Req, token: int) -> dict | None:
        sp = req.sampling
        if req.grammar is not None:
            if not req.grammar.accept_token(token):
                return {"type": "abort", "message": f"grammar rejected token {token}"}
            if req.grammar.is_terminated():
                update_text(req, self.tokenizer)
                return {"type": "stop", "matched": token}
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            update_text(req, self.tokenizer)
            return {"type": "stop", "matched": token}
        needs_text = bool(sp.stop) or req.stream
        stop = update_text(req, self.tokenizer) if needs_text else None
        if stop is not None:
            return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if len(req.fill_ids) >= self.config.context_len:
            return {"type": "length", "length": len(req.output_ids), "message": "context length reached"}
        return None

    def _finish(self, req: Req, reason: dict) -> None:
        """End a request: release what it holds and answer its caller. Never raises: it is what
        every failure path ends in, so a failure in here (detokenizing, the caller's sink) is
        logged and the request is still released and, where the sink allows, answered."""
        if req.finished:
            return
        req.finished_reason = reason
        req.finished_at = time.perf_counter()
        try:
            if not isinstance(reason.get("matched"), str):  # a stop-string finish has already cut the text
                update_text(req, self.tokenizer)
        except Exception as exc:
            logger.error("request %s: detokenizing its output failed: %r", req.rid, exc)
        if reason["type"] == "stop" and req.sampling.json_schema is not None:
            req.output_check = check_json_output(req.sampling.json_schema, req.text)  # never raises
            if req.output_check.valid is False:  # the caller must not take it for a valid object
                reason["message"] = req.output_check.message
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        try:
            self._release(req)
        except Exception:
            logger.error("request %s: releasing its KV failed: %s", req.rid, traceback.format_exc())
        # The grammar future is left alone: the compile cache shares it with every request of the
        # same grammar (the backend hands each caller its own handle).
        with self._submit_lock:
            self._live_rids.discard(req.rid)
        if req.sink is None:
            return
        try:
            out = stream_chunk(req) if req.stream else final_output(req)
        except Exception:
            logger.error("request %s: building its result failed: %s", req.rid, traceback.format_exc())
            out = {"text": "", "output_ids": [], "meta_info": {"id": req.rid, "finish_reason": reason}}
        try:
            req.sink(out)
        except Exception:
            logger.error("request %s: handing back its result failed: %s", req.rid, traceback.format_exc())

    # ---------------------------------------------------------------- checks
    def check_kv_invariant(self) -> None:
        """free + owned == pool size; callable when the loop is idle (tests call it after each workload)."""
        table = self.req_to_token_pool.table
        live = self.running + self.waiting + self._pending_release()
        owned = {r.rid: table[r.req_pool_idx, :r.kv_allocated_len] for r in live if r.req_pool_idx is not None}
        check_kv_invariant(self.allocator, owned)
        live_rows = sum(1 for r in live if r.req_pool_idx is not None)
        if live_rows + self.req_to_token_pool.available != self.req_to_token_pool.num_rows:
            raise AssertionError("a ReqToTokenPool row leaked")
