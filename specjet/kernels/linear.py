"""Dense projections, batch-invariant: a row's output never depends on the other rows of the call.

Lossless speculative decoding compares a verify forward (many rows per request) against plain
decoding (one row per request) token for token, so a projection must give a row the same bits
whether it is computed alone or among 96 others. The CPU GEMM libraries do not promise that: their
kernel choice, blocking and reduction order depend on the row count M. Measured with torch 2.13 on
an AMX CPU (SmolLM2-135M shapes): bf16 matmuls are row-invariant for M <= 32 and not beyond;
fp32 matmuls give a single row (a GEMV) other bits than the same row in a call of 2+ rows.

So every weight gets a **row plan** (``min_rows``, ``max_rows``): a call of M rows runs as chunks of
at most ``max_rows`` rows, and a chunk below ``min_rows`` is padded with zero rows. The plan is not
assumed but measured once per (shape, dtype, bias, thread count) on the weight itself: a random input
is run at every chunk size in the range and each row must equal the same row run alone (padded to
``min_rows``); the widest plan that passes wins, falling back to one row per call, which is exact by
construction. Plan and kernel are chosen together, so any CPU gets an exact plan.

The kernel is oneDNN's matmul against a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout torch's CPU freezing path uses). Without the
reorder, oneDNN re-blocks a plain bf16 weight on every call, which made bf16 decoding slower than
fp32. The torch reference (also the path for training, where ``packed`` is None) is ``x @ weight_t + bias``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Chunk sizes tried, widest first; 1 row per call is always exact.
MAX_ROWS_CANDIDATES = (32, 16, 8, 4, 2)
MIN_ROWS_CANDIDATES = (1, 2)


def linear_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


@dataclass
class PackedLinear:
    """A weight prepared for inference: the kernel's weight operand and the row plan it is exact under."""

    weight: torch.Tensor  # oneDNN-blocked weight, or weight_t itself where no reorder applies
    bias: torch.Tensor | None
    blocked: bool  # True: ``weight`` is oneDNN-blocked
    min_rows: int = 1
    max_rows: int = 1

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return linear_reference(x, self.weight, self.bias)

    def run_chunk(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= self.min_rows:
            return self.kernel(x)
        pad = x.new_zeros(self.min_rows - rows, x.shape[1])
        return self.kernel(torch.cat([x, pad]))[:rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        if rows <= self.max_rows:
            out = self.run_chunk(x)
        else:
            out = torch.cat([self.run_chunk(x[i:i + self.max_rows]) for i in range(0, rows, self.max_rows)])
        return out.reshape(*lead, out.shape[-1])


def can_block(weight_t: torch.Tensor) -> bool:
    if weight_t.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight_t.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight_t.dtype == torch.float32


# (in, out, dtype, has_bias, threads, blocked) -> (min_rows, max_rows)
_PLANS: dict[tuple, tuple[int, int]] = {}


def _plan_is_exact(packed: PackedLinear, x: torch.Tensor, min_rows: int, max_rows: int) -> bool:
    trial = PackedLinear(packed.weight, packed.bias, packed.blocked, min_rows, max_rows)
    alone = torch.cat([trial.run_chunk(x[i:i + 1]) for i in range(max_rows)])
    for rows in range(min_rows, max_rows + 1):
        if not torch.equal(trial.kernel(x[:rows]), alone[:rows]):
            return False
    return True


def calibrate(packed: PackedLinear, in_features: int, out_features: int) -> None:
    """Set ``packed``'s row plan: the widest (min_rows, max_rows) under which a row's output is the same
    at every chunk size (measured on this weight, cached per shape)."""
    key = (in_features, out_features, packed.weight.dtype, packed.bias is not None, torch.get_num_threads(),
           packed.blocked)
    plan = _PLANS.get(key)
    if plan is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(max(MAX_ROWS_CANDIDATES), in_features, generator=gen).to(packed.weight.dtype)
        plan = (1, 1)
        with torch.inference_mode():
            for max_rows in MAX_ROWS_CANDIDATES:
                found = next((m for m in MIN_ROWS_CANDIDATES if _plan_is_exact(packed, x, m, max_rows)), None)
                if found is not None:
                    plan = (found, max_rows)
                    break
        if plan == (1, 1):
            logger.warning("linear %s: no batch-invariant chunking found; running one row per call", key)
        _PLANS[key] = plan
    packed.min_rows, packed.max_rows = plan


def pack_weight(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """Prepare ``weight_t`` ([in, out]) for inference: reorder it for oneDNN where possible and measure
    the row plan that keeps its matmul batch-invariant."""
    weight_t = weight_t.detach()
    bias = None if bias is None else bias.detach()
    if can_block(weight_t):
        weight = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous())
        packed = PackedLinear(weight, bias, blocked=True)
    else:
        packed = PackedLinear(weight_t, bias, blocked=False)
    calibrate(packed, weight_t.shape[0], weight_t.shape[1])
    return packed


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinear | None) -> torch.Tensor:
    if packed is None:
        return linear_reference(x, weight_t, bias)
    return packed(x)
