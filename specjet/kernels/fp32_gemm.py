"""float32 projections on CPU through specjet's own GEMM (csrc/fp32_gemm.cpp): batch-invariant by construction.

oneDNN's float32 matmul (kernels/linear.py's ``PackedLinear``) keeps a row's bits only under a measured row plan,
and a call of a few rows costs it about the weights' stream plus every row's products: a verify's rows are
dear. Here every output is one chain of fused multiply-adds over k in order, from zero, then + bias, whatever
else the call holds, and a call's rows share each weight line it loads while the stream runs ahead of them
(one-row calls at the memory's pace, a verify's rows at little more until their products outlast it; figures
in bench/RESULTS.md, session 99). AVX-512F and AVX2 + FMA builds make the same operations lane for lane, so
they give the same bits: ``SPECJET_FP32_GEMM=avx512|avx2|onednn`` picks one (``onednn``: not this kernel),
else the widest the CPU runs. Needs N a multiple of 16 (every projection of the supported models); other
shapes and a missing extension keep oneDNN.

The weight is packed once, [N / 16, K, 16]: a 16-column group's row k one 64-byte line, each group one
sequential stream. ``fp32_gemm_reference`` is the torch product (another summation order: a tolerance, not
bits). ``Fp32Linear.masked`` gives an LM head's grammar-masked rows only the columns their grammar allows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specjet.kernels import cpu_ops
from specjet.kernels.isa_choice import forced_isa, offered_isas

ISA_ENV = "SPECJET_FP32_GEMM"
ISAS = {"onednn": 0, "avx2": 1, "avx512": 2}  # onednn: not this kernel (kernels/linear.py's plans)
COLS = 16  # columns of a packed group
# A grammar-masked row allowing at most this many columns has them computed alone (Fp32Linear.masked): each costs
# its 16-column group's chains, while any full row of an LM head streams the whole weight (113 MB for the default
# model's in float32).
MASKED_MAX_ALLOWED = 256


def supported_isas() -> list[str]:
    return offered_isas(ISAS, "fp32_gemm_isa_supported", "fp32_gemm")


@functools.lru_cache(maxsize=1)
def default_isa() -> str:
    """``SPECJET_FP32_GEMM`` if set (refused with the reason where this CPU lacks it), else the widest this CPU
    runs (AVX-512F, then AVX2 + FMA), oneDNN only where neither runs or the extension is missing."""
    available = supported_isas()
    return forced_isa(ISA_ENV, ISAS, available) or next(isa for isa in ("avx512", "avx2", "onednn") if isa in available)


def applies(weight_t: torch.Tensor, isa: str | None = None) -> bool:
    """Whether a [in, out] weight runs on this kernel (else oneDNN's plans)."""
    isa = default_isa() if isa is None else isa
    return (isa != "onednn" and weight_t.device.type == "cpu" and weight_t.dtype == torch.float32
            and weight_t.dim() == 2 and weight_t.shape[1] % COLS == 0)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [N / 16, K, 16]: element [g, k, c] = weight_t[k, 16g + c]."""
    k, n = weight_t.shape
    return weight_t.detach().reshape(k, n // COLS, COLS).permute(1, 0, 2).contiguous()


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: [N / 16, K, 16] -> [K, N]."""
    groups, k, _ = weight.shape
    return weight.permute(1, 0, 2).reshape(k, groups * COLS).contiguous()


def fp32_gemm_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight_t.float()
    return y if bias is None else y + bias.float()


@dataclass
class Fp32Linear:
    """A packed float32 weight and the instruction set its calls run on (either gives the same bits)."""

    weight: torch.Tensor  # [N / 16, K, 16] float32
    bias: torch.Tensor | None  # float32
    isa: int

    @classmethod
    def build(cls, weight_t: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None) -> "Fp32Linear":
        isa = default_isa() if isa is None else isa
        if isa not in supported_isas():  # a named one this CPU or build lacks: refused here, not at the first call
            raise ValueError(f"float32 GEMM: isa {isa!r} is not available here (available: {supported_isas()})")
        if not applies(weight_t, isa):
            raise ValueError(f"float32 GEMM ({isa}): weight {tuple(weight_t.shape)} {weight_t.dtype} does not apply")
        return cls(pack(weight_t), None if bias is None else bias.detach().float().contiguous(), ISAS[isa])

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] * COLS

    def weight_t(self) -> torch.Tensor:
        """The [in, out] weight this operand packs (a copy)."""
        return unpack(self.weight)

    @property
    def has_masked_kernel(self) -> bool:
        """Whether ``masked`` computes rows' allowed columns alone (the extension's ``fp32_gemm_masked``)."""
        return hasattr(cpu_ops.extension(), "fp32_gemm_masked")

    def masked(self, x: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor,
               max_allowed: int = MASKED_MAX_ALLOWED) -> torch.Tensor | None:
        """``self(x)`` for rows x [R, K] whose outputs a grammar restricts (an LM head's): a row with ``masked``
        set whose ``bitmask`` row (int32 [R, W], token t = bit t % 32 of word t // 32) allows at most
        ``max_allowed`` columns gets those columns, with the bits ``self(x)`` gives them, and -inf elsewhere (where
        the mask puts -inf anyway); the other rows are ``self(x)``'s. Where every row is such a row, the weight is
        read only for the allowed columns' groups. None: no such kernel (an extension without it)."""
        if not self.has_masked_kernel:
            return None
        x = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return cpu_ops.extension().fp32_gemm_masked(x, self.weight, self.bias, self.isa, bitmask.contiguous(),
                                                    masked.contiguous(), max_allowed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ext = cpu_ops.extension()
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return ext.fp32_gemm(x, self.weight, self.bias, self.isa)
        lead, dtype = x.shape[:-1], x.dtype
        y = ext.fp32_gemm(x.reshape(-1, x.shape[-1]).float().contiguous(), self.weight, self.bias, self.isa)
        return y.to(dtype).reshape(*lead, y.shape[-1])


def describe_kernels() -> str:
    isa = default_isa()
    return ("float32 projections: oneDNN's measured row plans" if isa == "onednn"
            else f"float32 projections: specjet's {isa} GEMM (where N % 16 == 0)")


__all__ = ["Fp32Linear", "applies", "default_isa", "describe_kernels", "fp32_gemm_reference", "pack", "supported_isas",
           "unpack"]
