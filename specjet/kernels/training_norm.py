"""RMSNorm's training backward written out: the forward is ``RMSNorm.forward``'s own ops (the same bits), the
backward a handful of passes where autograd's graph of that forward takes a dozen.

Left to autograd, the norm's chain (cast, square, mean, add, rsqrt, product, cast back, weight) makes a gradient
pass for every op, each a walk through a [rows, hidden] tensor: at a DFlash training step's ~2,000 rows that is ~10%
of the step across its four norms. Written out, with n = x * r and r = (mean(x^2) + eps)^-1/2 per row:
grad_weight = Σ_rows grad * n (in n's dtype, as the forward used it), dn = grad * weight (rounded to n's dtype, as
autograd's cast back would), and grad_x = r * (dn - x * r^2 * (dn . x) / hidden).
"""
from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x in float32, r = rsqrt(mean(x^2) + eps) per row, (x * r) in x's dtype): RMSNorm's normalisation in float32,
    as the reference implementations do, cast back; the plain forward and the training one alike."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf, rstd, (xf * rstd).to(x.dtype)


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` with the backward written out."""
    return _RMSNormTrain.apply(x, weight, eps)


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf, rstd, normed = rms_normalize(x, eps)
        ctx.save_for_backward(xf, rstd, normed, weight)
        ctx.x_dtype = x.dtype
        return weight * normed

    @staticmethod
    def backward(ctx, grad):
        xf, rstd, normed, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[1]:
                rows = grad.reshape(-1, grad.shape[-1])
                grad_weight = (rows * normed.reshape(-1, normed.shape[-1])).sum(0).to(weight.dtype)
            if ctx.needs_input_grad[0]:
                dn = (grad * weight).to(normed.dtype).float()
                dot = torch.linalg.vecdot(dn, xf, dim=-1).unsqueeze(-1)
                grad_x = torch.addcmul(dn, xf, rstd * rstd * dot / xf.shape[-1], value=-1.0).mul_(rstd)
                grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, grad_weight, None
