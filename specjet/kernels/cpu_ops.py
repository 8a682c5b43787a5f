"""specjet's C++ CPU ops (extension ``specjet.kernels._cpu_ops``, sources csrc/attention.cpp and
csrc/layer_ops.cpp): the float32 paged attention, and RMSNorm / RoPE + KV write / SiLU-and-multiply,
each one call where torch needs a dozen small ops (models/llama.py's inference path uses them).

The attention has the math of the torch path in attention.py (in float32 lanes where that one sums in
float64: the tests hold them close) and the same invariance, by construction: a
query row is computed by one thread from its own q and the keys it may see, read in place from the
KV pool in position order. It replaces the torch path's per-layer gather, float64 copy of every
visible key and dozen small ops, which dominate a decode step at small batches.

Every instruction set's lanes build gives the same bits (csrc/attention_body.h), so the widest one this CPU
runs is used; ``SPECJET_ATTENTION_ISA=bf16dp|amx|avx512|avx2|base`` forces one. On a CPU with AVX-512 BF16 (Zen 4/5,
Xeons since Cooper Lake) the default is ``bf16dp``: avx512 with a bf16 pool's products by VDPBF16PS, the scores on q
rounded to bf16 and the weights x V on the softmax weights rounded to bf16 (llama.cpp's CPU attention rounds them
to f16, 11 bits to bf16's 8; over 3,200 positions of text the GGUF model's top-1 agreement with the float32 model
moved from 95.37% to 95.22%), for bf16 pools whose head_dim is a multiple of 32 (float32 pools and other head_dims
take the avx512 lanes). Its own bits, as invariant as the lanes' (every path of it the same: a verify's rows are
their decode steps', on a CPU whose VDPBF16PS adds a word's two products in Intel's order, which the extension
checks once: csrc/dpbf16_order.h; a CPU that does not gets the avx512 lanes), an error of the order of the bf16
pool's own; long-context verifies ~0.86x, decode steps ~0.9-1.0x (bench/RESULTS.md sessions 76-77). ``amx``
(CPUs with AMX-BF16; only when asked for) is avx512 with a bf16 pool's
scores on AMX tiles (q split into bf16 hi + lo, ~16 bits of it): its own bits for bf16 pools, as invariant; a
verify's attention at long contexts ~0.85x, a decode step's the same or slower (session 70), so not the default.
The layer ops are batch-invariant
the same way (one row, one thread, a fixed order). ``SPECJET_CPU_OPS=torch`` turns the extension off
(the torch ops then run everything). Built at install by setup.py; without it
the torch path runs and a line in the log says so.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from specjet.kernels.attention_metadata import AttentionMetadata

# What a user who has no extension does about it, whether specjet came from a checkout, a path or a wheel.
REBUILD_HINT = ("Reinstall specjet where a C++ compiler is present, after torch: `pip install --no-build-isolation "
                "<specjet's source folder>` (scripts/setup.sh in a checkout).")

logger = logging.getLogger(__name__)

ISAS = {"base": 0, "avx2": 1, "avx512": 2, "amx": 3, "bf16dp": 4}
# Builds with their own bits for bf16 pools (not the lanes' bits).
OWN_BITS = ("amx", "bf16dp")
# Builds taken only when asked for (ISA_ENV); the widest of the others this CPU runs is the default.
ASKED_FOR_ONLY = ("amx",)
BACKEND_ENV = "SPECJET_CPU_OPS"
ISA_ENV = "SPECJET_ATTENTION_ISA"


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled module, or None when it is not built or turned off (logged once)."""
    backend = os.environ.get(BACKEND_ENV, "").strip().lower()
    if backend not in ("", "native", "torch"):
        raise ValueError(f"{BACKEND_ENV}={backend!r}: use native or torch")
    if backend == "torch":
        return None
    try:
        from specjet.kernels import _cpu_ops
    except ImportError as err:
        logger.warning("specjet's C++ CPU ops are not built (%s); attention and the layers' small ops run as "
                       "torch ops (slower at small batches). %s", err, REBUILD_HINT)
        return None
    return _cpu_ops


@functools.lru_cache(maxsize=1)
def isa() -> int:
    ext = extension()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISAS or ext is None or not ext.isa_supported(ISAS[forced]):
            why = ""
            if forced == "bf16dp" and ext is not None and ext.bf16_gemm_isa_supported(1):
                why = (" (this CPU has AVX-512 BF16, but its VDPBF16PS does not add a word's two products in the "
                       "order the bf16dp build's invariance needs: csrc/dpbf16_order.h)")
            raise ValueError(f"{ISA_ENV}={forced!r}: use one of {', '.join(ISAS)} that this CPU runs{why}")
        return ISAS[forced]
    return max(code for name, code in ISAS.items()
               if name not in ASKED_FOR_ONLY and ext is not None and ext.isa_supported(code))


def describe_attention(kv_dtype: torch.dtype, head_dim: int) -> str:
    """The CPU attention this process runs over a pool of ``kv_dtype`` and ``head_dim`` (the start-up log says it: on
    a CPU with AVX-512 BF16 the default build's bf16 products move every output by about the bf16 pool's own error)."""
    if extension() is None:
        return "attention: torch ops (the C++ ops are not built)"
    name = next(n for n, code in ISAS.items() if code == isa())
    own = name in OWN_BITS and kv_dtype == torch.bfloat16 and (name != "bf16dp" or head_dim % 32 == 0)
    how = {"amx": "bf16 scores on AMX tiles", "bf16dp": "bf16 products (q and the softmax weights rounded to bf16)"}
    if name == "bf16dp" and extension().bf16dp_tile_products() == 1:  # Intel's cores: the same bits, faster there
        how["bf16dp"] += ", a verify tile's as two FMAs each"
    forced = f"{ISA_ENV}" if os.environ.get(ISA_ENV, "").strip() else "auto"
    return f"attention: {name} build ({forced}), {how[name] if own else 'float32 lanes'}"


def native_attention_available(q: torch.Tensor | None = None, k_cache: torch.Tensor | None = None) -> bool:
    """Whether the kernel is built (and, given tensors, takes them: CPU, float32 or bfloat16)."""
    if extension() is None:
        return False
    return all(t is None or (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16))
               for t in (q, k_cache))


def native_attention_args(meta: AttentionMetadata) -> tuple:
    """The kernel's metadata arguments (kv_indices, kv_lens, q_lens, q_starts, mask), built once per
    metadata: every layer of a forward passes the same."""
    if meta.native_args is None:
        mask = meta.custom_mask
        if mask is not None:
            mask = mask.to(torch.bool).contiguous()
        meta.native_args = (meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens, meta.q_starts, mask)
    return meta.native_args


def native_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """q [T, H, D] (the batch's new tokens in order), caches [slots, H_kv, D] -> [T, H, D]."""
    return extension().paged_attention(q.contiguous(), k_cache, v_cache, *native_attention_args(meta), float(scale),
                                       isa())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """weight * x / rms(x) per row of x [T, N]; with ``residual``: (x + residual, its norm)."""
    outs = extension().rms_norm(x, weight, float(eps), residual)
    return outs[0] if residual is None else (outs[0], outs[1])


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """From fused q|k|v rows [T, (H + 2 KV) D]: writes RoPE(k) and v to ``slots`` of the layer's pool,
    returns RoPE(q) [T, H, D]."""
    return extension().rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [T, 2 I] holding gate | up."""
    return extension().silu_mul(gate_up)


__all__ = ["native_attention", "native_attention_available", "rms_norm", "rope_store", "silu_mul"]
