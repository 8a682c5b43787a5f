"""Fixed-shape forwards on static buffers per batch bucket, captured as CUDA graphs on CUDA (SGLang's
``CudaGraphRunner`` and ``EAGLEDraftCudaGraphRunner``), shared by the drafters and the target.

A drafter's forward (EAGLE's draft step over a frontier, DFlash's block) and the target's decode and
verify (models/target_graphs.py) have the same shape every iteration except for their batch: the
runner pads the batch up to a bucket (1, 2, 4, 8, ...) and runs the forward on static input buffers
of that bucket, so each bucket's forward always sees tensors of one shape at one address:

- on CUDA the first run of a bucket captures the forward as a CUDA graph (after warm-up runs that
  let Triton compile and the allocator settle) and later runs replay it: no Python, no kernel
  launches, only the copies into the static buffers;
- on the CPU (and with ``capture=False``) the same buffers and padding, run eagerly: the path the
  tests here exercise, and kept only where it measures faster than an eager unpadded forward.

The step is a function of the buffers alone (``step(buffers) -> tuple of tensors``) whose outputs
have the batch as their first dimension; a padded row must be harmless: every input's
``pad_values`` entry says what a padded row holds (e.g. slot 0, the KV pool's padding slot, for
slots; a KV length that covers the row's own queries). An input named in ``growing`` may have a
last dimension that changes between calls (a slot table's width): its buffer's is rounded up to
``width_multiple`` and the columns past the real ones hold the pad value; buffers (and captures)
are keyed by those sizes, so on CUDA a caller that wants one graph per bucket passes its full
width every time. Every other trailing size is fixed per key as given.

Outputs are sliced to the real batch and, when they are a captured graph's own buffers, copied,
so a later replay never overwrites what a caller holds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Trailing sizes of a buffer are rounded up to a multiple of this: a growing context then reuses a
# buffer (and a captured graph) for this many positions before it needs a new one.
WIDTH_MULTIPLE = 256
WARMUP_RUNS = 2  # eager runs on the capture stream before a capture


@dataclass
class _Bucket:
    buffers: dict[str, torch.Tensor]
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    outputs: tuple[torch.Tensor, ...] | None = None  # the captured graph's output tensors


@dataclass
class GraphRunnerStats:
    calls: int = 0
    eager_calls: int = 0  # batches wider than the largest bucket
    padded_rows: int = 0
    captures: int = 0
    capture_failures: int = 0  # after one the runner runs eagerly (``capture`` turns False)
    buckets: dict[tuple, int] = field(default_factory=dict)  # bucket key -> calls


def capture_sizes(runner: "GraphRunner | None", max_q: int, table: torch.Tensor) -> tuple[int, int] | None:
    """``ForwardBatch.build``'s ``static_sizes`` for a step run by ``runner``: the buffers' own
    (max_q, table width) while it captures CUDA graphs (a capture cannot read sizes back from the
    device); None otherwise (the batch's real sizes, so attention spans only the real lengths)."""
    return (max_q, table.shape[1]) if runner is not None and runner.capture else None


class GraphRunner:
    """Runs ``step`` on padded static buffers per batch bucket; captures CUDA graphs on CUDA."""

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 pad_values: dict[str, int | float], device: torch.device | str, capture: bool | None = None,
                 growing: tuple[str, ...] = (), buckets: tuple[int, ...] = BATCH_BUCKETS,
                 width_multiple: int = WIDTH_MULTIPLE):
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be increasing positive batch sizes, got {buckets}")
        if width_multiple < 1:
            raise ValueError(f"width_multiple must be >= 1, got {width_multiple}")
        self.step = step
        self.pad_values = dict(pad_values)
        if not set(growing) <= set(pad_values):
            raise ValueError(f"growing inputs {sorted(set(growing) - set(pad_values))} have no pad value")
        self.growing = frozenset(growing)
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs are captured on a CUDA device only")
        self.buckets = tuple(buckets)
        self.width_multiple = width_multiple
        self._states: dict[tuple, _Bucket] = {}
        self._pool = None  # one memory pool shared by every captured graph (as SGLang does)
        self.stats = GraphRunnerStats()

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket that holds ``batch`` rows (None: wider than every bucket)."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if set(inputs) != set(self.pad_values):
            raise ValueError(f"graph runner inputs {sorted(inputs)} differ from its pad values {sorted(self.pad_values)}")
        sizes = {t.shape[0] for t in inputs.values()}
        if len(sizes) != 1:
            raise ValueError(f"graph runner inputs disagree on the batch size: {sorted(sizes)}")
        batch = sizes.pop()
        self.stats.calls += 1
        bucket = self.bucket_for(batch)
        if bucket is None or batch == 0:
            self.stats.eager_calls += 1
            return tuple(self.step(inputs))
        state, key = self._state(bucket, inputs)
        self._fill(state.buffers, inputs, batch)
        self.stats.padded_rows += bucket - batch
        self.stats.buckets[key] = self.stats.buckets.get(key, 0) + 1
        if not self.capture:
            return tuple(out[:batch] for out in self.step(state.buffers))
        if state.graph is None:
            try:
                self._capture(state)
            except Exception:
                # A capture can fail where an eager run does not (a library call that is not
                # capturable, the capture invalidated): this runner stops capturing and runs its
                # buffers eagerly from now on, the same bits without the replay's speed.
                logger.warning("CUDA graph capture failed; running eagerly from now on", exc_info=True)
                self.capture = False
                self.stats.capture_failures += 1
                return tuple(out[:batch] for out in self.step(state.buffers))
        state.graph.replay()
        return tuple(out[:batch].clone() for out in state.outputs)

    # ---------------------------------------------------------------- buffers
    def _state(self, bucket: int, inputs: dict[str, torch.Tensor]) -> tuple[_Bucket, tuple]:
        """The buffers of ``bucket`` wide enough for ``inputs`` (a new, wider set when they are not)."""
        shapes = {name: self._padded_shape(name, t) for name, t in inputs.items()}
        key = (bucket,) + tuple((name, shapes[name], inputs[name].dtype) for name in sorted(inputs))
        state = self._states.get(key)
        if state is None:
            buffers = {name: torch.empty((bucket,) + shapes[name], dtype=t.dtype, device=self.device)
                       for name, t in inputs.items()}
            state = self._states[key] = _Bucket(buffers)
        return state, key

    def _padded_shape(self, name: str, t: torch.Tensor) -> tuple[int, ...]:
        if name not in self.growing or t.dim() < 2:
            return tuple(t.shape[1:])
        m = self.width_multiple
        return tuple(t.shape[1:-1]) + (-(-t.shape[-1] // m) * m,)

    def _fill(self, buffers: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], batch: int) -> None:
        """Copy the real rows in (from the host or the device) and set everything else (padded rows,
        padded trailing sizes) to the input's pad value."""
        for name, src in inputs.items():
            buf = buffers[name]
            if buf.shape[1:] != src.shape[1:]:
                buf.fill_(self.pad_values[name])
            elif batch < buf.shape[0]:
                buf[batch:].fill_(self.pad_values[name])
            buf[(slice(0, batch),) + tuple(slice(0, d) for d in src.shape[1:])].copy_(src, non_blocking=True)

    # ---------------------------------------------------------------- CUDA graphs
    def _capture(self, state: _Bucket) -> None:
        """Warm up on a side stream, then capture one run of ``step`` on the static buffers, on that
        same stream (the libraries' per-stream state, e.g. cuBLAS's workspace, set up by the warm-up
        and not allocated inside the capture)."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.step(state.buffers)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host thread may launch its own CUDA work (a later batch's inputs) while
        # the compute thread captures; only this thread's unsafe calls may break the capture.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            outputs = tuple(self.step(state.buffers))
        self._pool = graph.pool()
        state.graph, state.outputs = graph, outputs
        self.stats.captures += 1
