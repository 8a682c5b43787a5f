"""A model's decoder layers as one C++ call (csrc/layer_stack.cpp), for CPU inference.

The C++ loop makes, layer by layer, the calls a layer's native forward makes from Python
(models/llama.py ``DecoderLayer.forward_native``) with the same kernels and arguments, so its output
has the same bits; it saves the Python between the calls. ``StackLayer`` describes one layer in terms
of this package's operands (``PackedLinear``, ``Bf16Linear``, ``Fp32Linear``, ``QuantizedLinear``); ``build_layer_stack`` turns a
model's layers into the C++ object, or returns None where some operand has no C++ form (a layer
still training, a quantized weight whose extension is missing), and the Python loop runs instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specjet.kernels import cpu_ops, qgemm
from specjet.kernels.attention import native_whole_batch_args
from specjet.kernels.attention_metadata import AttentionMetadata
from specjet.kernels.bf16_gemm import Bf16Linear, Bf16x3Linear
from specjet.kernels.dot_layout import DotQ41
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.linear import PackedLinear

logger = logging.getLogger(__name__)

Q4_1, INT8 = 0, 1  # csrc/layer_stack.cpp's quantized kinds


@dataclass
class StackLayer:
    """What a decoder layer's native forward reads: its norms and its four projections' operands."""
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: object  # PackedLinear | Bf16Linear | Fp32Linear | QuantizedLinear | None (training: no inference operand)
    o: object
    gate_up: object
    down: object


def stack_projection(packed, ext=None):
    """The C++ form (a StackProjection) of an inference operand (``PackedLinear``, ``Bf16Linear``, ``Fp32Linear``,
    ``Bf16x3Linear``, ``QuantizedLinear``), or None: no C++ form, or no extension."""
    ext = ext or cpu_ops.extension()
    if ext is None or not hasattr(ext, "LayerStack"):
        return None
    if isinstance(packed, qgemm.QuantizedLinear):
        if packed.fallback is not None:
            return None
        w, code = packed.weight, qgemm.ISAS[qgemm.default_isa()]
        if isinstance(w, DotQ41):
            return ext.quantized_projection(Q4_1, w.qs, w.d, w.m, w.n, 0, packed.bias, code)
        return ext.quantized_projection(INT8, w.q, w.s, w.wsum, w.n, w.group, packed.bias, code)
    if isinstance(packed, Bf16Linear):
        return ext.bf16_projection(packed.weight, packed.bias, packed.isa)
    if isinstance(packed, Fp32Linear):
        return ext.fp32_projection(packed.weight, packed.bias, packed.isa)
    if isinstance(packed, Bf16x3Linear):
        return ext.bf16x3_projection(packed.weight, packed.bias)
    if isinstance(packed, PackedLinear):
        return ext.float_projection(packed.weight, packed.bias, packed.blocked, packed.min_rows, packed.max_rows)
    return None


def build_layer_stack(layers: list[StackLayer], num_heads: int, head_dim: int, scale: float):
    """The C++ stack of ``layers``, or None when the extension is missing, an operand has no C++ form,
    or the C++ side refuses one (e.g. a torch whose oneDNN op it cannot call: logged)."""
    ext = cpu_ops.extension()
    if ext is None or not hasattr(ext, "LayerStack"):
        return None
    stack = ext.LayerStack(num_heads, head_dim, float(scale))
    try:
        for layer in layers:
            projections = [stack_projection(p, ext) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in projections):
                return None
            stack.add_layer(layer.norm1, float(layer.eps1), layer.norm2, float(layer.eps2), *projections)
    except RuntimeError as err:
        logger.warning("the C++ layer stack is off (%s); the layers run one call at a time", err)
        return None
    return stack


def run_layer_stack(stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                    slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    capture: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """x through every layer of ``stack`` (returns it and the outputs of the layers in ``capture``,
    increasing indices), or None when this batch's attention does not run as one call of the C++
    kernel (the torch attention path): the caller then runs its Python loop."""
    args = native_whole_batch_args(meta)
    if args is None:
        return None
    return stack.run(x, cos, sin, k_cache, v_cache, slots, *args, cpu_ops.isa(), capture)


__all__ = ["StackLayer", "build_layer_stack", "run_layer_stack", "stack_projection"]
