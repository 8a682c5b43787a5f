"""A model's packed inference weights moved into one buffer, on huge pages where Linux allows them.

A decode step at batch 1 streams every packed weight of the model through the cores once. Packed
one projection at a time, the weights lie wherever the allocator put each (a few hundred KB to a
few MB apiece), on 4 KiB pages: the stream then crosses a page every 4 KiB, and a page walk (and
the restart of the hardware prefetcher, which stops at page boundaries) with it. Copied in model
order into one 2 MiB-aligned buffer that the kernel is asked to back with transparent huge pages
(``madvise(MADV_HUGEPAGE)``; honoured where THP is ``always`` or ``madvise``), the same weights stream
faster, partly from the contiguity alone and partly from the huge pages (bench/RESULTS.md, session 49).

The copies hold the same bytes, so every output keeps its bits. Only operands that own their memory
move: specjet's quantized blocks (``QuantizedLinear``) and packed bf16 and float32 weights (``Bf16Linear``,
``Fp32Linear``). A
oneDNN-blocked float weight has no storage torch exposes, and a dense one is the parameter itself;
both stay. Call ``gather_operands`` after the weights are packed and before anything keeps a reference
to them (the C++ layer stack: ``use_native_ops`` builds it afterwards).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys

import torch
from torch import nn

from specjet.kernels.bf16_gemm import Bf16Linear
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.qgemm import QuantizedLinear

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each operand starts on a cache line
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _operand_tensors(packed) -> dict[str, torch.Tensor]:
    """The tensors of a packed operand that move: field name -> tensor (the weight's blocks and scales,
    and the bias)."""
    out = {}
    weight = packed.weight
    if isinstance(weight, torch.Tensor):
        out["weight"] = weight
    else:  # a DotQ41 / DotInt8: blocks, scales, minima or sums
        out.update({f"weight.{f.name}": getattr(weight, f.name) for f in dataclasses.fields(weight)
                    if isinstance(getattr(weight, f.name), torch.Tensor)})
    if packed.bias is not None:
        out["bias"] = packed.bias
    return out


def _with_tensors(packed, tensors: dict[str, torch.Tensor]):
    """``packed`` with its tensors replaced (``_operand_tensors``' names)."""
    weight = packed.weight
    if isinstance(weight, torch.Tensor):
        weight = tensors["weight"]
    else:
        weight = dataclasses.replace(weight, **{name.split(".", 1)[1]: t for name, t in tensors.items()
                                                if name.startswith("weight.")})
    return dataclasses.replace(packed, weight=weight, bias=tensors.get("bias", packed.bias))


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages of ``buffer`` (a CPU tensor not yet written) with
    transparent huge pages. False where that cannot be asked (not Linux, no libc, an error)."""
    if not sys.platform.startswith("linux"):
        return False
    start = (buffer.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def gather_operands(model: nn.Module) -> torch.Tensor | None:
    """Move the packed CPU operands of ``model``'s modules (``module.packed``, in module order) into one
    buffer, 2 MiB-aligned and advised for huge pages; returns the buffer (None: nothing to move). The
    operands become views of it (they keep it alive); their old memory is freed once nothing else holds it."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "packed", None), (QuantizedLinear, Bf16Linear, Fp32Linear))]
    modules = [m for m in modules if all(t.device.type == "cpu" and t.is_contiguous()
                                         for t in _operand_tensors(m.packed).values())]
    if not modules:
        return None
    sizes = [sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in _operand_tensors(m.packed).values())
             for m in modules]
    total = sum(sizes)
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # untouched: the advice comes before the first write
    skip = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[skip:skip + total]
    huge = advise_huge_pages(buffer)
    offset = 0
    for module in modules:
        moved = {}
        for name, t in _operand_tensors(module.packed).items():
            nbytes = t.numel() * t.element_size()
            view = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            moved[name] = view
            offset += -(-nbytes // ALIGN) * ALIGN
        module.packed = _with_tensors(module.packed, moved)
    logger.info("packed weights gathered into one %.1f MB buffer (%s)", total / 2**20,
                "huge pages advised" if huge else "no huge-page advice on this system")
    return buffer
