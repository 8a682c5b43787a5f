"""RMSNorm as a Triton kernel, used on CUDA for inference: one program per row.

torch's CUDA reduction picks how many threads and blocks share a row from the tensor's shape, so a
row's sum of squares may be added in another order when the forward has another number of rows; here
a row is always reduced by one program over a block of fixed width (the hidden size's next power of
two), so its bits never depend on the batch. Same math as ``RMSNorm.forward`` (models/llama.py):
normalise in fp32, cast to the input dtype, multiply by the weight in that dtype. ``add_rms_norm_triton``
adds a residual first (``x + residual`` rounded to the input dtype, as torch's add gives it) and returns the
sum too: one kernel where a decoder layer launched two (a step of a small model is its kernels' count)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, sum_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_s, stride_o, n, eps,
                     BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=valid, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=valid)
    x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=valid)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] (rows with unit stride along n), weight [n] in x's dtype -> [..., n] in x's dtype."""
    n = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, rows, weight, out, rows.stride(0), 0, 0, out.stride(0), n,
                                           float(eps), BLOCK=triton.next_power_of_2(n), RESIDUAL=False, num_warps=4)
    return out.reshape(x.shape)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) for x, residual [..., n] of one dtype, weight [n] in that dtype."""
    n = x.shape[-1]
    rows, res = _rows(x), _rows(residual)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, total, weight, out, rows.stride(0), res.stride(0),
                                           total.stride(0), out.stride(0), n, float(eps),
                                           BLOCK=triton.next_power_of_2(n), RESIDUAL=True, num_warps=4)
    return total.reshape(x.shape), out.reshape(x.shape)
