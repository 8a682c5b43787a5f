"""The public Engine: load a model, start the scheduler thread, generate (sync, async, streaming)."""
from __future__ import annotations

import logging
import math
import queue
import threading
import uuid
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from specjet.engine.args import EngineArgs, resolve_device
from specjet.engine.async_outputs import STOPPED, AsyncOutputs
from specjet.engine.choices import choice_params, choice_rids, parallel_samples
from specjet.engine.streams import AsyncStream, SyncStream
from specjet.kernels.openmp_teams import release_calling_thread_team
from specjet.scheduler.request import Req
from specjet.scheduler.sampling_params import SamplingParams, check_unicode
from specjet.spec_v2.config import HYBRID_ALGORITHMS

logger = logging.getLogger("specjet")


def _show_logs(level: str) -> None:
    """The "specjet" logger at ``level``, and where no handler would show its records (Python's last resort shows
    warnings only: log_level="info" printed nothing), a stderr handler of its own, added once. An application that
    configures logging (a root handler, or one on "specjet") keeps its own."""
    specjet_logger = logging.getLogger("specjet")
    specjet_logger.setLevel(level.upper())
    if not specjet_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        specjet_logger.addHandler(handler)


# How often a sync caller waiting for output (and the async callers' one watcher, engine/async_outputs.py)
# checks that the scheduler thread still lives.
_LIVENESS_POLL_S = 1.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id_lists(input_ids) -> tuple[list[list[int]], bool]:
    """``input_ids`` as a list of token-id lists, and whether it was a single list."""
    if not isinstance(input_ids, (list, tuple)):
        raise TypeError(f"input_ids must be a list of ints or a list of such lists, got {type(input_ids).__name__}")
    single = len(input_ids) == 0 or not isinstance(input_ids[0], (list, tuple))
    if single:
        return [list(input_ids)], True
    if not all(isinstance(x, (list, tuple)) for x in input_ids):
        raise TypeError("input_ids must be a list of ints or a list of such lists, not a mix")
    return [list(x) for x in input_ids], False


def _request_ids(rid, n: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    rids = [rid] if isinstance(rid, str) else rid
    if not isinstance(rids, (list, tuple)) or not all(isinstance(r, str) for r in rids):
        raise TypeError(f"rid must be a string or a list of strings, got {type(rid).__name__}")
    if len(rids) != n:
        raise ValueError(f"{len(rids)} rids for {n} prompts")
    return list(rids)


class Engine:
    """``Engine(model_path=None, **args)``; see ``EngineArgs`` for the arguments (SGLang's names)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.args = EngineArgs.from_kwargs(model_path=model_path, **kwargs)
        _show_logs(self.args.log_level)
        from specjet.engine.loading import load_components

        parts = load_components(self.args, resolve_device(self.args.device))
        # Loading opened an OpenMP team on this thread; with it alive, libgomp stops its workers
        # spinning between the compute thread's parallel regions (kernels/openmp_teams.py).
        release_calling_thread_team()
        # scheduler: requests, KV and results (host side); worker: forwards, sampling, speculation
        # (compute side); loop: drives both on the scheduler thread.
        self.tokenizer, self.scheduler, self.worker, self.loop = parts.tokenizer, parts.scheduler, parts.worker, parts.loop
        self._warned_prediction = False
        self._max_token_chars: int | None = None  # the vocabulary's longest token, found when first needed
        self._closed = False
        self._thread = threading.Thread(target=self.loop.run, name="specjet-scheduler", daemon=True)
        self._thread.start()
        self._async_outputs = AsyncOutputs(self._thread.is_alive, _LIVENESS_POLL_S)

    # ---------------------------------------------------------------- request construction
    def _tokens_at_least(self, text: str) -> int | None:
        """For a text surely longer than the context, a lower bound on its tokens (else None), found without
        tokenizing it: no token spells more characters than the vocabulary's longest. Tokenizing tens of
        megabytes takes the tokenizer seconds and gigabytes, enough for one request to have the host kill the engine
        (bench/RESULTS.md, session 104)."""
        ctx = self.scheduler.config.context_len
        if len(text) <= ctx:  # every token spells at least one character
            return None
        if self._max_token_chars is None:
            longest = max(map(len, self.scheduler.grammar_backend.token_bytes()), default=1)  # bytes >= characters
            self._max_token_chars = max([longest, 1, *map(len, self.tokenizer.get_added_vocab())])
        return -(-len(text) // self._max_token_chars) if len(text) > ctx * self._max_token_chars else None

    def _check_prediction(self, prediction: str | list[int]) -> None:
        """A prediction longer than any reply could be is a mistake; one the engine cannot draft from is not
        an error (it changes no output), but worth a line in the log."""
        ctx = self.scheduler.config.context_len
        n = len(prediction) if not isinstance(prediction, str) else (
            self._tokens_at_least(prediction) or len(self.tokenizer(prediction, add_special_tokens=False)["input_ids"]))
        if n > ctx:
            raise ValueError(f"prediction of {n} tokens is longer than the context length {ctx}")
        speculator = self.worker.speculator
        if not self._warned_prediction and (speculator is None or not speculator.drafts_ngrams):
            self._warned_prediction = True
            logger.warning("a request brought a prediction, which this engine does not draft from: predictions "
                           "draft without speculative_algorithm (unless disable_guided_drafting or "
                           "enable_deterministic_inference=False), with NGRAM, and in EAGLE / DFLASH's n-gram path")

    def _make_requests(self, prompt, sampling_params, input_ids, rid, return_logprob=None,
                       top_logprobs_num=None, stream=False) -> tuple[list[Req], bool]:
        """Validate and tokenize everything before anything is submitted, so a bad item in a list
        raises without leaving half the list running. ``return_logprob`` / ``top_logprobs_num`` (SGLang's
        arguments; a value, or one per prompt) set the sampling parameters of the same names where given."""
        self._check_running()
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__} {stream!r}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and not isinstance(prompt, (list, tuple)):
                raise TypeError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise TypeError("prompt must be a string or a list of strings")
            for i, p in enumerate(prompts):
                check_unicode("prompt" if single else f"prompt {i}", p)
                at_least = self._tokens_at_least(p)
                if at_least is not None:
                    raise ValueError(f"prompt of at least {at_least} tokens ({len(p)} characters) does not fit the "
                                     f"context length {self.scheduler.config.context_len}")
            id_lists = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        else:
            id_lists, single = _token_id_lists(input_ids)
        n = len(id_lists)
        if n == 0:
            raise ValueError("no prompts given")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            dicts = list(sampling_params)
        else:
            dicts = [sampling_params] * n
        # The arguments, where given, override the sampling parameters of the same names (before their checks,
        # which pair them: top_logprobs_num and logprob_start_len need return_logprob).
        for name, value in (("return_logprob", return_logprob), ("top_logprobs_num", top_logprobs_num)):
            if value is None:
                continue
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise ValueError(f"{len(values)} {name} values for {n} prompts")
            # (a value that is not a dict is left for from_dict to refuse)
            dicts = [dict(d or {}, **{name: v}) if d is None or isinstance(d, dict) else d for d, v in zip(dicts, values)]
        choices = parallel_samples(dicts)
        if any(isinstance(d, dict) and "n" in d for d in dicts):  # SGLang's n: each choice a request (n gone)
            rid = choice_rids(rid, n, choices)
            id_lists = [ids for ids in id_lists for _ in range(choices)]
            dicts = [c for d in dicts for c in (choice_params(d, choices) if isinstance(d, dict) else [d] * choices)]
            single = single and choices == 1
            n = len(id_lists)
        params = [SamplingParams.from_dict(d) for d in dicts]
        for sp in params:
            if sp.prediction is not None:
                self._check_prediction(sp.prediction)
            sp.check_token_ids(self.scheduler.vocab_size, self.scheduler.eos_token_ids)
            key = sp.grammar_key
            if key is not None:  # what is known without compiling: bad JSON, too big, too deep, a regex or EBNF
                # that does not parse, a spec whose compile timed out before
                self.scheduler.grammar_backend.check_spec(*key)
        rids = _request_ids(rid, n)
        vocab = self.scheduler.vocab_size
        ctx = self.scheduler.config.context_len
        pool = self.scheduler.allocator.size
        # Only a number the caller gave is held to the context (SGLang's check); the default's reply stops there.
        asked = [isinstance(d, dict) and d.get("max_new_tokens") is not None for d in dicts]
        for ids, sp, given in zip(id_lists, params, asked):
            if not ids:
                raise ValueError("empty prompt: at least one input token is needed")
            if any((not _is_int(t)) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"input_ids must be ints in [0, {vocab})")
            if len(ids) >= ctx:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the context length {ctx}")
            if sp.max_new_tokens is None:  # as many as the context leaves
                sp.max_new_tokens = ctx - len(ids)
            elif given and len(ids) + sp.max_new_tokens > ctx:  # SGLang's and vLLM's refusal, not a cut reply
                raise ValueError(f"prompt of {len(ids)} tokens and max_new_tokens {sp.max_new_tokens} exceed the "
                                 f"context length {ctx}: at most {ctx - len(ids)} new tokens fit")
            need = self.scheduler.slots_to_start(len(ids), sp.prediction, sp.grammar_key is not None)
            if need > pool:
                raise ValueError(f"prompt of {len(ids)} tokens needs {need} KV slots to run (prompt, one "
                                 f"iteration's growth and the drafter's scratch), more than the pool holds ({pool})")
        reqs = [Req(rid=r, input_ids=ids, sampling=sp) for r, ids, sp in zip(rids, id_lists, params)]
        constrained = [req for req in reqs if req.sampling.grammar_key is not None]
        if constrained:  # last: a spec the compile refuses within the door's wait is the caller's error, as above
            futures = self.scheduler.grammar_backend.check_compiles([r.sampling.grammar_key for r in constrained])
            for req, future in zip(constrained, futures or ()):
                req.grammar_future = future  # the compile the door started is the request's (submit starts none)
        return reqs, single

    def _in_loop(self, fn, timeout: float = 60.0):
        """``fn()`` run on the scheduler thread between two iterations; RuntimeError at once if the
        thread is gone, TimeoutError if it does not get to it within ``timeout``."""
        import concurrent.futures
        import time

        future = self.scheduler.run_in_loop(fn)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=min(_LIVENESS_POLL_S, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    raise self._stopped_error() from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the scheduler did not answer within {timeout} s") from None

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if self.scheduler.closed_reason is not None or not self._thread.is_alive():
            raise self._stopped_error()

    def _stopped_error(self) -> RuntimeError:
        return RuntimeError(f"the engine is not running: "
                            f"{self.scheduler.closed_reason or 'its scheduler thread has stopped'}")

    def _wait(self, outbox: queue.SimpleQueue):
        """The next item of a sync caller's outbox; RuntimeError, not a wait for ever, if the
        scheduler thread is gone (it answers everything it holds when it stops; this covers a
        thread that could not)."""
        while True:
            try:
                return outbox.get(timeout=_LIVENESS_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    try:
                        return outbox.get_nowait()
                    except queue.Empty:
                        raise self._stopped_error() from None

    # ---------------------------------------------------------------- sync API
    def generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, rid=None,
                 return_logprob=None, top_logprobs_num=None):
        """One prompt (or token-id list) -> a dict; a list -> a list in the same order.
        ``stream=True`` returns an iterator of increments: each chunk's ``text`` and ``output_ids``
        are what is new since the previous chunk; the last chunk carries ``finish_reason``. With a
        list of prompts each chunk also has ``index``."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, rid, return_logprob, top_logprobs_num,
                                           stream)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        for i, req in enumerate(reqs):
            req.stream = stream
            req.sink = (lambda item, i=i: outbox.put((i, item)))
        self.scheduler.submit(reqs)
        if stream:
            return SyncStream(self, outbox, reqs, single)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in reqs:
                i, item = self._wait(outbox)
                results[i] = item
        except BaseException:  # e.g. KeyboardInterrupt: do not leave the requests running
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        return results[0] if single else results

    # ---------------------------------------------------------------- async API
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, rid=None,
                             return_logprob=None, top_logprobs_num=None):
        """Like ``generate``; ``stream=True`` returns an async iterator. Safe from many tasks at once."""
        # Validating and tokenizing (up to hundreds of thousands of characters a prompt) runs in a worker thread,
        # so the event loop, which serves every other caller's stream, never waits for it.
        reqs, single = await anyio.to_thread.run_sync(self._make_requests, prompt, sampling_params, input_ids, rid,
                                                      return_logprob, top_logprobs_num, stream)
        send, recv = anyio.create_memory_object_stream(math.inf)
        token = anyio.lowlevel.current_token()
        for i, req in enumerate(reqs):
            req.stream = stream
            req.sink = self._async_outputs.sink(token, send, i)
        self.scheduler.submit(reqs)
        # After the submit, so a refused one leaves nothing registered; a thread that dies in between
        # is seen at the watcher's next poll, which finds this caller waiting.
        self._async_outputs.waiting(send, token)
        if stream:
            return AsyncStream(self, send, recv, reqs, single)
        results: list[dict | None] = [None] * len(reqs)
        try:
            async with recv:
                for _ in reqs:
                    i, item = await self._async_wait(recv)
                    results[i] = item
        except BaseException:  # cancelled: stop the work we asked for
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        finally:
            self._async_outputs.done(send)
        return results[0] if single else results

    async def _async_wait(self, recv):
        """The next item for an async caller; RuntimeError if the scheduler thread is gone (it
        answers everything it holds when it stops; ``AsyncOutputs`` covers a thread that could not).
        The wait itself costs nothing: no caller wakes up to check the thread."""
        item = await recv.receive()
        if item is STOPPED:
            raise self._stopped_error()
        return item

    # ---------------------------------------------------------------- helpers
    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True, **kwargs) -> str:
        """The tokenizer's chat template as text; a bare string becomes one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the live request ``rid`` (SGLang's signature: ``abort_all=True`` aborts every live request); its
        caller gets what it had written, ``finish_reason`` an abort of ``err_type`` ``request_aborted``. A rid that
        is not live is no error (it may have just finished)."""
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise TypeError(f"abort_request takes a str rid and a bool abort_all, got {type(rid).__name__} and "
                            f"{type(abort_all).__name__}")
        self.scheduler.abort(None if abort_all else rid)

    def is_alive(self) -> bool:
        """True while the engine can serve requests (not shut down, scheduler thread running)."""
        return not self._closed and self.scheduler.closed_reason is None and self._thread.is_alive()

    def check_kv_invariant(self) -> None:
        """Raise AssertionError if a KV slot leaked (free + owned != pool size). Runs on the scheduler
        thread between two iterations, so it is exact even while requests are in flight."""
        self._in_loop(self.scheduler.check_kv_invariant)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until no request is waiting or running (e.g. after aborts, which land asynchronously)."""
        import time

        deadline = time.monotonic() + timeout
        while self._in_loop(self.scheduler.has_work, timeout):
            if time.monotonic() > deadline:
                raise TimeoutError("engine still busy")
            time.sleep(0.01)

    def get_server_info(self, reset_timings: bool = False) -> dict[str, Any]:
        """The dtype and quantization in effect (the EAGLE head's / DFlash draft's too), counters, speculative totals and ``stats["overlap"]``: per decode iteration, the compute
        side's median time and how long it waited for the host; with speculation ``stats["spec_phases"]``,
        the mean ms per iteration of its phases and the mean nodes of a request's verify tree (``tree_nodes``)
        (``reset_timings`` starts both afresh)."""
        stats = dict(self.scheduler.stats)
        try:
            stats["overlap"] = self._in_loop(lambda: self.loop.overlap_stats(reset=reset_timings))
            cache = self._in_loop(self.scheduler.cache_info)
        except RuntimeError:  # the loop has stopped: the health fields below say why
            stats["overlap"], cache = {"iterations": 0}, {"enabled": self.scheduler.cache is not None}
        if stats.get("spec_verify_ct"):
            stats["spec_accept_length"] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
        speculator = self.worker.speculator
        if speculator is not None:  # mean ms per speculative iteration of each phase (spec_v2/speculator.py)
            try:
                stats["spec_phases"] = self._in_loop(lambda: speculator.timings.summary(reset=reset_timings))
            except RuntimeError:
                stats["spec_phases"] = {"iterations": 0}
        runner = self.worker.runner
        draft_cfg = None  # the learned draft's configuration: the algorithm's, or free-text drafting's (DFLASH)
        if speculator is not None:
            draft_cfg = speculator.cfg if speculator.cfg.algorithm in HYBRID_ALGORITHMS else speculator.cfg.solo
        return {"args": self.args, "dtype": str(runner.dtype).removeprefix("torch."),  # what "auto" resolved to
                "quantization": runner.quantization,
                "draft_quantization": draft_cfg.draft_quantization if draft_cfg is not None else None,
                "stats": stats, "alive": self.is_alive(), "error": self.scheduler.closed_reason,
                "overlap_schedule": self.loop.overlap,  # the loop in effect (disable_overlap_schedule, resolved)
                "kv_pool_size": self.scheduler.allocator.size, "kv_free": self.scheduler.allocator.num_free_slots,
                "queued_requests": self.scheduler.num_queued,  # submitted, not yet started (max_queued_requests)
                "grammar": dict(self.scheduler.grammar_backend.compile_stats), "radix_cache": cache}

    def get_load(self) -> dict[str, int]:
        """SGLang's load report of this engine (``Scheduler.load``): requests held and waiting, KV tokens and
        pages requests hold."""
        return self._in_loop(self.scheduler.load)

    def flush_cache(self) -> int:
        """Empty the prefix cache of every prefix no running request holds (SGLang's name); returns
        the KV slots freed."""
        return self._in_loop(self.scheduler.flush_cache)

    def shutdown(self, message: str | None = None) -> None:
        """Stop the engine: every request it holds, running, waiting or still in its inbox, is
        answered with an abort (a 503's ``engine_not_alive``, saying ``message`` where one is given: a server's
        drain deadline), and later calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.stop(message)
        self._thread.join(timeout=30)
        self._async_outputs.close(timeout=30)
        self.scheduler.grammar_backend.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as the tokenizer gives them, its special tokens (a BOS) added, except where the text
    already starts with the BOS they would add: a chat template that writes ``{{ bos_token }}`` itself (Llama's,
    Mistral's) beside a tokenizer that adds one (theirs) gave every chat prompt two."""
    ids = tokenizer(text)["input_ids"]
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == bos_id and text.startswith(bos):
        return ids[1:]
    return ids
