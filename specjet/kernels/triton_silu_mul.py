"""silu(gate) * up as one Triton kernel on CUDA (a decoder layer's MLP activation), where torch launched two
(``F.silu`` then the product) and a step of a small model costs its kernels' count. Elementwise, one program
per row block, so a row's bits never depend on the batch. Same math as the torch path (models/llama.py's
``MLP``): silu in fp32 rounded to the input dtype, then the product in fp32 rounded again."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < width
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + offs, mask=valid, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=valid)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (the gate's I columns, then the up's) -> silu(gate) * up [T, I] in its dtype."""
    rows = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    width = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        block = 1024
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, rows.stride(0), out.stride(0), width,
                                                                     BLOCK=block, num_warps=4)
    return out
