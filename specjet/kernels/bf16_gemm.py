"""bf16 projections on CPU through specjet's own GEMM (csrc/bf16_gemm.cpp): batch-invariant by construction.

oneDNN's bf16 matmul (kernels/linear.py's ``PackedLinear``) needs a measured row plan to keep a row's bits
whatever the call holds, and reads a one-row call's weights slowly. This kernel computes every row by one
code path: AMX tiles for every call where the CPU has them (a lone row padded to a 16-row tile), else
AVX-512 BF16 (one VDPBF16PS chain per output; a call's rows in blocks of 6 against 64 columns at a time, so
the first block reads those columns' weights from memory and the others from cache; a call of 7 to 10 rows
takes its two blocks through the weights in L1-sized chunks, so both compute beside the stream). The two give
different bits, so a process uses one for all its calls: ``amx`` where the CPU has tiles, ``avx512_bf16``
where it has AVX-512 BF16 alone, oneDNN's plans elsewhere (``default_isa``), or the one
``SPECJET_BF16_GEMM=amx|avx512_bf16|onednn`` names. Needs K a multiple of 32 and N of 16 (every projection
of the supported models); other shapes and a missing extension keep oneDNN.

The weight is packed once, [N / 16, K / 2, 16, 2]: a 16-column group's k-pairs one 64-byte line each. The
torch reference, ``bf16_gemm_reference``, sums in float32 (in another order: a tolerance, not bits). On AMX, a
call of two or three 16-row tiles (a verify's tree of 17-48 nodes) takes two tiles through each weight tile it loads;
a call of several fetches the next column groups' weights into L2 during its later tiles (which read the current
groups from cache), so the weights' stream runs beside the products.

``Bf16x3Linear`` (feature extraction and the DFlash label pass only) runs a float32 weight on the same tiles as three
bf16 products each, float32 to ~2^-16 a product (``bf16x3_gemm_reference`` is its float64 emulation).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specjet.kernels import cpu_ops
from specjet.kernels.isa_choice import forced_isa, offered_isas

ISA_ENV = "SPECJET_BF16_GEMM"
ISAS = {"onednn": 0, "avx512_bf16": 1, "amx": 2}  # onednn: not this kernel (kernels/linear.py's plans)
COLS, DEPTH = 16, 32  # columns of a packed group; the K multiple the tiles take
# A grammar-masked row allowing at most this many columns has them computed alone (Bf16Linear.masked): each
# costs at most its 16-column group's chains (a few hundred instructions), while any full row of an LM head
# streams the whole weight (56 MB for the default model's) or, in a verify, does 49,152 columns' work.
MASKED_MAX_ALLOWED = 256


def supported_isas() -> list[str]:
    return offered_isas(ISAS, "bf16_gemm_isa_supported", "bf16_gemm")


@functools.lru_cache(maxsize=1)
def default_isa() -> str:
    """``SPECJET_BF16_GEMM`` if set (refused with the reason where this CPU lacks it), else the fastest this CPU
    runs: ``amx`` where it has the tiles, ``avx512_bf16`` where it has AVX-512 BF16 alone (a one-row call, a
    plain decode step, reads the weights faster than oneDNN's, and with the weights of 64 columns read once
    for all of a call's rows, verifies and prefills are no slower either: bench/RESULTS.md, session 48),
    oneDNN elsewhere."""
    available = supported_isas()
    return forced_isa(ISA_ENV, ISAS, available) or next(isa for isa in ("amx", "avx512_bf16", "onednn")
                                                         if isa in available)


def applies(weight_t: torch.Tensor, isa: str | None = None) -> bool:
    """Whether a [in, out] weight runs on this kernel (else oneDNN's plans)."""
    isa = default_isa() if isa is None else isa
    return (isa != "onednn" and weight_t.device.type == "cpu" and weight_t.dtype == torch.bfloat16
            and weight_t.dim() == 2 and weight_t.shape[0] % DEPTH == 0 and weight_t.shape[1] % COLS == 0)


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [N / 16, K / 2, 16, 2]: element [g, p, c, j] = weight_t[2p + j, 16g + c]."""
    k, n = weight_t.shape
    return weight_t.detach().reshape(k // 2, 2, n // COLS, COLS).permute(2, 0, 3, 1).contiguous()


def bf16_gemm_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight_t.float()
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


@dataclass
class Bf16Linear:
    """A packed bf16 weight and the instruction set its calls run on (one per process)."""

    weight: torch.Tensor  # [N / 16, K / 2, 16, 2] bf16
    bias: torch.Tensor | None  # float32
    isa: int

    @classmethod
    def build(cls, weight_t: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None) -> "Bf16Linear":
        isa = default_isa() if isa is None else isa
        if isa not in supported_isas():  # a named one this CPU or build lacks: refused here, not at the first call
            raise ValueError(f"bf16 GEMM: isa {isa!r} is not available here (available: {supported_isas()})")
        if not applies(weight_t, isa):
            raise ValueError(f"bf16 GEMM ({isa}): weight {tuple(weight_t.shape)} {weight_t.dtype} does not apply")
        return cls(pack(weight_t), None if bias is None else bias.detach().float().contiguous(), ISAS[isa])

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] * COLS

    def weight_t(self) -> torch.Tensor:
        """The [in, out] weight this operand packs (a copy; ``pack``'s inverse)."""
        groups, pairs = self.weight.shape[:2]
        return self.weight.permute(1, 3, 0, 2).reshape(2 * pairs, groups * COLS).contiguous()

    @property
    def has_masked_kernel(self) -> bool:
        """Whether ``masked`` computes rows' allowed columns alone: the VDPBF16PS kernel, whose every output
        is its own chain (an AMX tile's sums are not recomputed column by column here)."""
        return self.isa == ISAS["avx512_bf16"] and hasattr(cpu_ops.extension(), "bf16_gemm_masked")

    def masked(self, x: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor,
               max_allowed: int = MASKED_MAX_ALLOWED) -> torch.Tensor | None:
        """``self(x).float()`` for rows x [R, K] whose outputs a grammar restricts (an LM head's): a row with
        ``masked`` set whose ``bitmask`` row (int32 [R, W], token t = bit t % 32 of word t // 32) allows at
        most ``max_allowed`` columns gets those columns, with the bits ``self(x)`` gives them, and -inf
        elsewhere (where the mask puts -inf anyway); the other rows are ``self(x)``'s. Where every row is such
        a row, the weight is read only for the allowed columns' groups. None: no such kernel (AMX)."""
        if not self.has_masked_kernel:
            return None
        x = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        return cpu_ops.extension().bf16_gemm_masked(x, self.weight, self.bias, self.isa, bitmask.contiguous(),
                                                    masked.contiguous(), max_allowed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ext = cpu_ops.extension()
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():
            return ext.bf16_gemm(x, self.weight, self.bias, self.isa)
        lead, dtype = x.shape[:-1], x.dtype
        y = ext.bf16_gemm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous(), self.weight, self.bias, self.isa)
        return y.to(dtype).reshape(*lead, y.shape[-1])


def bf16x3_available() -> bool:
    """Whether this CPU (and the built extension) runs ``Bf16x3Linear``: AMX tiles."""
    ext = cpu_ops.extension()
    return ext is not None and hasattr(ext, "bf16x3_gemm") and ext.bf16_gemm_isa_supported(ISAS["amx"])


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``t`` as hi + lo, both bf16: hi = t rounded to bf16 (to nearest even), lo = the rest rounded
    to bf16 (zero where t is not finite), so hi + lo holds ~16 of t's 24 significant bits."""
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    return hi, torch.where(torch.isfinite(rest), rest, torch.zeros_like(rest)).to(torch.bfloat16)


def bf16x3_gemm_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``Bf16x3Linear`` computes, in float64: hi(x) hi(W) + hi(x) lo(W) + lo(x) hi(W) (+ bias)."""
    xh, xl = (t.double() for t in split_bf16(x.float()))
    wh, wl = (t.double() for t in split_bf16(weight_t.float()))
    y = xh @ wh + xh @ wl + xl @ wh
    return (y if bias is None else y + bias.double()).float()


@dataclass
class Bf16x3Linear:
    """A float32 weight computed on AMX tiles as three bf16 products (csrc/bf16_gemm.cpp's ``bf16x3_gemm``):
    x @ W ~ hi(x) hi(W) + hi(x) lo(W) + lo(x) hi(W), summed in float32, where hi + lo splits a float into two
    bf16 (``split_bf16``). Each product is then within ~2^-16 of its float32 value (the lo(x) lo(W) term
    left out and the bits past lo's), against bf16's 2^-8: float32 features for a draft's training (which
    keeps them in fp16, 2^-11) at ~1.1-1.4x oneDNN's float32 speed here (bench/RESULTS.md, session 66). One bf16
    GEMM over [hi(x) | hi(x) | lo(x)] and [hi(W); lo(W); hi(W)], K tripled, read from [hi | lo] copies of both
    (the weight packed once as [hi(W); lo(W)]: float32's bytes). Not batch-invariant by contract (no decoding
    model uses it), though each row is its own tile's sums."""

    weight: torch.Tensor  # [N / 16, K, 16, 2] bf16: pack([hi(W); lo(W)])
    bias: torch.Tensor | None  # float32

    @staticmethod
    def applies(weight_t: torch.Tensor) -> bool:
        """Whether a [in, out] weight runs on this kernel here (a float32 CPU weight of the tiles' shape)."""
        return (weight_t.device.type == "cpu" and weight_t.dtype == torch.float32 and weight_t.dim() == 2
                and weight_t.shape[0] % DEPTH == 0 and weight_t.shape[1] % COLS == 0 and bf16x3_available())

    @classmethod
    def build(cls, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> "Bf16x3Linear":
        if not cls.applies(weight_t):
            raise ValueError(f"bf16x3 GEMM: weight {tuple(weight_t.shape)} {weight_t.dtype} does not apply here")
        hi, lo = split_bf16(weight_t.detach())
        return cls(pack(torch.cat([hi, lo])), None if bias is None else bias.detach().float().contiguous())

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] * COLS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        y = cpu_ops.extension().bf16x3_gemm(x.reshape(-1, x.shape[-1]).float().contiguous(), self.weight, self.bias)
        return y.to(dtype).reshape(*lead, y.shape[-1])


def describe_kernels() -> str:
    isa = default_isa()
    return ("bf16 projections: oneDNN's measured row plans" if isa == "onednn"
            else f"bf16 projections: specjet's {isa} GEMM (where K % 32 == 0 and N % 16 == 0)")


__all__ = ["Bf16Linear", "Bf16x3Linear", "applies", "bf16_gemm_reference", "bf16x3_available", "bf16x3_gemm_reference",
           "default_isa", "describe_kernels", "pack", "split_bf16", "supported_isas"]
