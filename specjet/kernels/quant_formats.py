"""Quantized weight formats, how to make them from float weights, and how to read them back.

Both formats cut each output column's K weights into blocks of 32 consecutive weights (K a multiple
of 32), the layout of llama.cpp's GGUF blocks, so a GGUF file's own blocks load without conversion:

- ``Q41Weight``: 4-bit codes q in 0..15 with an fp16 scale d and an fp16 minimum m per block,
  w = d * q + m (GGUF Q4_1). Byte i of a block holds weight i in its low nibble and weight i + 16
  in its high nibble.
- ``Int8Weight``: int8 codes with one fp16 scale per ``group`` weights, w = s * q. group = 32 is
  GGUF Q8_0; group = K is one scale per output channel.

``dequantize`` is the reference every kernel is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class Q41Weight:
    qs: torch.Tensor  # uint8 [N, K / 2]
    d: torch.Tensor  # float16 [N, K / 32]
    m: torch.Tensor  # float16 [N, K / 32]

    @property
    def shape(self) -> tuple[int, int]:  # (N, K) of the weight it stands for
        return self.qs.shape[0], self.qs.shape[1] * 2

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as uint8 [N, K] in weight order."""
        n, k = self.shape
        blocks = self.qs.view(n, k // BLOCK, BLOCK // 2)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.codes().view(n, k // BLOCK, BLOCK).float()
        return (q * self.d.float()[..., None] + self.m.float()[..., None]).reshape(n, k)

    def select_rows(self, rows: torch.Tensor) -> "Q41Weight":
        return Q41Weight(self.qs[rows].contiguous(), self.d[rows].contiguous(), self.m[rows].contiguous())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    s: torch.Tensor  # float16 [N, K / group]
    group: int  # a multiple of 32 that divides K

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.q.view(n, k // self.group, self.group).float()
        return (q * self.s.float()[..., None]).reshape(n, k)

    def select_rows(self, rows: torch.Tensor) -> "Int8Weight":
        return Int8Weight(self.q[rows].contiguous(), self.s[rows].contiguous(), self.group)

    def nbytes(self) -> int:
        return self.q.numel() + self.s.numel() * 2


QuantWeight = Q41Weight | Int8Weight


def _check_shape(weight: torch.Tensor, group: int) -> None:
    if weight.dim() != 2 or weight.shape[1] % group or group % BLOCK:
        raise ValueError(f"a quantized weight is [N, K] with K a multiple of {group} (groups of a multiple of "
                         f"{BLOCK}), got shape {tuple(weight.shape)}")


def quantize_q4_1(weight: torch.Tensor) -> Q41Weight:
    """[N, K] float -> Q4_1 blocks: d = (max - min) / 15 and m = min per block (as llama.cpp), the codes
    rounded against the fp16-rounded d and m the kernel will use."""
    _check_shape(weight, BLOCK)
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    df = d.float()[..., None]
    q = torch.where(df > 0, (w - m.float()[..., None]) / torch.where(df > 0, df, 1), 0)
    q = q.round().clamp(0, 15).to(torch.uint8)
    qs = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return Q41Weight(qs.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous())


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> Int8Weight:
    """[N, K] float -> symmetric int8 with one scale per ``group`` weights (None: per output channel)."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    group = k if group is None else group
    _check_shape(weight, group)
    w = weight.detach().float().reshape(n, k // group, group)
    s = (w.abs().amax(-1) / 127).half()
    sf = s.float()[..., None]
    q = torch.where(sf > 0, w / torch.where(sf > 0, sf, 1), 0).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.reshape(n, k).contiguous(), s.contiguous(), group)


def reference_gemm(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight)^T (+ bias), in fp32: what every quantized kernel computes."""
    y = x.float() @ weight.dequantize().t()
    return y if bias is None else y + bias.float()
