"""The quantized GEMM kernels (in the C++ extension ``specjet.kernels._cpu_ops``, source csrc/qgemm.cpp) and their dispatch.

``QuantizedLinear`` is a linear layer's inference operand for a quantized weight: called on x
[..., K] it returns x @ W^T (+ bias) in x's dtype, the activations quantized to int8 per 32-block
(llama.cpp's scheme, kernels/dot_layout.py) and the sums accumulated in fp32. It stands where a
``PackedLinear`` stands (``Linear.packed``), and like it is batch-invariant: a row's output has the
same bits whatever other rows share the call, and every instruction set gives the same bits
(csrc/qgemm_body.h says how).

The instruction set is chosen once per process from what ATen dispatches to (so
``ATEN_CPU_CAPABILITY=avx2`` runs the AVX2 kernels on an AVX-512 CPU, as the rest of torch does),
or forced with ``SPECJET_QGEMM_ISA=amx|avx512|avx2|scalar``; never from the row count, which could make
a row's bits depend on its batch (within ``amx``, calls of enough rows take AMX tiles, whose integer
sums are exact and whose float steps are the VNNI kernels': the same bits). The extension is built at
install (setup.py). Without it, each weight is dequantized once and runs through kernels/linear.py's
batch-invariant float path: right, but without the memory savings, and a warning says so.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from specjet.kernels.cpu_ops import REBUILD_HINT
from specjet.kernels.dot_layout import DotInt8, DotQ41, DotWeight, pack, unpack
from specjet.kernels.isa_choice import forced_isa
from specjet.kernels.linear import PackedLinear, pack_weight
from specjet.kernels.quant_formats import Int8Weight, Q41Weight, QuantWeight

logger = logging.getLogger(__name__)

ISA_ENV = "SPECJET_QGEMM_ISA"
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3}  # amx: avx512, and AMX tiles for calls of 8-12+ rows


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled module, or None (logged once) when the package was installed without it."""
    try:
        from specjet.kernels import _cpu_ops
    except ImportError as err:
        logger.warning("specjet's quantized GEMM extension is not built (%s); quantized weights are dequantized "
                       "to float32 and run through the float kernels. %s", err, REBUILD_HINT)
        return None
    return _cpu_ops


def supported_isas() -> list[str]:
    ext = extension()
    return [name for name, code in ISAS.items() if ext is not None and ext.qgemm_isa_supported(code)]


@functools.lru_cache(maxsize=1)
def default_isa() -> str:
    """The widest kernels this CPU runs that ATen would also use here, after ``SPECJET_QGEMM_ISA``."""
    forced = forced_isa(ISA_ENV, ISAS, supported_isas())
    if forced:
        return forced
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    wanted = {"AVX512": ["amx", "avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])
    available = supported_isas()
    return next((isa for isa in wanted if isa in available), "scalar")


def gemm(x: torch.Tensor, weight: DotWeight | QuantWeight, bias: torch.Tensor | None = None,
         isa: str | None = None) -> torch.Tensor:
    """x [M, K] float32 contiguous @ W^T (+ bias) with the extension's kernels; [M, N] float32.
    ``weight`` packed (kernels/dot_layout.py), or row-major blocks packed for this call."""
    ext = extension()
    if ext is None:
        raise RuntimeError("specjet's quantized GEMM extension is not built")
    code = ISAS[isa or default_isa()]
    if isinstance(weight, (Q41Weight, Int8Weight)):
        weight = pack(weight)
    if isinstance(weight, DotQ41):
        return ext.q4_1_gemm(x, weight.qs, weight.d, weight.m, weight.n, bias, code)
    return ext.int8_gemm(x, weight.q, weight.s, weight.wsum, weight.group, weight.n, bias, code)


# A grammar-masked row allowing at most this many columns has them computed alone (QuantizedLinear.masked):
# each costs about a microsecond, while any full row streams the whole weight (tens of MB for an LM head).
MASKED_MAX_ALLOWED = 256


@dataclass
class QuantizedLinear:
    weight: DotWeight  # [N, K] blocks, packed for the kernels
    bias: torch.Tensor | None  # float32 [N]
    fallback: PackedLinear | None = None  # the dequantized weight's float path when the extension is missing

    @classmethod
    def build(cls, weight: QuantWeight, bias: torch.Tensor | None = None) -> "QuantizedLinear":
        bias = None if bias is None else bias.detach().float().contiguous()
        fallback = None
        if extension() is None:
            fallback = pack_weight(weight.dequantize().t().contiguous(), bias)
        return cls(pack(weight), bias, fallback)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def blocks(self) -> QuantWeight:
        """The weight as row-major blocks (quant_formats), e.g. to dequantize it."""
        return unpack(self.weight)

    def select_outputs(self, rows: torch.Tensor) -> "QuantizedLinear":
        """The same layer restricted to some outputs (an EAGLE head's hot-token columns)."""
        return QuantizedLinear.build(self.blocks().select_rows(rows), None if self.bias is None else self.bias[rows])

    @property
    def has_masked_kernel(self) -> bool:
        """Whether ``masked`` computes rows' allowed columns alone (an int8 weight on the extension)."""
        return extension() is not None and self.fallback is None and isinstance(self.weight, DotInt8)

    def masked(self, x: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor,
               max_allowed: int = MASKED_MAX_ALLOWED) -> torch.Tensor | None:
        """``self(x).float()`` for rows x [R, K] whose outputs a grammar restricts (an LM head's): a row with
        ``masked`` set whose ``bitmask`` row (int32 [R, W], token t = bit t % 32 of word t // 32) allows at
        most ``max_allowed`` columns gets those columns, with the bits ``self(x)`` gives them, and -inf
        elsewhere (where the mask puts -inf anyway); the other rows are ``self(x)``'s. Where every row is
        such a row, the weight is never read. None: no such kernel for this weight (the float fallback,
        a Q4_1 weight)."""
        if not self.has_masked_kernel:
            return None
        ext = extension()
        dtype = x.dtype
        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
            x = x.reshape(-1, x.shape[-1]).float().contiguous()
        w = self.weight
        y = ext.int8_gemm_masked(x, w.q, w.s, w.wsum, w.group, w.n, self.bias, ISAS[default_isa()],
                                 bitmask.contiguous(), masked.contiguous(), max_allowed)
        # ``self(x)`` rounds its float32 sums to x's dtype (bf16, fp16 activations): so must every row here, or a
        # row's logits (and its greedy token, where two round to one value) depend on whether a grammar row shares
        # its batch. Returned as float32, as the LM head's logits are.
        return y if dtype == torch.float32 else y.to(dtype).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return gemm(x, self.weight, self.bias)  # a layer's activations: no reshape, no cast
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = self.fallback(x) if self.fallback is not None else gemm(x, self.weight, self.bias)
        return y.to(dtype).reshape(*lead, y.shape[-1])


def describe_kernels() -> str:
    if extension() is None:
        return "quantized GEMM extension missing: dequantized float path"
    return f"quantized GEMM: {default_isa()} kernels"


__all__ = ["Int8Weight", "Q41Weight", "QuantizedLinear", "default_isa", "describe_kernels", "gemm",
           "supported_isas"]
