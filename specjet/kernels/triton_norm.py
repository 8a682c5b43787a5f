"""RMSNorm as a Triton kernel, used on CUDA for inference: one program per row.

torch's CUDA reduction picks how many threads and blocks share a row from the tensor's shape, so a
row's sum of squares may be added in another order when the forward has another number of rows; here
a row is always reduced by one program over a block of fixed width (the hidden size's next power of
two), so its bits never depend on the batch. Same math as ``RMSNorm.forward`` (models/llama.py):
normalise in fp32, cast to the input dtype, multiply by the weight in that dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] (rows with unit stride along n), weight [n] in x's dtype -> [..., n] in x's dtype."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, float(eps),
                                           BLOCK=triton.next_power_of_2(n), num_warps=4)
    return out.reshape(x.shape)
