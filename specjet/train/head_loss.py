"""A draft's training loss through a frozen LM head, its logits made and consumed a few rows at a time.

The DFlash trainer scores ~1,300 block rows a step against an 8,192-column hot head. Made whole, the logits
are a [rows, K] float tensor (~40 MB) that the loss then reads and writes again and again: the cast to
float, log-softmax, its output, its backward, the argmax for the step's metrics. Each pass goes through
main memory, and on a CPU those passes cost as much as the head's product itself. Here the head's
product, the log-sum-exp, the argmax and the logits' gradient (softmax minus one-hot, times the row's
share of the loss) are made for a chunk of rows at a time, which stays in the core's cache; only the
gradient is kept for the backward, in the product's dtype (the backward's product would cast it there
anyway). The backward is one product of that gradient with the head's weight.

Where the C++ extension is built, a chunk's rows after the product go through ``head_cross_entropy_rows``
(csrc/head_loss.cpp): each row widened once into a buffer in the core's cache, its argmax, one exponential a
column and their sum, and the scaled store, where torch's ops walk the whole chunk a dozen times
(``chunk_cross_entropy_reference`` is that torch form, the fallback and the tests' reference).

The arithmetic is the unfused path's (``F.cross_entropy`` over ``(hidden @ weight_t).float()``, weighted
and normalised), in another order: values agree to float rounding, not bit for bit
(tests/test_dflash_train.py holds them to the written-out loss). The head's weight must be frozen (a
target's head: the draft trains through it, never into it).
"""
from __future__ import annotations

import torch

from specjet.kernels import cpu_ops
from specjet.kernels.argmax import argmax_rows
from specjet.kernels.training_linear import frozen_products

# Rows per chunk: enough rows for the head's product to run near oneDNN's full rate (a 64-row product runs well
# below it), few enough that a chunk's float logits (128 x 8,192 x 4 bytes = 4 MB) stay in the caches; 256 rows
# measured slower again (bench/RESULTS.md, session 65); on specjet's AMX GEMM 128, 256 and 384 rows run alike
# (session 68). The DFlash trainer pads its scored rows to a multiple of
# 128 (models/dflash.py), so every chunk has one shape and oneDNN builds one kernel.
CHUNK_ROWS = 128


def head_cross_entropy(hidden: torch.Tensor, weight_t: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                       teacher: torch.Tensor | None = None, distill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ weights_i * CE(hidden_i @ weight_t, targets_i) / Σ weights, argmax_i of hidden_i @ weight_t).

    hidden [n, h] (differentiable), weight_t [h, K] frozen, targets [n] int64 column ids, weights [n] float
    (0: a row that does not count). Under CPU autocast the product runs in its dtype, as a projection's would;
    the loss is summed in float32 either way. ``teacher`` [n, h] (knowledge distillation): rows whose products
    with the same head give a teacher's logits; each row's label is then (1 - ``distill``) one-hot(target) +
    ``distill`` * softmax(teacher_i @ weight_t), and the loss the cross-entropy against it."""
    if weight_t.requires_grad:
        raise ValueError("head_cross_entropy trains through a frozen head; this weight requires a gradient")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(f"hidden [n, h], targets [n] and weights [n] expected, got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(weights.shape)}")
    autocast = torch.is_autocast_enabled("cpu") and hidden.device.type == "cpu"
    dtype = torch.get_autocast_dtype("cpu") if autocast else hidden.dtype
    if teacher is not None and teacher.shape != hidden.shape:
        raise ValueError(f"teacher rows [n, h] like hidden's expected, got {tuple(teacher.shape)}")
    if not 0.0 <= distill <= 1.0:
        raise ValueError(f"distill must lie in [0, 1], got {distill}")
    if teacher is None and distill > 0.0:
        raise ValueError(f"distill={distill} needs the teacher rows whose distribution it mixes in")
    if distill == 0.0:
        teacher = None
    return _HeadCrossEntropy.apply(hidden, weight_t, targets, weights.float(), dtype, teacher, distill)


def chunk_cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, share: torch.Tensor,
                                  grad_out: torch.Tensor, teacher: torch.Tensor | None = None, distill: float = 0.0
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's (cross-entropy [r] float32, argmax [r]) of logits [r, K] against ``targets`` [r], writing
    ``grad_out`` [r, K] (its dtype) = (softmax - label) * ``share`` [r]; the label one-hot(target), or with
    ``teacher`` logits [r, K] (1 - distill) one-hot(target) + distill * softmax(teacher); in torch ops."""
    logits = logits.float()
    predicted = argmax_rows(logits)
    lse = torch.logsumexp(logits, -1)
    picked = logits.gather(1, targets[:, None])[:, 0]
    ce = lse - picked
    if teacher is not None:  # lse - (1 - distill) x[t] - distill E_teacher[x], each term less the row's maximum
        soft = torch.softmax(teacher.float(), -1)
        top = logits.max(-1, keepdim=True).values
        ce = (lse - top[:, 0]) - (1.0 - distill) * (picked - top[:, 0]) - distill * (soft * (logits - top)).sum(-1)
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    rows = torch.arange(logits.shape[0], device=logits.device)
    if teacher is None:
        probs[rows, targets] -= 1.0
    else:
        probs.sub_(soft.mul_(distill))
        probs[rows, targets] -= 1.0 - distill
    grad_out.copy_(probs.mul_(share[:, None]))
    return ce, predicted


def chunk_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, share: torch.Tensor, grad_out: torch.Tensor,
                        teacher: torch.Tensor | None = None, distill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_cross_entropy_reference`` in one C++ pass a row (csrc/head_loss.cpp): the logits (and teacher logits)
    float32 or bf16, ``grad_out`` a contiguous float32 or bf16 tensor."""
    return tuple(cpu_ops.extension().head_cross_entropy_rows(
        logits.contiguous(), targets.contiguous(), share.contiguous(), grad_out,
        None if teacher is None else teacher.to(logits.dtype).contiguous(), distill))


def _fused_rows(rows: torch.Tensor) -> bool:
    ext = cpu_ops.extension()
    return ext is not None and hasattr(ext, "head_cross_entropy_rows") and rows.device.type == "cpu"


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight_t, targets, weights, dtype, teacher=None, distill=0.0):
        with torch.autocast("cpu", enabled=False):
            rows = hidden.to(dtype)
            product = frozen_products(weight_t, dtype)[0]
            n, columns = rows.shape[0], weight_t.shape[1]
            share = weights / weights.sum().clamp(min=1e-9)  # each row's weight in the normalised loss
            ce = torch.empty(n, dtype=torch.float32, device=rows.device)
            predicted = torch.empty(n, dtype=torch.int64, device=rows.device)
            grad_logits = torch.empty(n, columns, dtype=dtype, device=rows.device)
            chunk_loss = chunk_cross_entropy if _fused_rows(rows) else chunk_cross_entropy_reference
            for lo in range(0, n, CHUNK_ROWS):
                hi = min(lo + CHUNK_ROWS, n)
                # The teacher's logits through the same head: its softmax takes ``distill`` of each row's label.
                teacher_logits = None if teacher is None else product(teacher[lo:hi].to(dtype))
                ce[lo:hi], predicted[lo:hi] = chunk_loss(product(rows[lo:hi]), targets[lo:hi], share[lo:hi],
                                                         grad_logits[lo:hi], teacher_logits, distill)
            loss = (ce * weights).sum() / weights.sum().clamp(min=1e-9)
        ctx.save_for_backward(grad_logits, weight_t)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(predicted)
        return loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, _grad_predicted):
        grad_logits, weight_t = ctx.saved_tensors
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            with torch.autocast("cpu", enabled=False):
                # The [K, h] layout (frozen_products): oneDNN's AMX matmul faults on a transposed second operand
                # at this shape (kernels/training_linear.py).
                product = frozen_products(weight_t, grad_logits.dtype)[1]
                grad_hidden = product(grad_logits).to(ctx.hidden_dtype) * grad_loss.to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None, None
