"""The scheduler: policy and bookkeeping on the host side of the loop.

It decides which requests run each iteration (admission, KV reservation, retraction), and it alone
writes request state: it owns the waiting queue, the running batch, the KV pools, each request's
grammar matcher, and the stats; it commits each batch's tokens (grammar, stop checks,
detokenizing, streaming) and finishes requests. The compute side is the worker (worker.py); the
loop that drives both is event_loops.py. It runs on the scheduler thread behind the Engine;
requests and aborts arrive through an inbox queue and results leave through each request's sink,
so nothing here blocks on a caller.
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

from specjet.grammar import GrammarError, RequestGrammar, check_json_output, empty_token_bitmask, fill_token_bitmasks
from specjet.kernels.coins import coin_key
from specjet.scheduler.batch import BatchKind, ScheduledBatch
from specjet.scheduler.detokenizer import skipped_ids, update_text
from specjet.scheduler.finish_reasons import (ABORTED, ENGINE_NOT_ALIVE, GRAMMAR_REFUSED, INTERNAL_ERROR,
                                              KV_POOL_EXHAUSTED, abort_reason, grammar_err_type)
from specjet.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator, check_kv_invariant
from specjet.scheduler.output import final_output, stream_chunk
from specjet.scheduler.radix_cache import RadixCache
from specjet.scheduler.request import Req
from specjet.scheduler.worker import ReqInput, WorkerBatch
from specjet.spec_v2.speculator import Speculator

logger = logging.getLogger(__name__)

# A waiting request whose next this many uncached prompt tokens are also being prefilled by another
# request of the batch waits for that prefill and then shares its cached KV (``_shares_uncached_prefix``).
IN_BATCH_PREFIX_TOKENS = 32


@dataclass
class SchedulerConfig:
    page_size: int = 1
    max_running_requests: int = 32
    max_prefill_tokens: int = 4096
    context_len: int = 8192
    random_seed: int | None = None
    disable_radix_cache: bool = False
    # A prompt whose uncached part is longer than this is prefilled in chunks of it, one per
    # iteration, with the running requests' decode steps in between (None: whole prompts).
    chunked_prefill_size: int | None = None
    # CPU seconds one token's grammar match may take before the request is ended (EngineArgs); None: no limit.
    grammar_token_timeout: float | None = None
    # Requests submitted and not yet started that a submission may bring the queue to (EngineArgs); None: no bound.
    max_queued_requests: int | None = None


class QueueFullError(RuntimeError):
    """A submission that would take the queue of requests not yet started past ``max_queued_requests``: nothing
    of it was queued, and it may be tried again once the queue has drained (the server answers 503)."""


# Failed batches a request may run alone in, with no successful decode batch in between, before it ends: one is
# retried (a fault that passes, such as a memory shortage, ends nothing), a second says the fault is its own.
MAX_SOLO_FAILURES = 2

# Tokens in a row over grammar_token_timeout that end a request: an ambiguous grammar's cost only grows, while a
# huge enum's first few tokens can each cost a few milliseconds and then almost nothing.
GRAMMAR_SLOW_STREAK = 3
# The clock a grammar match is timed by: the scheduler thread's CPU time, not its waits for the GIL or the cores.
grammar_clock = time.thread_time


class _SettleFirst:
    def __repr__(self) -> str:
        return "SETTLE_FIRST"


# ``next_batch(exact=False)``: the decision needs the batch in flight processed first (retraction).
SETTLE_FIRST = _SettleFirst()


class Scheduler:
    def __init__(self, tokenizer, grammar_backend, config: SchedulerConfig, allocator: TokenToKVPoolAllocator,
                 req_to_token_pool: ReqToTokenPool, vocab_size: int, eos_token_ids, spec: Speculator | None = None):
        self.tokenizer = tokenizer
        self.grammar_backend = grammar_backend
        self.config = config
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        # The speculator lives on the compute side; the scheduler reads only its geometry (tree
        # nodes and drafter scratch per iteration, from the configuration) to reserve KV.
        self.spec = spec
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # The request whose prompt is being prefilled in chunks (at most one): admitted, holding KV,
        # neither waiting nor running until its last chunk is launched.
        self.chunked_req: Req | None = None
        self._decode_turn = False  # a chunk ran last: the running requests get a step before the next
        self.cache = None if config.disable_radix_cache else RadixCache(allocator)
        # A drafter whose draft KV at a position depends on the token after it (EAGLE's reads the
        # next token) can use a cached prefix's last position only when the token after it was
        # the same (``_match_prefix``).
        self._draft_reads_next = spec is not None and spec.draft_kv_reads_next_token
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seed_rng = random.Random(config.random_seed)
        self._stop = threading.Event()
        self.stop_message: str | None = None  # what the requests the stop ends are told (the first stop's words)
        # Submission and the loop's last drain of the inbox take this lock, so no request can be
        # queued after the loop has stopped answering (it would wait for ever).
        self._submit_lock = threading.RLock()
        self._live_rids: set[str] = set()  # submitted and not yet answered with a finish
        self._num_queued = 0  # of those, not yet started (Req.started); under _submit_lock
        self.closed_reason: str | None = None  # set when the loop stops for good (shut down or died)
        # Finished requests whose KV waits for a launched batch that still holds them.
        self.release_pending: list[Req] = []
        self._released_rids: list[str] = []  # ended since the last launch: the worker drops their state
        self.stats = {"iterations": 0, "prefill_batches": 0, "decode_batches": 0, "retractions": 0,
                      "requests_submitted": 0, "request_errors": 0, "batch_failures": 0, "batch_retries": 0,
                      "requests_isolated": 0, "batches_done": 0}
        if spec is not None:
            self.stats.update(spec_verify_ct=0, spec_accepted_tokens=0)

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
            cap = self.config.max_queued_requests
            if cap is not None and len(reqs) > cap:  # a caller's error: no wait would let it in
                raise ValueError(f"a call of {len(reqs)} requests can never fit max_queued_requests={cap}")
            if cap is not None and self._num_queued + len(reqs) > cap:
                raise QueueFullError(f"the queue holds {self._num_queued} requests not yet started; {len(reqs)} more "
                                     f"would pass max_queued_requests={cap} (try again later)")
            for req in reqs:  # before anything is registered: should one raise, nothing of the call is held
                key = req.sampling.grammar_key
                if key is not None and req.grammar_future is None:  # (the engine's door may have started it)
                    req.grammar_future = self.grammar_backend.compile(*key)
            self._live_rids.update(rids)
            self._num_queued += len(reqs)
            self.stats["requests_submitted"] += len(reqs)
            # One item for the list: the loop admits a generate() call's requests between the same two
            # iterations, so they start in one batch even when this thread is descheduled mid-submit.
            self.inbox.put(("add", list(reqs)))

    def abort(self, rid: str | None) -> None:
        """Thread-safe: abort the live request ``rid`` (None: every live request) between two iterations."""
        self.inbox.put(("abort", rid))

    def _count_started(self, req: Req) -> None:
        """Take ``req`` out of the requests not yet started (what ``max_queued_requests`` bounds), once: at its first
        admission into a batch, or at its end if it never started."""
        if not req.started:
            req.started = True
            with self._submit_lock:
                self._num_queued -= 1

    @property
    def num_queued(self) -> int:
        """Thread-safe: requests submitted and not yet started (what ``max_queued_requests`` bounds)."""
        with self._submit_lock:
            return self._num_queued

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

    def stop(self, message: str | None = None) -> None:
        """Thread-safe: end the loop; every request it holds is answered with an abort saying ``message``."""
        if self.stop_message is None and message is not None:
            self.stop_message = message
        self._stop.set()
        self.inbox.put(("stop", None))

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def has_work(self) -> bool:
        """Requests waiting or running, or finished ones whose KV waits for a launched batch."""
        return bool(self.waiting or self.running or self.release_pending or self.chunked_req)

    def _live(self) -> list[Req]:
        """Every request the scheduler holds that has not finished (the chunked one included)."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return self.waiting + chunked + self.running

    def drain_inbox(self, block: bool) -> None:
        timeout = 0.05 if block else None
        while True:
            try:
                kind, value = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
            except queue.Empty:
                return
            timeout = None
            if kind == "add":
                for req in value:
                    try:
                        self._admit(req)
                    except Exception as exc:  # its own set-up failed: it ends alone, answered (never lost)
                        self._fail_request(req, "being admitted", exc)
            elif kind == "call":  # run a function between iterations, on this thread
                fn, future = value
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            elif kind == "abort":
                for req in self._live():
                    if value is None or req.rid == value:
                        req.to_abort = True

    def _admit(self, req: Req) -> None:
        sp = req.sampling
        if not sp.is_greedy:  # the seed was range-checked at the door (SamplingParams)
            req.coin_key = coin_key(sp.seed if sp.seed is not None else self._seed_rng.getrandbits(64))
        req.drafts = self._may_draft(sp.prediction, sp.grammar_key is not None)
        self.waiting.append(req)

    # ---------------------------------------------------------------- the loop's end (event_loops.py)
    def close(self, message: str) -> None:
        """The loop is ending for good: answer every request it holds or will never read, and fail
        every queued call, so no caller waits on a loop that is gone."""
        for req in self._live():
            self._finish(req, abort_reason(ENGINE_NOT_ALIVE, message))
        with self._submit_lock:
            self.closed_reason = message
            while True:
                try:
                    kind, value = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    for req in value:
                        self._finish(req, abort_reason(ENGINE_NOT_ALIVE, message))
                elif kind == "call":
                    value[1].set_exception(RuntimeError(f"the engine is not running: {message}"))

    def abort_all(self, message: str) -> None:
        """After an unexpected failure of the loop (the compute side has finished everything
        launched, whose results are dropped): end every request, so the loop starts again clean.
        Nothing of theirs is cached: the dropped batches may have left their KV half written."""
        live = self._live()
        for req in live + self.release_pending:
            req.inflight = 0
            req.kv_cacheable = False
        for req in list(self.release_pending):
            self._release(req)
        for req in live:
            self._finish(req, abort_reason(INTERNAL_ERROR, message))

    # ---------------------------------------------------------------- scheduling
    def next_batch(self, exact: bool = True):
        """The next batch to launch, None when there is nothing to run, or ``SETTLE_FIRST`` when
        ``exact`` is False (a batch is in flight) and retraction would be needed: the loop then
        processes that batch and asks again."""
        self._remove_aborted()
        if self._decode_turn and self.running:  # a long prompt's chunks do not stall the others
            decode = self._decode_batch(exact)
            if decode is not None:
                return decode
        prefill = self._schedule_prefill()
        if prefill:
            self.stats["iterations"] += 1
            self.stats["prefill_batches"] += 1
            self._decode_turn = any(r.prefill_end < len(r.fill_ids) for r in prefill)
            return ScheduledBatch(BatchKind.PREFILL, prefill)
        if self.running:
            return self._decode_batch(exact)
        return None

    def _decode_batch(self, exact: bool):
        decode = self._prepare_decode(exact)
        if decode is SETTLE_FIRST:
            return decode
        self._decode_turn = False
        if not decode:
            return None
        alone = next((r for r in decode if r.runs_alone), None)
        if alone is not None:  # the others keep their reservations and wait an iteration (Req.runs_alone)
            decode = [alone]
        if self.spec is not None and self.spec.drafts_alone_only:
            # Free text that may draft alone, beside others or once its drafting measured slower: plain steps for
            # good (a plain step keeps no draft state). Turned off after the KV reservation, which covered a tree
            # for a launched iteration that drafts.
            for req in decode:
                if req.drafts and not req.sampling.guided and (len(decode) > 1 or self.spec.stopped_drafting(req.rid)):
                    req.drafts = False
        self.stats["iterations"] += 1
        self.stats["decode_batches"] += 1
        drafting = tuple(r.drafts for r in decode)
        return ScheduledBatch(BatchKind.DECODE, decode, speculative=any(drafting), drafting=drafting)

    def _remove_aborted(self) -> None:
        for req in [r for r in self._live() if r.to_abort]:
            self._finish(req, abort_reason(ABORTED, "aborted by the caller"))

    def _grammar_ready(self, req: Req) -> bool:
        """False while the grammar is compiling. A compile error finishes the request (alone)."""
        if req.grammar is not None or req.grammar_future is None:
            return True
        if not req.grammar_future.done():
            return False
        try:
            compiled = req.grammar_future.result()
        except GrammarError as exc:  # it names the problem; it fails this request alone
            self._finish(req, abort_reason(grammar_err_type(exc), str(exc)))
            return False
        except Exception as exc:
            self._fail_request(req, "compiling its grammar", exc)
            return False
        try:
            req.grammar = RequestGrammar(compiled, self.grammar_backend.forced_tokens)
        except Exception as exc:
            self._fail_request(req, "making its grammar matcher", exc)
            return False
        return True

    def _schedule_prefill(self) -> list[Req]:
        """The next prefill batch: the chunked request's next chunk first, then waiting requests in
        order while the token budget (``max_prefill_tokens``), the running-request limit and the KV
        pool allow. Each request's ``prefill_end`` says how far this batch takes it."""
        chosen: list[Req] = []
        budget = self.config.max_prefill_tokens
        chunk = self.config.chunked_prefill_size
        if self.chunked_req is not None:
            req = self.chunked_req
            req.prefill_end = self._prefill_end(req, req.kv_committed_len, budget, may_chunk=True)
            chosen.append(req)
            budget -= req.prefill_end - req.kv_committed_len
        for req in list(self.waiting):
            if chosen and (chosen[0].runs_alone or req.runs_alone):  # a batch of its own (Req.runs_alone)
                break
            if not self._grammar_ready(req):
                continue
            if len(self.running) + len(chosen) >= self.config.max_running_requests or (chosen and budget <= 0):
                break
            num_tokens = len(req.fill_ids)
            cached, match = self._match_prefix(req)
            if self._shares_uncached_prefix(req, cached, chosen):
                self._unlock(match)
                continue
            may_chunk = chunk is not None and not any(r.prefill_end < len(r.fill_ids) for r in chosen)
            end = self._prefill_end(req, cached, budget, may_chunk)
            if chosen and end - cached > budget or end <= cached:
                self._unlock(match)
                break
            # Keep one decode iteration's worth of room per running request (a page, or a draft
            # tree and the drafter's scratch with speculation) so admitting this one does not force
            # an immediate retraction of another. The whole prompt's KV is reserved now, chunked or
            # not, so a chunked prefill never waits for room half way.
            others = len(self.running) + len(chosen)
            headroom = sum(self.allocator.slots_needed(0, self._ahead(r.drafts)) for r in (*self.running, *chosen))
            if self.spec is not None:
                headroom += self.spec.scratch_slots(others + 1)
            need = self.allocator.slots_needed(cached, num_tokens)
            if not self._make_room(need + headroom):
                self._unlock(match)
                break
            row = self.req_to_token_pool.alloc()
            if row is None:
                self._unlock(match)
                break
            self._admit_with_prefix(req, row, cached, match)
            self._reserve(req, num_tokens)
            self._count_started(req)
            req.prefill_end = end
            self.waiting.remove(req)
            chosen.append(req)
            budget -= end - cached
        return chosen

    def _shares_uncached_prefix(self, req: Req, cached: int, chosen: list[Req]) -> bool:
        """Whether ``req``'s next ``IN_BATCH_PREFIX_TOKENS`` uncached tokens are also the ones a request
        of this batch is about to prefill. Such a request waits: once the other's prompt is in the
        cache (after its prefill, or its first chunk) it matches it and shares its KV slots - the
        prefix computed and stored once, and attended to once by both (cascade attention) - instead
        of a copy of its own for the whole of its life. It never waits behind nothing: only a
        request admitted into the same batch defers it."""
        if self.cache is None or not chosen:
            return False
        ahead = req.fill_ids[cached:cached + IN_BATCH_PREFIX_TOKENS]
        if len(ahead) < IN_BATCH_PREFIX_TOKENS:
            return False
        return any(other.fill_ids[cached:cached + IN_BATCH_PREFIX_TOKENS] == ahead for other in chosen)

    def _prefill_end(self, req: Req, start: int, budget: int, may_chunk: bool) -> int:
        """Where a prefill of ``req`` from ``start`` ends in this batch: the whole of its tokens when
        they fit the budget and the chunk size; else, when it may be chunked, a page-aligned chunk
        of at most both (``start`` when not even a page fits); else the whole (a batch's first
        request is taken whole whatever its length when chunking is off)."""
        total = len(req.fill_ids)
        chunk = self.config.chunked_prefill_size
        limit = budget if chunk is None else min(budget, chunk)
        if total - start <= limit:
            return total
        if may_chunk and chunk is not None:
            p = self.allocator.page_size
            return start + max(0, limit) // p * p
        return total

    # ---------------------------------------------------------------- the prefix cache
    def _match_prefix(self, req: Req):
        """(positions of ``req`` whose KV the cache gives it, the match holding them locked, or None).
        At least the last token is always computed (its logits start the output); with a drafter
        whose draft KV reads the next token, the match stops before the first position whose draft
        KV was made with another next token than this request's (``MatchResult.next_token_len``)."""
        if self.cache is None:
            return 0, None
        tokens = req.fill_ids
        match = self.cache.match_prefix(tokens)
        p = self.allocator.page_size
        usable = match.next_token_len if self._draft_reads_next else match.length
        usable = max(0, min(usable, len(tokens) - 1, self._prompt_logprob_limit(req))) // p * p
        if usable == 0:
            return 0, None
        if usable < match.length:
            # Lock only what the request takes: the rest of the match (positions it computes again into its own
            # slots) stays evictable, not pinned beside the request's copy for its whole life.
            match = self.cache.match_prefix(tokens[:usable])
        self.cache.lock(match.node)
        return usable, match

    def _prompt_logprob_limit(self, req: Req) -> int:
        """Positions a prefill may take from the cache and still give the prompt logprobs ``req`` asks for: the
        row before the first asked-for token is computed (a cached position has no logits)."""
        start = req.sampling.logprob_start_len
        if start < 0 or req.first_token_at is not None:  # none asked, or its first prefill gave them
            return len(req.fill_ids)
        return max(start - 1, 0)

    def _unlock(self, match) -> None:
        if match is not None:
            self.cache.unlock(match.node)

    def _admit_with_prefix(self, req: Req, row: int, cached: int, match) -> None:
        """Give ``req`` its pool row with the cached prefix's slots in its first ``cached`` positions."""
        req.req_pool_idx = row
        req.kv_cacheable = True
        if self.cache is not None:
            self.cache.stats["prompt_tokens"] += len(req.fill_ids)
            self.cache.stats["hit_tokens"] += cached
        if req.retract_count == 0:
            req.cached_tokens = cached
        if match is not None:
            self.req_to_token_pool.table[row, :cached] = match.slots[:cached].to(self.req_to_token_pool.table.device)
            req.cache_node = match.node
        req.prefix_len = req.kv_committed_len = req.kv_allocated_len = cached

    def _make_room(self, need: int) -> bool:
        """Whether ``need`` slots are free, evicting unlocked cached prefixes to get there."""
        free = self.allocator.num_free_slots
        if need > free and self.cache is not None:
            self.cache.evict(need - free)
            free = self.allocator.num_free_slots
        return need <= free

    def _cache_prompt(self, req: Req, end: int, next_token: int) -> None:
        """After a successful prefill (or chunk) up to ``end``: put the request's computed prefix in
        the cache, so requests admitted from now on share it while this one still runs. Only when
        the tree holds exactly the request's own cached part (no other request has inserted more of
        the same tokens meanwhile): the request keeps its row as it is, now partly the tree's."""
        if self.cache is None or req.finished or req.req_pool_idx is None or not req.kv_cacheable:
            return
        length = end // self.allocator.page_size * self.allocator.page_size
        if length <= req.prefix_len:
            return
        tokens = req.fill_ids[:length]
        if self.cache.match_prefix(tokens).length != req.prefix_len:
            return
        following = req.fill_ids[length] if length < len(req.fill_ids) else next_token
        existing, node = self.cache.insert(tokens, self.req_to_token_pool.table[req.req_pool_idx, :length].cpu(),
                                           following)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.prefix_len = node, length

    def load(self) -> dict:
        """SGLang's load report (what its router's load-aware policies poll), on the scheduler thread: the requests
        held (running, being prefilled in chunks, and waiting: submitted and not started, or retracted to wait
        again), those waiting, and the KV tokens (and pages) requests hold; the prefix cache's evictable slots are
        free for the taking and not counted."""
        waiting = self.num_queued + sum(1 for r in self.waiting if r.started)
        held = len(self.running) + (self.chunked_req is not None) + waiting
        evictable = self.cache.evictable_tokens if self.cache is not None else 0
        tokens = self.allocator.size - self.allocator.num_free_slots - evictable
        page = self.allocator.page_size
        return {"dp_rank": 0, "num_reqs": held, "num_waiting_reqs": waiting, "num_tokens": tokens,
                "num_pages": -(-tokens // page)}

    def cache_info(self) -> dict:
        if self.cache is None:
            return {"enabled": False}
        return {"enabled": True, **self.cache.info()}

    def flush_cache(self) -> int:
        """Evict every cached prefix no request holds; returns the slots freed."""
        return 0 if self.cache is None else self.cache.flush()

    def _reserve(self, req: Req, new_len: int) -> None:
        """Make sure positions [0, new_len) of ``req`` have KV slots (the allocator raises if it cannot)."""
        start = req.kv_allocated_len
        if new_len <= start:
            return
        host = self.req_to_token_pool.host
        if host is not None:  # a CPU table through its numpy view: no torch op on a decode step
            row = host[req.req_pool_idx]
            row[start:new_len] = self.allocator.extend_list(int(row[start - 1]) if start else 0, start, new_len)
        else:
            row = self.req_to_token_pool.table[req.req_pool_idx]
            row[start:new_len] = self.allocator.extend(row, start, new_len)
        req.kv_allocated_len = new_len

    def _prepare_decode(self, exact: bool):
        """Every running request needs a slot for one more position; retract the newest requests
        (free their KV, requeue them to re-prefill later) until the rest fit: a prompt still being
        prefilled in chunks first (the newest, and it holds its whole prompt's KV while the running
        requests grow between its chunks; its chunks stay in the cache), then the running ones. A
        request is refused for the pool's size only when it is left alone. Retraction decides on
        the exact state: without it (``exact`` False), ``SETTLE_FIRST``. A request left alone whose tree and the
        drafter's scratch do not fit verifies its root alone this iteration (``Req.root_only``) rather than end: it
        needs what a plain step needs, and decodes on where plain decoding would."""
        for req in self.running:
            req.root_only = False
        while self.running:
            need = sum(self.allocator.slots_needed(r.kv_allocated_len, self._decode_len(r)) for r in self.running)
            if self.spec is not None and not all(r.root_only for r in self.running):
                # the drafter borrows scratch slots for the tree nodes
                # While a request runs alone (Req.runs_alone) the batch is that one, which may draft alone.
                alone = any(r.runs_alone for r in self.running)
                need += self.spec.scratch_slots(1 if alone else len(self.running))
            if self._make_room(need):  # cached prefixes go before any request is retracted
                break
            if not exact:  # the batch in flight may finish requests and free enough
                return SETTLE_FIRST
            if self.chunked_req is not None:
                self._retract(self.chunked_req)
                continue
            if len(self.running) == 1:
                req = self.running[0]
                if req.drafts and not req.root_only:
                    req.root_only = True
                    continue
                self._finish(req, abort_reason(KV_POOL_EXHAUSTED, f"KV pool exhausted: the request needs more than "
                                                                  f"the pool's {self.allocator.size} slots"))
                return []
            self._retract(self.running[-1])
        for req in self.running:
            self._reserve(req, self._decode_len(req))
        return list(self.running)

    def _decode_len(self, req: Req) -> int:
        """Positions that must have KV slots before this request's next decode iteration: one more,
        or a whole draft tree's worth with speculation, plus as much for each launched iteration the
        host has not processed yet (capped by the context length)."""
        # Never past what its output can reach: a tree is cut to the tokens the request has left (Speculator's
        # tree_budget), so a reservation beyond them near the end of a reply would only take slots it never writes.
        return min(req.kv_committed_len + self._ahead(req.drafts and not req.root_only) * (1 + req.inflight),
                   self.config.context_len, len(req.input_ids) + req.sampling.max_new_tokens)

    def _may_draft(self, prediction, constrained: bool) -> bool:
        """Whether a request with this prediction (or None), under a grammar or not, may get a draft tree beyond
        its root: with speculation, and on an engine without ``speculative_algorithm`` when it brings a prediction
        or decodes under a grammar (its decode batches are then speculative)."""
        return self.spec is not None and self.spec.drafts_for(prediction, constrained)

    def _ahead(self, drafts: bool) -> int:
        """Positions one decode iteration may write for a request: a draft tree's where it drafts, or one."""
        return self.spec.max_nodes if drafts else 1

    def _retract(self, req: Req) -> None:
        """Free ``req``'s KV (its committed prefix stays in the cache, where its re-prefill finds it)
        and requeue it first."""
        self.stats["retractions"] += 1
        req.retract_count += 1
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self._release_kv(req)
        self.waiting.insert(0, req)

    def slots_to_start(self, num_prompt_tokens: int, prediction=None, constrained: bool = False) -> int:
        """KV slots a request of this prompt length (with ``prediction``, or None, and under a grammar or not)
        needs to run at all, alone in the pool: its prompt and one iteration's growth (a draft tree where it may
        draft) plus the drafter's scratch. A prompt that needs more than the pool could never be admitted."""
        ahead = self._ahead(self._may_draft(prediction, constrained))
        scratch = self.spec.scratch_slots(1) if self.spec is not None else 0
        return self.allocator.slots_needed(0, min(num_prompt_tokens + ahead, self.config.context_len)) + scratch

    def _release(self, req: Req) -> None:
        """Give back a finished request's KV once no launched batch uses it; its compute state is handed over at
        once, to be dropped with the next launched batch. That is safe while batches holding the request are in
        flight (the compute side runs batches in launch order, so they are done by then), and it has to be: its
        rid is free from now on, and a new request of the same rid starts its compute state in a later batch,
        which must not come before this drop."""
        if not req.state_handed_over:
            req.state_handed_over = True
            self._released_rids.append(req.rid)
        if req.inflight > 0:
            if req not in self.release_pending:
                self.release_pending.append(req)
            return
        if req in self.release_pending:
            self.release_pending.remove(req)
        self._release_kv(req)

    def _release_kv(self, req: Req) -> None:
        """Give back the request's row and KV. With the cache, its committed tokens (page-aligned)
        go into the tree first: the tree takes the slots it did not have, the request's copies of
        what it had are freed with the rest."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.table[req.req_pool_idx]
        own_from = req.prefix_len
        if self.cache is not None and req.kv_cacheable:
            p = self.allocator.page_size
            length = min(req.kv_committed_len, len(req.fill_ids)) // p * p
            if length > req.prefix_len:
                fill = req.fill_ids
                following = fill[length] if length < len(fill) else None
                existing, _ = self.cache.insert(fill[:length], row[:length].cpu(), following)
                self.allocator.free_request(row, existing, start=req.prefix_len)  # duplicates of cached pages
                own_from = length
        self.allocator.free_request(row, req.kv_allocated_len, start=own_from)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.cache_node = None, None
        req.kv_committed_len = req.kv_allocated_len = req.prefix_len = 0

    # ---------------------------------------------------------------- launching a batch
    def start_batch(self, batch: ScheduledBatch) -> WorkerBatch | None:
        """The host's side of launching ``batch``: a prefill's KV is committed at once (nothing can
        reject it, and the next batch's reservation starts from it) and its requests join the
        running batch; every request counts one more batch in flight. Returns what the worker
        gets: a ``ReqInput`` per request (a speculative batch: with a fork of its grammar), or None
        when no request is left to launch (a request whose grammar could not be forked ends alone
        and leaves the batch)."""
        spec_decode = batch.kind is BatchKind.DECODE and batch.speculative
        forks = {}
        if spec_decode:
            for req in [r for r in batch.reqs if r.grammar is not None]:
                try:
                    forks[req.rid] = req.grammar.fork()
                except Exception as exc:
                    self._fail_request(req, "forking its grammar for drafting", exc)
            if any(r.finished for r in batch.reqs):
                kept = [i for i, r in enumerate(batch.reqs) if not r.finished]
                batch.reqs, batch.drafting = [batch.reqs[i] for i in kept], tuple(batch.drafting[i] for i in kept)
                if not batch.reqs:
                    return None
                # Speculative only while one of the others drafts: KV was reserved for a tree only where one may be
                # drawn (a lone free-text request left behind would otherwise draft alone in a one-slot reservation).
                batch.speculative = spec_decode = any(batch.drafting)
        inputs = []
        for req in batch.reqs:
            if batch.kind is BatchKind.PREFILL:
                inputs.append(ReqInput(req.rid, req.req_pool_idx, req.sampling, req.coin_key,
                                       prefill_ids=req.fill_ids, prompt_len=len(req.input_ids),
                                       cached_len=req.kv_committed_len, prefill_end=req.prefill_end))
                req.kv_committed_len = req.prefill_end
                batch.prefill_ends.append(req.prefill_end)
            elif spec_decode and req.grammar is not None:
                inputs.append(ReqInput(req.rid, req.req_pool_idx, req.sampling, req.coin_key,
                                       grammar=forks[req.rid], grammar_len=len(req.output_ids), root_only=req.root_only))
            else:
                inputs.append(ReqInput(req.rid, req.req_pool_idx, req.sampling, req.coin_key,
                                       constrained=req.grammar is not None, root_only=spec_decode and req.root_only))
            req.inflight += 1
        batch.launched_at = [req.retract_count for req in batch.reqs]
        if batch.kind is BatchKind.PREFILL:
            for req in batch.reqs:
                if req.prefill_end == len(req.fill_ids):  # its last chunk: it runs from now on
                    self.running.append(req)
                    if req is self.chunked_req:
                        self.chunked_req = None
                else:
                    self.chunked_req = req
        return WorkerBatch(batch.kind, inputs, self.take_released())

    def take_released(self) -> tuple[str, ...]:
        """The requests ended since the last hand-over, handed over now: the compute side drops their state
        (normally with the next batch; an idle loop hands them over itself, event_loops.py)."""
        released, self._released_rids = tuple(self._released_rids), []
        return released

    # ---------------------------------------------------------------- host side of a batch
    def grammar_mask(self, reqs: list[Req]):
        """(bitmask, rows) for the constrained requests of a plain batch, from the host's grammar
        state (which must include every token before this batch's), or None."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        bitmask = empty_token_bitmask(len(reqs), self.vocab_size)  # only the rows filled below are read
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
    def batch_done(self, batch: ScheduledBatch, new_tokens: list[list[int]] | None, error: Exception | None,
                   retry: bool = False) -> None:
        """A launched batch's outcome: its new tokens per request, or the compute side's ``error``.
        A failed batch cannot say whose data failed it: its requests go back to the waiting queue, each
        to be re-run from the host's state in batches of its own until one of its decode batches
        succeeds (``Req.runs_alone``). A request whose batches of its own fail ``MAX_SOLO_FAILURES``
        times in a row ends with the error: a fault that one request causes ends that one alone, and a
        passing fault ends none. With ``retry`` (it read the state of a batch that had failed before
        it) its requests go back without counting a failure. Releases what finished requests held once
        no launched batch uses it."""
        self.stats["batches_done"] += 1  # whatever its outcome, the compute side came back with it
        for req in batch.reqs:
            req.inflight -= 1
            if error is not None:  # its KV may be half written: none of it goes into the cache
                req.kv_cacheable = False
        if error is None:
            self._process_batch_result(batch, new_tokens)
        elif retry:
            self.stats["batch_retries"] += 1
            for req in batch.reqs:
                self._requeue(req)
        else:
            self.stats["batch_failures"] += 1
            for req in batch.reqs:
                if len(batch.reqs) == 1:
                    req.solo_failures += 1
                    if req.solo_failures >= MAX_SOLO_FAILURES:
                        self._finish(req, abort_reason(INTERNAL_ERROR,
                                                       f"internal error in the {batch.kind.value} batch: {error!r}"))
                        continue
                if self._requeue(req):
                    req.runs_alone = True
                    self.stats["requests_isolated"] += 1
        for req in batch.reqs:
            if req.inflight == 0 and req in self.release_pending:
                self._release(req)

    def _requeue(self, req: Req) -> bool:
        """Send a request of a failed batch back to be re-prefilled from the host's state; False when it has
        ended, or is already waiting (a batch after the failed one held it too)."""
        if req.finished or not (req in self.running or req is self.chunked_req):
            return False
        self._retract(req)
        return True

    def _process_batch_result(self, batch: ScheduledBatch, new_tokens: list[list[int]]) -> None:
        now = time.perf_counter()
        for i, (req, tokens) in enumerate(zip(batch.reqs, new_tokens)):
            if req.finished or req.retract_count != batch.launched_at[i]:  # ended, or requeued since its launch
                continue
            if batch.kind is BatchKind.DECODE:  # it ran and nothing failed: back among the others
                req.runs_alone, req.solo_failures = False, 0
            try:
                if batch.kind is BatchKind.PREFILL:
                    for position, entry in getattr(tokens, "inputs", {}).items():  # prompt logprobs
                        req.input_logprobs.setdefault(position, entry)
                    self._cache_prompt(req, batch.prefill_ends[i], tokens[0] if tokens else None)
                    if batch.prefill_ends[i] < len(req.fill_ids):  # a chunk: no token yet
                        continue
                self._commit_tokens(req, batch.kind, tokens, now, batch.speculative and batch.drafting[i])
            except Exception as exc:  # this request's host work failed: it alone ends
                self._fail_request(req, "processing its output", exc)

    def _commit_tokens(self, req: Req, kind: BatchKind, tokens: list[int], now: float,
                       speculative: bool = False) -> None:
        """Append one request's new tokens (grammar, stop checks, detokenizing), then finish or stream."""
        if kind is BatchKind.DECODE:  # plain: the input token; speculation: root + accepted nodes
            if not tokens:  # a speculative iteration that had no room for this request (it is ending)
                return
            req.kv_committed_len += len(tokens)
            if speculative:
                self._count_verify(req, len(tokens))
        if req.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        if req.first_token_at is None:
            req.first_token_at = now
        reason = None
        logged = req.sampling.return_logprob
        for k, token in enumerate(tokens):  # a finishing token cuts the accepted run: later ones are dropped
            req.output_ids.append(token)
            if logged:  # every path hands a logprob-asking request's tokens on as LoggedTokens
                req.output_logprobs.append(tokens.logprobs[k])
                req.output_top_logprobs.append(tokens.tops[k])
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
        self._finish(req, abort_reason(INTERNAL_ERROR, f"internal error while {doing}: {exc!r}"))

    def _count_verify(self, req: Req, num_tokens: int) -> None:
        req.spec_verify_ct += 1
        req.spec_accept_hist[num_tokens] = req.spec_accept_hist.get(num_tokens, 0) + 1
        self.stats["spec_verify_ct"] += 1
        self.stats["spec_accepted_tokens"] += num_tokens

    def _check_finished(self, req: Req, token: int) -> dict | None:
        sp = req.sampling
        if req.grammar is not None:
            started = grammar_clock()
            if not req.grammar.accept_token(token):
                # A token the grammar refused is no part of the output (under the mask only an empty mask lets
                # one be sampled), so a request refused at its first token has written nothing.
                del req.output_ids[-1]
                if len(req.output_logprobs) > len(req.output_ids):
                    del req.output_logprobs[-1], req.output_top_logprobs[-1]
                if not req.grammar.is_terminated() and not req.grammar.allows_a_token():
                    return abort_reason(GRAMMAR_REFUSED, "the grammar allows no token after the text so far "
                                                         "(it matches no text from here)")
                # The mask allowed a token its matcher then refused: the engine's inconsistency, not the grammar's.
                return abort_reason(INTERNAL_ERROR, f"internal error: the grammar rejected token {token}, which its "
                                                    f"mask allowed")
            if req.grammar.is_terminated():  # its text is made at the finish (the stop token left out)
                return {"type": "stop", "matched": token}
            spent, limit = grammar_clock() - started, self.config.grammar_token_timeout
            req.grammar_slow_streak = req.grammar_slow_streak + 1 if limit is not None and spent > limit else 0
            if req.grammar_slow_streak >= GRAMMAR_SLOW_STREAK:
                update_text(req, self.tokenizer)
                return abort_reason(GRAMMAR_REFUSED, f"the grammar took more than grammar_token_timeout "
                                                     f"({limit * 1e3:.0f} ms) to match each of {GRAMMAR_SLOW_STREAK} "
                                                     f"tokens in a row (the last: {spent * 1e3:.0f} ms): it is too "
                                                     f"ambiguous to decode under (each token costs more than the "
                                                     f"last)")
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            # A stop token is checked before stop strings, as in SGLang: the text (made at the finish, the token
            # left out) is not cut at a stop string this token's text would complete.
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

    def _json_text(self, req: Req, reason: dict) -> str:
        """The text a json_schema request's object is: its output text without the special token (EOS) that
        ended it, which the text spells where no_stop_trim keeps it and skip_special_tokens is False (a stop id of
        an ordinary token is text there, and stays)."""
        matched, text = reason.get("matched"), req.text
        if (isinstance(matched, int) and req.sampling.no_stop_trim and not req.sampling.skip_special_tokens
                and matched in skipped_ids(self.tokenizer)):
            try:
                return text.removesuffix(self.tokenizer.decode([matched], skip_special_tokens=False))
            except Exception:  # noqa: BLE001 (_finish never raises: the text is checked as it is)
                pass
        return text

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
                # (the tokens' bytes tell a character cut in half at the end from a whole U+FFFD)
                backend = self.grammar_backend
                update_text(req, self.tokenizer, backend.token_bytes() if backend is not None else None)
        except Exception as exc:
            logger.error("request %s: detokenizing its output failed: %r", req.rid, exc)
        if reason["type"] == "stop" and req.sampling.json_schema is not None:
            req.output_check = check_json_output(req.sampling.json_schema, self._json_text(req, reason))
            if req.output_check.valid is False:  # the caller must not take it for a valid object
                reason["message"] = req.output_check.message
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        try:
            self._release(req)
        except Exception:
            logger.error("request %s: releasing its KV failed: %s", req.rid, traceback.format_exc())
        # The grammar future is left alone: the compile cache shares it with every request of the
        # same grammar (the backend hands each caller its own handle).
        self._count_started(req)  # an end before its start leaves the queue too
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
        """free + owned by requests + held by the prefix cache == pool size, every page owned once,
        and the cache's own consistency; callable between iterations (tests call it after each
        workload)."""
        table = self.req_to_token_pool.table
        live = self._live() + self.release_pending
        owned = {r.rid: table[r.req_pool_idx, r.prefix_len:r.kv_allocated_len] for r in live
                 if r.req_pool_idx is not None}
        if self.cache is not None:
            self.cache.check([r.cache_node for r in live if r.cache_node is not None])
            owned.update(self.cache.owned_slots())
        check_kv_invariant(self.allocator, owned)
        live_rows = sum(1 for r in live if r.req_pool_idx is not None)
        if live_rows + self.req_to_token_pool.available != self.req_to_token_pool.num_rows:
            raise AssertionError("a ReqToTokenPool row leaked")
