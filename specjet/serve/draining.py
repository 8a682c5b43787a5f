"""uvicorn's server with a graceful shutdown that answers every request it ends.

On SIGTERM uvicorn stops listening and waits ``timeout_graceful_shutdown`` seconds for the responses in flight, then
cancels them: a client streaming a long reply had its connection cut without a word, and one waiting for a whole
reply got no response at all. Here the engine is shut down a little before that deadline (``answer_margin``), so each
request still running ends with the engine's abort, a 503 ``engine_not_alive`` saying why: a whole reply's caller
gets the 503, a stream's gets its error event and ``[DONE]``, and the connections close before uvicorn would cut
them. A client that stopped reading is still cut at the deadline (its answer cannot be written).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import uvicorn

logger = logging.getLogger(__name__)

# The share of the grace period kept for answering, at most MAX_ANSWER_MARGIN_S: the engine's loop ends at an
# iteration's end (a long prompt's prefill chunk can take a second or more on a CPU) and every handler then writes.
ANSWER_SHARE = 0.25
MAX_ANSWER_MARGIN_S = 5.0


def answer_margin(grace_s: float) -> float:
    """Seconds before the grace period's end at which the requests still running are ended and answered."""
    return min(MAX_ANSWER_MARGIN_S, grace_s * ANSWER_SHARE)


class AnsweringServer(uvicorn.Server):
    """``uvicorn.Server`` that calls ``stop_engine(message)`` ``answer_margin`` before its graceful shutdown's
    deadline when responses are still in flight then (nothing when they have all finished before)."""

    def __init__(self, config: uvicorn.Config, stop_engine: Callable[[str], None]):
        super().__init__(config)
        self.stop_engine = stop_engine

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        ender = None if grace is None else asyncio.create_task(self._end_requests_after(grace - answer_margin(grace)))
        try:
            await super().shutdown(sockets)
        finally:
            if ender is not None:
                ender.cancel()

    async def _end_requests_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.server_state.tasks and not self.server_state.connections:  # every response has finished
            return
        grace = self.config.timeout_graceful_shutdown
        logger.warning("graceful shutdown: requests still running %.1f s after the signal; ending them "
                       "(each is answered with a 503) before the %s s deadline", delay, grace)
        message = (f"the server is shutting down: the request was still running when its graceful shutdown "
                   f"({grace} s) ran out")
        # The engine's shutdown waits for its loop's thread: off the event loop, which writes the answers meanwhile.
        await asyncio.to_thread(self.stop_engine, message)
