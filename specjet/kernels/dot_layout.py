"""The quantized weights as the GEMM kernels read them (csrc/qgemm_body.h), and the arithmetic the
kernels perform, written in torch as their reference.

The kernels multiply int8 activations by the weights' integer codes with dot-product instructions,
one output column per vector lane: a packed group holds 16 columns, and for each 32-weight block
eight *steps* of 4 consecutive codes per column (64 bytes a step, column j at bytes 4j..4j+3).

- ``DotQ41``: Q4_1 codes, two steps per byte (chunk c's low nibbles are step c, its high nibbles step
  c + 4): qs uint8 [G, K/32, 4, 64], d and m fp16 [G, K/32, 16].
- ``DotInt8``: int8 codes: q int8 [G, K/32, 8, 64], s fp16 [G, K/group, 16], and wsum int32
  [G, K/32, 16] = each column's sum of codes per block (the VNNI kernel's unsigned-input correction).

N is padded to whole groups with zero columns, never written out. ``pack`` / ``unpack`` convert from
and to quant_formats' row-major blocks (a permutation: nothing is rounded).

Activations: per row and 32-block, dx = max|x| / 127 and xq = round_half_even(x / dx) in int8
(``quantize_activations``, computed as 127 / max|x| then a product, exactly as the C++ does). A
block then contributes d * dx * sum(q * xq) + m * dx * sum(xq) (Q4_1) or s * dx * sum(q * xq) (int8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.kernels.quant_formats import BLOCK, Int8Weight, Q41Weight, QuantWeight

GROUP = 16  # columns per packed group
STEP = 4  # codes per column per step


def _groups(n: int) -> int:
    return -(-n // GROUP)


def _pad_columns(t: torch.Tensor, n: int) -> torch.Tensor:
    padded = _groups(n) * GROUP
    return t if padded == n else torch.cat([t, t.new_zeros((padded - n, *t.shape[1:]))])


def _per_group(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, X] -> [G, X, 16]: a per-column, per-block value laid out by group, block, lane."""
    return _pad_columns(t, n).view(_groups(n), GROUP, -1).transpose(1, 2).contiguous()


def _from_group(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].contiguous()


def _steps(codes: torch.Tensor, n: int) -> torch.Tensor:
    """[N, K] codes -> [G, K/32, 8, 64]: steps of 4 codes for each of a group's 16 columns."""
    k = codes.shape[1]
    c = _pad_columns(codes, n).view(_groups(n), GROUP, k // BLOCK, BLOCK // STEP, STEP)
    return c.permute(0, 2, 3, 1, 4).reshape(_groups(n), k // BLOCK, BLOCK // STEP, GROUP * STEP).contiguous()


def _from_steps(steps: torch.Tensor, n: int) -> torch.Tensor:
    g, nb = steps.shape[:2]
    c = steps.view(g, nb, BLOCK // STEP, GROUP, STEP).permute(0, 3, 1, 2, 4)
    return c.reshape(g * GROUP, nb * BLOCK)[:n].contiguous()


@dataclass(frozen=True)
class DotQ41:
    qs: torch.Tensor  # uint8 [G, K/32, 4, 64]
    d: torch.Tensor  # float16 [G, K/32, 16]
    m: torch.Tensor
    n: int  # columns (the padding excluded)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.qs.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


@dataclass(frozen=True)
class DotInt8:
    q: torch.Tensor  # int8 [G, K/32, 8, 64]
    s: torch.Tensor  # float16 [G, K/group, 16]
    wsum: torch.Tensor  # int32 [G, K/32, 16]
    group: int
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.wsum))


DotWeight = DotQ41 | DotInt8


def pack(weight: QuantWeight) -> DotWeight:
    n, _ = weight.shape
    if isinstance(weight, Q41Weight):
        steps = _steps(weight.codes(), n)  # [G, nb, 8, 64], codes 0..15
        qs = steps[:, :, :4] | (steps[:, :, 4:] << 4)
        return DotQ41(qs.contiguous(), _per_group(weight.d, n), _per_group(weight.m, n), n)
    q = weight.q
    wsum = q.view(n, -1, BLOCK).sum(-1, dtype=torch.int32)
    return DotInt8(_steps(q, n), _per_group(weight.s, n), _per_group(wsum, n), weight.group, n)


def unpack(packed: DotWeight) -> QuantWeight:
    n, k = packed.shape
    if isinstance(packed, DotQ41):
        steps = torch.cat([packed.qs & 0x0F, packed.qs >> 4], dim=2)
        codes = _from_steps(steps, n).view(n, k // BLOCK, BLOCK)
        qs = codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
        return Q41Weight(qs.reshape(n, k // 2).contiguous(), _from_group(packed.d, n), _from_group(packed.m, n))
    return Int8Weight(_from_steps(packed.q, n), _from_group(packed.s, n), packed.group)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq int8 [M, K], dx float32 [M, K/32], sx = dx * Σ xq float32 [M, K/32]).
    Q4_1's minimum multiplies sx, the quantized block's sum (csrc/qgemm.cpp says why not the exact one)."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    # tensor / tensor: torch turns a division by (or of) a Python scalar into a product with a
    # reciprocal, one rounding off the C++'s true division.
    c127 = torch.full_like(amax, 127)
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, 1), 0)
    xq = (xb * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    dx = amax / c127
    return xq.view(m, k), dx, dx * xq.sum(-1, dtype=torch.int32).float()


def reference_gemm(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernels compute, in float64 after exact integer block sums: [M, N] float64."""
    n, k = weight.shape
    nb = k // BLOCK
    xq, dx, sx = quantize_activations(x)
    codes = (weight.codes() if isinstance(weight, Q41Weight) else weight.q).to(torch.int64).view(n, nb, BLOCK)
    isum = torch.einsum("mbi,nbi->mnb", xq.to(torch.int64).view(-1, nb, BLOCK), codes).double()
    if isinstance(weight, Q41Weight):
        scale, minimum = weight.d.double(), weight.m.double()
        y = (isum * scale[None] * dx.double()[:, None]).sum(-1) + sx.double() @ minimum.t()
    else:
        scale = weight.s.double().repeat_interleave(weight.group // BLOCK, dim=1)
        y = (isum * scale[None] * dx.double()[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


def error_bound(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """A bound on a kernel's fp32 rounding against ``reference_gemm``: 1e-5 of the sum of the terms'
    magnitudes (48 fp32 fmas per element stay far inside it; a wrong block or code does not)."""
    return 1e-5 * (x.abs().double() @ weight.dequantize().abs().double().t()) + 1e-6


__all__ = ["DotInt8", "DotQ41", "DotWeight", "GROUP", "error_bound", "pack", "quantize_activations",
           "reference_gemm", "unpack"]
