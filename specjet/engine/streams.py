"""The iterators ``generate(..., stream=True)`` and ``async_generate(..., stream=True)`` return.

Each chunk is an increment (``text``/``output_ids`` new since the previous chunk); the last chunk
of a request carries ``finish_reason``; with several prompts each chunk has ``index``.

A caller that stops reading must not leave its requests running (holding KV slots) until they
reach ``max_new_tokens``: closing the iterator, breaking out of a ``for`` loop over it, cancelling
the task that reads it, or just dropping it unread all abort what has not finished. Plain
generator functions cannot do the last one (a generator that never started runs no ``finally``),
hence these small classes with ``close`` and ``__del__``.
"""
from __future__ import annotations

import queue
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specjet.engine.engine import Engine
    from specjet.scheduler.request import Req


class _StreamBase:
    def __init__(self, engine: "Engine", reqs: list["Req"], single: bool):
        self._engine = engine
        self._rids = [r.rid for r in reqs]
        self._single = single
        self._remaining = len(reqs)

    def _take(self, item: tuple[int, dict]) -> dict:
        i, chunk = item
        if chunk["meta_info"]["finish_reason"] is not None:
            self._remaining -= 1
        if not self._single:
            chunk["index"] = i
        return chunk

    def abort(self, index: int = 0) -> None:
        """Abort one request of the stream (the prompt at ``index``), the others going on: its last chunk,
        an abort, still comes (a finished request is left alone)."""
        self._engine.scheduler.abort(self._rids[index])

    def _abort_unfinished(self) -> None:
        if self._remaining:
            self._remaining = 0
            for rid in self._rids:  # aborting a finished rid is a no-op
                self._engine.scheduler.abort(rid)

    def __del__(self):
        try:
            self._abort_unfinished()
        except Exception:
            pass


class SyncStream(_StreamBase):
    def __init__(self, engine: "Engine", outbox: queue.SimpleQueue, reqs: list["Req"], single: bool):
        super().__init__(engine, reqs, single)
        self._outbox = outbox

    def __iter__(self) -> "SyncStream":
        return self

    def __next__(self) -> dict:
        if not self._remaining:
            raise StopIteration
        try:
            return self._take(self._engine._wait(self._outbox))
        except BaseException:  # e.g. KeyboardInterrupt, or the engine stopped
            self._abort_unfinished()
            raise

    def close(self) -> None:
        """Stop reading: abort the requests that have not finished."""
        self._abort_unfinished()

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream(_StreamBase):
    def __init__(self, engine: "Engine", send, recv, reqs: list["Req"], single: bool):
        super().__init__(engine, reqs, single)
        self._send, self._recv = send, recv

    def _stop_reading(self) -> None:
        self._recv.close()
        self._engine._async_outputs.done(self._send)

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> dict:
        if not self._remaining:
            self._stop_reading()
            raise StopAsyncIteration
        try:
            return self._take(await self._engine._async_wait(self._recv))
        except BaseException:  # cancelled, or the engine stopped
            self._abort_unfinished()
            self._stop_reading()
            raise

    def __del__(self):
        try:
            self._abort_unfinished()
            self._stop_reading()
        except Exception:
            pass

    async def aclose(self) -> None:
        """Stop reading: abort the requests that have not finished."""
        self._abort_unfinished()
        self._stop_reading()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
