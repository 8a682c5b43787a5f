"""Dense projections, batch-invariant: a row's output never depends on the other rows of the call.

Lossless speculative decoding compares a verify forward (many rows per request) against plain
decoding (one row per request) token for token, so a projection must give a row the same bits
whether it is computed alone or among 96 others. CPU GEMM libraries do not promise that: kernel
choice, blocking and reduction order follow the row count M, so a plain matmul keeps a row's bits
only up to some M, and a single row (GEMV) may get other bits than the same row among others (the
figures of one CPU are in bench/RESULTS.md).

(A CPU bf16 weight goes to specjet's own bf16 GEMM where it runs, kernels/bf16_gemm.py, and a CPU float32
weight to its float32 GEMM, kernels/fp32_gemm.py: invariant by construction, no plan. What follows is every
other weight's path, and a float32 weight's where a caller asks for oneDNN's one call: ``pack_onednn``.)

The kernel is oneDNN's matmul against a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, torch's CPU freezing path). Without the reorder oneDNN
re-blocks a plain bf16 weight on every call, which made bf16 decoding slower than fp32. The reorder
takes a batch-size hint that picks the blocked format, and the format decides invariance, so the
hint is part of a weight's plan; the plans that cover the most rows per call come first.

Every weight gets a **plan** (hint, ``min_rows``, ``max_rows``): a call of M rows runs as chunks of
at most ``max_rows`` rows, and a chunk below ``min_rows`` is padded with zero rows. The plan is not
assumed but measured once per (shape, dtype, bias, thread count, device type) on the weight itself: a
random input (elements of widely spread magnitudes; many rows for a narrow bf16 weight, whose rounded
outputs hide most order differences) is run at every chunk size in the range and each row must equal
the same row run alone (padded to ``min_rows``); the first plan that passes wins (GPU weights also try
calls padded to one fixed row count, ``FIXED_ROW_PLANS``), falling back to one row per call, which is
exact by construction. So any device gets an exact plan. Plans hold for the torch thread count they were
measured under (the one at load; nothing in specjet changes it later). The torch reference (also the
path for training, where ``packed`` is None) is ``x @ weight_t + bias``; under CPU bf16 autocast
``linear`` trains through kernels/training_linear.py instead (a oneDNN crash, see there).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specjet.kernels import bf16_gemm, fp32_gemm
from specjet.kernels.bf16_gemm import Bf16Linear
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.training_linear import autocast_linear

logger = logging.getLogger(__name__)


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
    # False (a model run without batch invariance: enable_deterministic_inference=False): every call is
    # one kernel call whatever its rows. oneDNN, not torch's matmul: torch's CPU build takes fp32
    # matmuls to MKL, which runs its AVX2 kernels on AMD CPUs, at under half oneDNN's AVX-512 rate
    # there; on an Intel CPU MKL was at most ~1.1x oneDNN's one call (bench/RESULTS.md, sessions 45, 46).
    invariant: bool = True

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
        if not self.invariant:
            out = self.kernel(x)
        elif rows <= self.max_rows:
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


# Plans tried, in order: (reorder hint or None = oneDNN's default, min_rows, max_rows). Wide chunks
# first (fewer weight reads for verify and prefill); an unpadded plan before the padded one of the
# same width.
BLOCKED_PLANS = {
    # Padded to 2 rows: oneDNN's bf16 kernel for a single row (AVX-512 BF16, in=1536) rounds 1 ulp
    # apart from the same row among others, so a lone row must never take that path.
    torch.bfloat16: [(1, 1, 128), (1, 2, 128), (None, 2, 128), (1, 1, 64), (1, 2, 64), (None, 1, 32), (1, 1, 32),
                     (None, 2, 32), (None, 1, 16), (None, 1, 8)],
    torch.float32: [(None, 1, 128), (None, 2, 128), (None, 1, 32), (None, 2, 32), (None, 2, 16), (None, 2, 8)],
}
PLAIN_PLANS = [(None, 1, 32), (None, 2, 32), (None, 1, 16), (None, 2, 16), (None, 1, 8), (None, 2, 8)]
# A GPU's GEMM library may choose its kernel (tiles, split-K) by the row count, so that no chunking
# keeps a row's bits (fp32 cuBLAS on an H200: bench/RESULTS.md, session 35) and the fallback of one row
# per call makes a 16-node verify 16 launches a projection. Every call padded to one fixed row count
# runs one kernel whatever the rows hold, and on a GPU the padding costs nothing a step notices (the
# weights' read dominates). On a CPU it would multiply a decode step's work, so only GPU weights try it.
FIXED_ROW_PLANS = [(None, 32, 32), (None, 16, 16), (None, 8, 8)]

# (in, out, dtype, has_bias, threads, blocked, device type) -> plan
_PLANS: dict[tuple, tuple[int | None, int, int]] = {}


def _make(weight_t: torch.Tensor, bias: torch.Tensor | None, blocked: bool, plan) -> PackedLinear:
    hint, min_rows, max_rows = plan
    if not blocked:
        return PackedLinear(weight_t, bias, False, min_rows, max_rows)
    dense = weight_t.t().contiguous()
    weight = (torch.ops.mkldnn._reorder_linear_weight(dense) if hint is None
              else torch.ops.mkldnn._reorder_linear_weight(dense, hint))
    return PackedLinear(weight, bias, True, min_rows, max_rows)


# Row counts checked: every count up to 17, then the usual blocking edges up to 128.
CHECK_ROWS = tuple(range(1, 18)) + (24, 31, 32, 33, 40, 47, 48, 63, 64, 65, 80, 96, 112, 127, 128)
# Distinct input rows at least (a full call's worth), each run alone once.
CHECK_DISTINCT = 128
# Outputs compared at each row count. Another summation order changes most elements of an fp32 output
# but an element of a bf16 (or fp16) output only where its fp32 sum lies near a rounding edge, a few in
# 10^4 of them: a check of 128 rows x 192 outputs passed a oneDNN bf16 kernel whose single rows round
# apart from the same rows among others, which then changed a model's rows (bench/RESULTS.md, session
# 79). So a narrow low-precision weight is checked on many more rows.
CHECK_OUTPUTS_FP32 = 1 << 15
CHECK_OUTPUTS_LOW_PRECISION = 1 << 18
CHECK_MAX_DISTINCT = 4096
# The check's inputs span 2^0..2^15 in magnitude (2^0..2^7 in fp16, whose range ends at 65504): products
# of very different sizes, whose sums another order rounds apart more often than those of normal inputs.
CHECK_EXPONENT_SPREAD = 16
CHECK_EXPONENT_SPREAD_FP16 = 8


def check_rows_per_count(weight_t: torch.Tensor) -> int:
    """How many rows each row count of the check covers: enough for its outputs to expose another order."""
    target = CHECK_OUTPUTS_FP32 if weight_t.element_size() >= 4 else CHECK_OUTPUTS_LOW_PRECISION
    return min(CHECK_MAX_DISTINCT, -(-target // weight_t.shape[1]))


def check_input(rows: int, weight_t: torch.Tensor) -> torch.Tensor:
    """``rows`` seeded input rows for ``weight_t`` ([in, out]), on its device in its dtype."""
    gen = torch.Generator().manual_seed(0)
    shape = (rows, weight_t.shape[0])
    x = torch.randn(shape, generator=gen)
    spread = CHECK_EXPONENT_SPREAD_FP16 if weight_t.dtype == torch.float16 else CHECK_EXPONENT_SPREAD
    x = x * torch.exp2(torch.randint(0, spread, shape, generator=gen).float())
    return x.to(device=weight_t.device, dtype=weight_t.dtype)


def _is_exact(packed: PackedLinear, x: torch.Tensor, covered: int) -> bool:
    """Each row of calls of min_rows..max_rows rows (CHECK_ROWS among them) equals that row run alone;
    each row count is checked on ``covered`` rows of ``x`` (or one call's worth), as calls of that count."""
    alone = torch.cat([packed.run_chunk(x[i:i + 1]) for i in range(x.shape[0])])
    rows_list = [r for r in CHECK_ROWS if packed.min_rows <= r <= packed.max_rows]
    for rows in sorted(set(rows_list) | {packed.max_rows}, reverse=True):  # wide calls fail first
        total = -(-max(rows, covered) // rows) * rows
        index = torch.arange(total, device=x.device) % x.shape[0]
        for start in range(0, total, rows):
            chunk = index[start:start + rows]
            if not torch.equal(packed.kernel(x[chunk]), alone[chunk]):
                return False
    return True


def pack_weight(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | Bf16Linear | Fp32Linear:
    """Prepare ``weight_t`` ([in, out]) for inference: a CPU bf16 weight for specjet's own bf16 GEMM and a CPU float32
    weight for its float32 GEMM where they apply (kernels/bf16_gemm.py, kernels/fp32_gemm.py: invariant by
    construction, no plan), else reorder it for oneDNN where possible, under the first plan measured to keep its
    matmul batch-invariant."""
    weight_t = weight_t.detach()
    bias = None if bias is None else bias.detach()
    if bf16_gemm.applies(weight_t):
        return Bf16Linear.build(weight_t, bias)
    if fp32_gemm.applies(weight_t):
        return Fp32Linear.build(weight_t, bias)
    return pack_onednn(weight_t, bias)


def pack_onednn(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """``weight_t`` on oneDNN (or x @ W) under its measured row plan, whatever specjet's own GEMMs would take: for
    callers that run it as one call of thousands of rows with no invariance asked (feature extraction, a label
    pass), whose stages were measured on oneDNN's one call; specjet's float32 GEMM was built and measured for a
    decode step's to a prefill chunk's rows (up to 128: bench/RESULTS.md, session 99)."""
    weight_t = weight_t.detach()
    bias = None if bias is None else bias.detach()
    blocked = can_block(weight_t)
    in_features, out_features = weight_t.shape
    key = (in_features, out_features, weight_t.dtype, bias is not None, torch.get_num_threads(), blocked,
           weight_t.device.type)
    plan = _PLANS.get(key)
    if plan is not None:
        return _make(weight_t, bias, blocked, plan)
    plan, packed = choose_plan(weight_t, bias, blocked, plan_candidates(weight_t, blocked))
    if plan == (None, 1, 1):
        logger.warning("linear %s: no batch-invariant chunking found; running one row per call", key)
    _PLANS[key] = plan
    return packed


def plan_candidates(weight_t: torch.Tensor, blocked: bool) -> list[tuple[int | None, int, int]]:
    """The plans ``pack_weight`` tries for this weight, in order (the fixed-row ones on a GPU only)."""
    if blocked:
        return BLOCKED_PLANS[weight_t.dtype]
    return PLAIN_PLANS + (FIXED_ROW_PLANS if weight_t.device.type == "cuda" else [])


def choose_plan(weight_t: torch.Tensor, bias: torch.Tensor | None, blocked: bool,
                candidates) -> tuple[tuple[int | None, int, int], PackedLinear]:
    """The first candidate measured exact on ``weight_t``, else one row per call (exact by construction)."""
    covered = check_rows_per_count(weight_t)
    x = check_input(max(CHECK_DISTINCT, covered), weight_t)
    with torch.inference_mode():
        for plan in candidates:
            packed = _make(weight_t, bias, blocked, plan)
            if _is_exact(packed, x, covered):
                return plan, packed
    plan = (None, 1, 1)
    return plan, _make(weight_t, bias, blocked, plan)


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinear | Bf16Linear | Fp32Linear | None) -> torch.Tensor:
    if packed is None:  # training, or a model never packed for inference
        if torch.is_grad_enabled() and x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            return autocast_linear(x, weight_t, bias)  # (a oneDNN crash, and copies: training_linear.py)
        return linear_reference(x, weight_t, bias)
    return packed(x)
