"""The compute side's view of each running request, a step ahead of the host's.

With the overlap loop, iteration N+1 is launched before the host has processed iteration N: N+1's
forward needs N's sampled/accepted tokens and the new sequence lengths, which only the compute side
knows yet. They live here, in slots indexed by the request's row in the request-to-token pool,
written by N's compute work and read by N+1's (which runs after N: streams run work in order). The
host never waits for them; it gets N's results through N's future when it gets to them.

A ``ComputeView`` quacks like a ``Req`` for everything the batch builders and the speculative decoder
read (``output_ids``, ``fill_ids``, ``kv_committed_len`` come from the compute side; the rest from
the request, whose other fields do not change while it runs), so the same compute code serves the
plain loop (given the requests themselves) and the overlap loop (given views).
"""
from __future__ import annotations

from specjet.scheduler.request import Req

_OWN = ("req", "output_ids", "kv_committed_len")


class ComputeView:
    """What the compute side knows of one request: its tokens and committed length, possibly ahead
    of ``req``. Other attributes read and write through to the request (speculative counters)."""

    __slots__ = _OWN

    def __init__(self, req: Req):
        object.__setattr__(self, "req", req)
        object.__setattr__(self, "output_ids", list(req.output_ids))
        object.__setattr__(self, "kv_committed_len", req.kv_committed_len)

    @property
    def fill_ids(self) -> list[int]:
        return self.req.input_ids + self.output_ids

    def __getattr__(self, name):
        return getattr(self.req, name)

    def __setattr__(self, name, value):
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.req, name, value)


class FutureMap:
    """Slots by request-pool row: the compute side's ``ComputeView`` of the request in that row."""

    def __init__(self, num_rows: int):
        self._views: list[ComputeView | None] = [None] * num_rows

    def start(self, req: Req) -> ComputeView:
        """A (re)prefill starts the compute side's view from the host's state, which is exact then:
        nothing is in flight for a request that is being prefilled."""
        view = ComputeView(req)
        self._views[req.req_pool_idx] = view
        return view

    def view(self, req: Req) -> ComputeView:
        view = self._views[req.req_pool_idx]
        if view is None or view.req is not req:
            raise RuntimeError(f"request {req.rid!r} has no compute-side state (was it prefilled?)")
        return view

    def release(self, row: int) -> None:
        self._views[row] = None
