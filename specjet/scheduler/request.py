"""A request as the scheduler sees it: its tokens, its KV bookkeeping, its grammar and its sink."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from specjet.scheduler.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    # Called on the scheduler thread with each output dict (and the final one); must not block.
    sink: Callable[[dict[str, Any]], None] | None = None

    output_ids: list[int] = field(default_factory=list)
    # With sampling.return_logprob: per output token its logprob and top alternatives [(logprob, id)]
    # (specjet.kernels.logprobs), as long as output_ids.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # With sampling.logprob_start_len >= 0: prompt position -> (its token's logprob, top alternatives), from
    # the prefill (its first: a re-prefill after a retraction adds nothing).
    input_logprobs: dict[int, tuple[float, list[tuple[float, int]]]] = field(default_factory=dict)
    # KV bookkeeping (see memory_pool): positions with valid KV, and positions with a slot reserved.
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # Prefix cache (radix_cache.py): positions [0, prefix_len) of the row are the tree's slots, the
    # request's own are [prefix_len, kv_allocated_len); cache_node is the tree node it holds (locks).
    prefix_len: int = 0
    cache_node: Any = None
    cached_tokens: int = 0  # prompt tokens its first prefill took from the cache (meta_info)
    # False once a failed batch may have left its committed KV wrong: it is then not cached.
    kv_cacheable: bool = True
    # Prefill: the end of the positions the next prefill batch computes (a chunk's end, or the
    # whole of fill_ids).
    prefill_end: int = 0

    grammar_future: Future | None = None
    grammar: Any = None  # specjet.grammar.RequestGrammar once compiled
    # A sampled request's coin key (kernels/coins.py: its token at position p is drawn with coin(key, p)); None
    # when greedy.
    coin_key: int | None = None

    finished_reason: dict[str, Any] | None = None
    # A json_schema request that finished with "stop": its output checked against the schema with
    # jsonschema (specjet.grammar.OutputCheck), since the grammar does not enforce every keyword.
    output_check: Any = None
    to_abort: bool = False
    retract_count: int = 0
    # A batch it shared failed on the compute side: it was requeued, and until one of its decode batches succeeds
    # (or it ends) it runs in batches of its own, so a failure its own data causes ends it alone
    # (Scheduler.batch_done).
    runs_alone: bool = False
    # Batches it ran in alone that failed since its last decode batch that succeeded: a fault that passes is
    # retried, one that follows it alone ends it (Scheduler.MAX_SOLO_FAILURES).
    solo_failures: int = 0
    # Admitted into a batch at least once: it no longer counts against max_queued_requests.
    started: bool = False
    text: str = ""  # detokenized output (stop strings cut it)
    sent_len: int = 0  # characters of text already streamed
    num_sent_ids: int = 0  # output ids already streamed
    # Incremental detokenization (scheduler/detokenizer.py, as SGLang's detokenizer): `text` is final
    # text only; a step decodes just the window detok_ids (recent output ids less skipped special
    # tokens: detok_surr_len of context whose decode is detok_surr_text, then ids whose text is not
    # final yet), so a token costs O(1). detok_seen: output ids taken in; detok_stop: the stop string
    # that cut `text`, once one has.
    detok_ids: list[int] = field(default_factory=list)
    detok_surr_len: int = 0
    detok_surr_text: str = ""
    detok_seen: int = 0
    detok_stop: str | None = None
    # Tokens in a row whose grammar match took longer than grammar_token_timeout (scheduler._check_finished).
    grammar_slow_streak: int = 0

    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    # Whether it may get a draft tree beyond its root (Scheduler._admit: with speculation; on an engine without
    # speculative_algorithm, when it brings a prediction or decodes under a grammar, or on a CPU when it may draft
    # alone). Only free text that drafts alone turns it off, for good (Scheduler._decode_batch).
    drafts: bool = False
    spec_verify_ct: int = 0  # verify forwards that served this request
    spec_accept_hist: dict[int, int] = field(default_factory=dict)  # tokens committed per verify -> count
    # Overlap loop: launched batches holding this request whose results the host has not processed;
    # a request that finishes meanwhile keeps its KV until they are processed
    # (Scheduler.release_pending).
    inflight: int = 0
    # Its compute-side state has been handed over to be dropped (Scheduler._release): once, at its end.
    state_handed_over: bool = False
    # This iteration it verifies its root alone: running alone, its tree and the drafter's scratch do not fit the
    # pool beside its KV (Scheduler._prepare_decode), where one more position does.
    root_only: bool = False

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV a (re)prefill must compute: the prompt and what was generated so far."""
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
