"""Dense projections for the decode hot path.

Weights are kept transposed ([in, out], contiguous): on CPU, MKL's sgemm is faster against that
layout for the few-row inputs of decoding. For fp32 on CPU, batches of 2+ rows additionally use an
MKL-packed copy of the weight (the packed GEMM torch's own CPU freezing path uses), which runs a
batch of 8 rows about 1.5x faster than plain sgemm; single rows stay on the plain path, where the
packed kernel is slower. The torch reference is ``x @ weight_t + bias``.
"""
from __future__ import annotations

import torch

# Rows the packed layout is tuned for; it serves any row count, fastest near this one.
PACK_ROWS = 8


def linear_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def can_pack(weight_t: torch.Tensor) -> bool:
    return (weight_t.device.type == "cpu" and weight_t.dtype == torch.float32
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") and torch.backends.mkl.is_available())


def pack_weight(weight_t: torch.Tensor) -> torch.Tensor | None:
    """An MKL-packed copy of the weight for multi-row inputs, or None where packing does not apply."""
    if not can_pack(weight_t):
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight_t.t().contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None and x.shape[0] > 1:
        return torch.ops.mkl._mkl_linear(x, packed, weight_t.t(), bias, PACK_ROWS)
    return linear_reference(x, weight_t, bias)
