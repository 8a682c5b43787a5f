"""The public Engine: load a model, start the scheduler thread, generate (sync, async, streaming)."""
from __future__ import annotations

import logging
import math
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from specjet.engine.args import EngineArgs
from specjet.scheduler.request import Req
from specjet.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("specjet")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dispatch_async_outputs(outbox: queue.SimpleQueue) -> None:
    """Hands outputs to event loops from a thread of its own, so the scheduler never waits on one."""
    while True:
        token, send, item = outbox.get()
        if token is None:
            return
        try:
            anyio.from_thread.run_sync(send.send_nowait, item, token=token)
        except Exception:  # the caller went away (loop closed, stream closed): drop it
            pass


class Engine:
    """``Engine(model_path=None, **args)``; see ``EngineArgs`` for the arguments (SGLang's names)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.args = EngineArgs.from_kwargs(model_path=model_path, **kwargs)
        logging.getLogger("specjet").setLevel(self.args.log_level.upper())
        from specjet.engine.loading import load_components

        self.tokenizer, self.scheduler = load_components(self.args, _resolve_device(self.args.device))
        self._async_outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self.scheduler.event_loop, name="specjet-scheduler", daemon=True)
        self._thread.start()
        # The thread gets the queue, not the engine: a thread holding the last reference to the engine
        # would free its tensors off the main thread, which aborts if that happens at interpreter exit.
        self._dispatcher = threading.Thread(target=_dispatch_async_outputs, args=(self._async_outbox,),
                                            name="specjet-async-out", daemon=True)
        self._dispatcher.start()

    # ---------------------------------------------------------------- request construction
    def _make_requests(self, prompt, sampling_params, input_ids, rid) -> tuple[list[Req], bool]:
        """Validate and tokenize everything before anything is submitted, so a bad item in a list
        raises without leaving half the list running."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise TypeError("prompt must be a string or a list of strings")
            id_lists = [self.tokenizer(p)["input_ids"] for p in prompts]
        else:
            single = len(input_ids) == 0 or isinstance(input_ids[0], int)
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        n = len(id_lists)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in range(n)]
        rids = [rid] if isinstance(rid, str) else (list(rid) if rid is not None else [uuid.uuid4().hex for _ in range(n)])
        if len(rids) != n:
            raise ValueError(f"{len(rids)} rids for {n} prompts")
        vocab = self.scheduler.vocab_size
        ctx = self.scheduler.config.context_len
        pool = self.scheduler.allocator.size
        for ids in id_lists:
            if not ids:
                raise ValueError("empty prompt: at least one input token is needed")
            if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"input_ids must be ints in [0, {vocab})")
            if len(ids) >= ctx:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the context length {ctx}")
            if self.scheduler.allocator.slots_needed(0, len(ids) + 1) > pool:
                raise ValueError(f"prompt of {len(ids)} tokens needs more KV slots than the pool holds ({pool})")
        reqs = [Req(rid=r, input_ids=ids, sampling=sp) for r, ids, sp in zip(rids, id_lists, params)]
        return reqs, single

    # ---------------------------------------------------------------- sync API
    def generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, rid=None):
        """One prompt (or token-id list) -> a dict; a list -> a list in the same order.
        ``stream=True`` returns an iterator of increments: each chunk's ``text`` and ``output_ids``
        are what is new since the previous chunk; the last chunk carries ``finish_reason``. With a
        list of prompts each chunk also has ``index``."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, rid)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        for i, req in enumerate(reqs):
            req.stream = stream
            req.sink = (lambda item, i=i: outbox.put((i, item)))
            self.scheduler.submit(req)
        if stream:
            return self._stream(outbox, reqs, single)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in reqs:
                i, item = outbox.get()
                results[i] = item
        except BaseException:  # e.g. KeyboardInterrupt: do not leave the requests running
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        return results[0] if single else results

    def _stream(self, outbox, reqs, single) -> Iterator[dict]:
        remaining = len(reqs)
        try:
            while remaining:
                i, chunk = outbox.get()
                if chunk["meta_info"]["finish_reason"] is not None:
                    remaining -= 1
                if not single:
                    chunk["index"] = i
                yield chunk
        finally:
            if remaining:
                for req in reqs:
                    self.scheduler.abort(req.rid)

    # ---------------------------------------------------------------- async API
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, rid=None):
        """Like ``generate``; ``stream=True`` returns an async iterator. Safe from many tasks at once."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, rid)
        send, recv = anyio.create_memory_object_stream(math.inf)
        token = anyio.lowlevel.current_token()
        for i, req in enumerate(reqs):
            req.stream = stream
            req.sink = (lambda item, i=i: self._async_outbox.put((token, send, (i, item))))
            self.scheduler.submit(req)
        if stream:
            return self._astream(recv, reqs, single)
        results: list[dict | None] = [None] * len(reqs)
        try:
            async with recv:
                for _ in reqs:
                    i, item = await recv.receive()
                    results[i] = item
        except BaseException:  # cancelled: stop the work we asked for
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        return results[0] if single else results

    async def _astream(self, recv, reqs, single) -> AsyncIterator[dict]:
        remaining = len(reqs)
        try:
            async with recv:
                while remaining:
                    i, chunk = await recv.receive()
                    if chunk["meta_info"]["finish_reason"] is not None:
                        remaining -= 1
                    if not single:
                        chunk["index"] = i
                    yield chunk
        finally:
            if remaining:
                for req in reqs:
                    self.scheduler.abort(req.rid)

    # ---------------------------------------------------------------- helpers
    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True, **kwargs) -> str:
        """The tokenizer's chat template as text; a bare string becomes one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def check_kv_invariant(self) -> None:
        """Raise AssertionError if a KV slot leaked (free + owned != pool size). Runs on the scheduler
        thread between two iterations, so it is exact even while requests are in flight."""
        self.scheduler.run_in_loop(self.scheduler.check_kv_invariant).result(timeout=60)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until no request is waiting or running (e.g. after aborts, which land asynchronously)."""
        import time

        deadline = time.monotonic() + timeout
        while self.scheduler.run_in_loop(self.scheduler.has_work).result(timeout=timeout):
            if time.monotonic() > deadline:
                raise TimeoutError("engine still busy")
            time.sleep(0.01)

    def get_server_info(self, reset_timings: bool = False) -> dict[str, Any]:
        """Counters, speculative totals and ``stats["overlap"]``: per decode iteration, the compute
        side's median time and how long it waited for the host (``reset_timings`` starts afresh)."""
        stats = dict(self.scheduler.stats)
        stats["overlap"] = self.scheduler.run_in_loop(
            lambda: self.scheduler.overlap_stats(reset=reset_timings)).result(timeout=60)
        if self.scheduler.spec is not None:
            stats.update(self.scheduler.spec.stats)
            if stats["spec_verify_ct"]:
                stats["spec_accept_length"] = stats["spec_accepted_tokens"] / stats["spec_verify_ct"]
        return {"args": self.args, "stats": stats,
                "kv_pool_size": self.scheduler.allocator.size, "kv_free": self.scheduler.allocator.num_free_slots}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.scheduler.stop()
        self._thread.join(timeout=30)
        self._async_outbox.put((None, None, None))
        self._dispatcher.join(timeout=30)
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
