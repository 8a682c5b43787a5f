"""An LM head's greedy rows without most of its columns: an int8 copy of the head and a proven bound on its error
pick the columns that can hold a row's argmax, and only those are computed with the head's own kernel.

A greedy row reads one thing from its logits, the argmax. Computing the whole head for it streams the weight (113 MB
in float32 for the default model, 56 MB in bf16) and pays every column's products, while the int8 copy (a quarter
or half of the bytes, and integer products the CPU runs faster) gives every column within a bound that is known
before the row is seen: for column j and the row's 32-wide blocks b,

    |head_j(x) - approx_j(x)| <= E1[j] * |x|_1 + sum_b E2[b, j] * delta_b

where E1 holds the weight's own int8 error (max |w - w8| over the column's blocks: a small term, so one
factor a column) and E2 the int8 weights' L1 norm of each block (the activations' int8 error, at most
``delta_b`` = 0.5 of the block's activation step, scaled by them: the term that decides the bound), each
with a margin for the float rounding of the head's chain of products (float32 FMAs, or bf16 pair products summed
in float32: either at most one rounding a k), of the int8 kernel's float finish and of the comparisons below
(kappa: 1e-4 of the products' magnitude, three times what 576 roundings can add).
Every column j with approx_j + bound_j >= max_k (approx_k - bound_k) is a candidate; any other column is
strictly below the column that attains that maximum, so the row's argmax (torch's rule, first maximum) is among
the candidates. A bf16 head rounds its sums to bf16, where a lower sum can round to the same value as the
highest and, as an earlier column, be the argmax: its limit is lowered by two bf16 steps of its size (the C++
pass's ``bf16_tie_limit``), so every column that can round that high is a candidate too.

``narrow`` (a C++ pass: csrc/argmax_bound.cpp) turns the candidates into the grammar-style bitmask that the head's
masked kernel (``Fp32Linear.masked``, ``Bf16Linear.masked`` on VDPBF16PS) takes: those columns get exactly the bits
the full call gives them, -inf elsewhere, and a row whose candidates outnumber the kernel's limit is computed
whole. Nothing but an argmax may read such a row (greedy, no penalties, no logprobs): the callers choose the rows.
A bf16 head is narrowed only in calls of at most ``BF16_MAX_ROWS`` such rows (decode steps): its VDPBF16PS
products run nearly as fast as the int8 copy's, so a verify's many rows pay for the bound's own pass and gain
nothing (bench/RESULTS.md, session 101).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specjet.kernels.bf16_gemm import Bf16Linear
from specjet.kernels.fp32_gemm import MASKED_MAX_ALLOWED, Fp32Linear
from specjet.kernels.qgemm import QuantizedLinear, extension
from specjet.kernels.quant_formats import quantize_int8
from specjet.kernels.token_bitmask import allowed_counts

BLOCK = 32  # the int8 kernel's activation and weight blocks
KAPPA = 1e-4  # the float rounding margin, relative to the products' magnitude (see the module's docstring)
INFLATE = 1.001  # the bound's own product (non-negative terms) and the comparisons' rounding
ENV = "SPECJET_ARGMAX_BOUND"  # "off": every greedy row computes the whole head
BF16_MAX_ROWS = 4  # a bf16 head is narrowed in calls that flag at most this many rows (module docstring)


def enabled() -> bool:
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{ENV}={value!r}: expected 'on' or 'off'")
    return value == "on"


@dataclass
class ArgmaxBound:
    """The int8 copy of a head and the per-block bound factors of its error."""

    head: Fp32Linear | Bf16Linear  # the operand whose argmax this certifies (a replaced head is not served)
    approx: QuantizedLinear  # int8, one scale per 32 weights
    factors: torch.Tensor  # float32 [1 + B, V]: E1, then a row of E2 per block (see the module's docstring)
    bf16_ties: bool = False  # the head rounds its outputs to bf16 (the module's docstring)
    max_rows: int | None = None  # calls with more rows to narrow compute the whole head (None: no limit)

    @classmethod
    def build(cls, head) -> "ArgmaxBound | None":
        """For a head without a bias, on specjet's float32 GEMM or its VDPBF16PS bf16 GEMM (the kernels that compute
        a row's listed columns alone, with the full call's bits), whose input width is whole 32-blocks, with the
        int8 kernels built; else None (the head is computed whole)."""
        if not (isinstance(head, (Fp32Linear, Bf16Linear)) and head.bias is None and head.has_masked_kernel
                and extension() is not None and enabled()):
            return None
        bf16 = isinstance(head, Bf16Linear)
        weight = head.weight_t().t().float().contiguous()  # [V, K]
        vocab, k = weight.shape
        if k % BLOCK or not torch.isfinite(weight).all():
            return None
        w8 = quantize_int8(weight, BLOCK)
        blocks = k // BLOCK
        w = weight.view(vocab, blocks, BLOCK)
        w8f = (w8.q.float().view(vocab, blocks, BLOCK) * w8.s.float()[..., None])
        if not torch.isfinite(w8f).all():  # a scale beyond float16's range
            return None
        magnitude = torch.maximum(w.abs().amax(-1), w8f.abs().amax(-1))
        e1 = (w - w8f).abs().amax(-1) + KAPPA * magnitude
        e2 = w8f.abs().sum(-1) + KAPPA * BLOCK * magnitude
        factors = torch.cat([e1.amax(-1, keepdim=True), e2], dim=1).t().contiguous() * INFLATE
        return cls(head, QuantizedLinear.build(w8), factors, bf16_ties=bf16, max_rows=BF16_MAX_ROWS if bf16 else None)

    @property
    def vocab(self) -> int:
        return self.factors.shape[1]

    def bounds(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [R, V]: each row's bound on |head(x) - approx(x)| per column."""
        blocks = x.view(x.shape[0], -1, BLOCK).abs()
        delta = blocks.amax(-1) * (0.5005 / 127)  # half the activation step, and its rounding
        return torch.cat([blocks.sum((1, 2))[:, None], delta], dim=1) @ self.factors

    def candidates(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """bool [R, V]: the columns that may hold each row's argmax among its ``allowed`` ones (bool [R, V],
        None: all), in torch (``narrow``'s C++ pass makes the same choice). A row whose approximation is not
        finite has every allowed column."""
        approx = self.approx(x)
        bound = self.bounds(x)
        lower = approx - bound
        upper = approx + bound
        if allowed is not None:
            lower.masked_fill_(~allowed, float("-inf"))
        best = lower.amax(-1, keepdim=True)
        limit = best
        if self.bf16_ties:  # two bf16 steps of |best|'s size below it (csrc/argmax_bound.cpp's bf16_tie_limit)
            exponent = torch.frexp(best.abs()).exponent.clamp(min=-100)
            limit = torch.where(torch.isfinite(best), best - torch.ldexp(torch.ones_like(best), exponent - 6), best)
        chosen = upper >= limit
        if allowed is not None:
            chosen &= allowed
        bad = ~torch.isfinite(approx).all(-1) | ~torch.isfinite(best[:, 0])
        if bad.any():
            chosen[bad] = True if allowed is None else allowed[bad]
        return chosen

    def narrow(self, x: torch.Tensor, rows: torch.Tensor,
               mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head mask (bitmask int32 [R, W], masked bool [R]) for the head's ``masked``, or ``mask`` itself
        (None included) where nothing is narrowed: rows flagged in ``rows`` (bool [R], rows only an argmax reads;
        x [R, K], the head's input rows) get their candidates (within their grammar's allowed tokens where
        ``mask`` flags them); the others keep ``mask``'s row and flag (or are computed whole), as do rows whose
        grammar already allows few enough tokens for the masked kernel to compute them alone (the int8 pass would
        cost more than it saves there), and every row of a call that flags more than ``max_rows`` rows (checked
        first: a bf16 verify's call returns before any other work)."""
        if self.max_rows is not None and int(rows.sum()) > self.max_rows:
            return mask
        n, words = x.shape[0], -(-self.vocab // 32)
        if mask is not None and mask[0].shape[1] != words:  # a bitmask of another vocabulary's width: as it is
            return mask
        if mask is not None and bool(mask[1].any()):
            rows = rows & ~(mask[1] & (allowed_counts(mask[0]) <= MASKED_MAX_ALLOWED))
            if not bool(rows.any()):
                return mask
        x = x.to(torch.float32).contiguous()  # the int8 pass reads float32 rows (a bf16 head's are widened)
        if bool(rows.all()):  # a greedy batch: one pass, no copy of the incoming mask
            grammar = () if mask is None else (mask[0].contiguous(), mask[1].to(torch.bool).contiguous())
            return (extension().argmax_candidates(x, self.approx(x), self.factors, *grammar, bf16_ties=self.bf16_ties),
                    torch.ones(n, dtype=torch.bool))
        picked = rows.nonzero()[:, 0]
        if mask is None:
            bitmask, flags = torch.full((n, words), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.bool)
        else:
            bitmask, flags = mask[0].clone(), mask[1].clone()
        if len(picked):
            sub = x[picked].contiguous()
            grammar = () if mask is None else (mask[0][picked].contiguous(), mask[1][picked].to(torch.bool).contiguous())
            bitmask[picked] = extension().argmax_candidates(sub, self.approx(sub), self.factors, *grammar,
                                                            bf16_ties=self.bf16_ties)
            flags[picked] = True
        return bitmask, flags


__all__ = ["ArgmaxBound", "BF16_MAX_ROWS", "ENV", "enabled"]
