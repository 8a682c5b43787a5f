"""A projection's training product under CPU low-precision autocast: ``x @ weight_t`` and its gradients.

Two facts shape it:
- oneDNN's AMX matmul (torch 2.13's) dies with SIGFPE in its blocking heuristic when it builds the
  kernel for some small-M, large-K products whose second operand is a transposed view: the input
  gradient of ``x @ weight_t`` (``grad @ weight_t.T``) at an LM head, K = vocabulary
  (tests/test_training_matmul.py). So every product here multiplies a contiguous, untransposed second
  operand; such products were checked on that CPU for every M from 1 to 512 at K 8,192 and 49,152.
- Autocast's own way there (``F.linear`` on a contiguous [out, in] copy) made, per call, a transposing
  fp32 copy of the weight, its cast, and in the backward a transposing copy of the weight's gradient:
  copies that cost the DFlash trainer's step more than its attention. Here the weight is cast in the
  layout it lies in (a streaming copy) and multiplied as it lies; its gradient is made in that layout
  (``x.T @ grad``); only the input's gradient needs the [out, in] layout, a cast-dtype transposing copy
  made only when the input wants a gradient (never for a draft's context projection, whose input is
  the target's features).

A frozen weight (a target's LM head under a draft being trained) has both casts made once per weight
version and kept while the weight lives. Its two products (``frozen_products``: the head's logits and the
input's gradient through it) run on specjet's bf16 GEMM (kernels/bf16_gemm.py) where the CPU has AMX tiles or
AVX-512 BF16: its packed operands are made once too, and at a DFlash step's shapes ([1,152, 8,192] x [8,192,
576] and 128-row chunks of [576, 8,192]) it runs at oneDNN's best rate or faster: with AMX oneDNN's own calls of
these shapes swing between one and three times that, and with VDPBF16PS alone they run 10-15% slower
(bench/RESULTS.md, sessions 68 and 85).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from specjet.kernels import bf16_gemm


@dataclass
class _Frozen:
    """What a frozen weight's products need, made once a weight version and dtype: its casts and, made when first
    asked for, the products themselves (``frozen_products``)."""

    ref: weakref.ref
    version: int
    dtype: torch.dtype
    in_out: torch.Tensor  # [in, out] cast
    out_in: torch.Tensor  # its contiguous [out, in] transpose
    products: tuple[Callable, Callable] | None = None


_FROZEN: dict[int, _Frozen] = {}  # id of the weight -> its entry


def autocast_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t + bias`` in the CPU autocast dtype (its result in that dtype, as autocast's)."""
    return _AutocastLinear.apply(x, weight_t, bias, torch.get_autocast_dtype("cpu"))


def _frozen(weight_t: torch.Tensor, dtype: torch.dtype) -> _Frozen:
    """The entry of a weight without a gradient, kept until the weight changes in place (a new version) or dies."""
    key = id(weight_t)
    hit = _FROZEN.get(key)
    if hit is not None and hit.ref() is weight_t and hit.version == weight_t._version and hit.dtype == dtype:
        return hit
    in_out = weight_t.detach().to(dtype).contiguous()
    entry = _Frozen(weakref.ref(weight_t, lambda _ref, key=key: _FROZEN.pop(key, None)), weight_t._version, dtype,
                    in_out, in_out.t().contiguous())
    _FROZEN[key] = entry
    return entry


def frozen_casts(weight_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``weight_t`` in ``dtype``, its contiguous [out, in] transpose) of a weight without a gradient,
    made once and kept until the weight changes in place (a new version) or dies."""
    entry = _frozen(weight_t, dtype)
    return entry.in_out, entry.out_in


def frozen_products(weight_t: torch.Tensor, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """(x -> x @ weight_t, g -> g @ weight_t.T) in ``dtype`` for a frozen [in, out] weight, each taking a 2-D
    input of that dtype: specjet's bf16 GEMM on operands packed once a weight version (bf16 on a CPU with AMX
    tiles or AVX-512 BF16, the shapes it takes), else torch products of ``frozen_casts``. The two differ by float
    rounding (another order of the same sums), not by the result's dtype."""
    entry = _frozen(weight_t, dtype)
    if entry.products is None:
        isa = bf16_gemm.default_isa()  # applies() is False for "onednn"
        if dtype == torch.bfloat16 and bf16_gemm.applies(entry.in_out, isa) and bf16_gemm.applies(entry.out_in, isa):
            entry.products = (bf16_gemm.Bf16Linear.build(entry.in_out, isa=isa),
                              bf16_gemm.Bf16Linear.build(entry.out_in, isa=isa))
        else:
            entry.products = (entry.in_out.__rmatmul__, entry.out_in.__rmatmul__)
    return entry.products


class _AutocastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_t, bias, dtype):
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        frozen = not weight_t.requires_grad
        w = frozen_casts(weight_t, dtype)[0] if frozen else weight_t.to(dtype).contiguous()
        y = rows @ w if bias is None else torch.addmm(bias.to(dtype), rows, w)
        ctx.save_for_backward(None if frozen else rows, None if frozen else w, weight_t)
        ctx.frozen, ctx.dtype, ctx.x_meta = frozen, dtype, (x.shape, x.dtype)
        return y.view(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx, grad):
        rows, w, weight_t = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            out_in = frozen_casts(weight_t, ctx.dtype)[1] if ctx.frozen else w.t().contiguous()
            shape, dtype = ctx.x_meta
            grad_x = (g @ out_in).view(shape).to(dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (rows.t() @ g).to(weight_t.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0)
        return grad_x, grad_w, grad_b, None
