"""Quantized weights for a loaded model: each projection's inference operand becomes a
``QuantizedLinear`` (kernels/qgemm.py) in place of the float ``PackedLinear``.

Methods (``EngineArgs.quantization``, SGLang's name):
- ``int8``: symmetric int8, one scale per output channel; the LM head the same.
- ``int4``: 4-bit blocks of 32 with a scale and a minimum (GGUF's Q4_1 layout); the LM head in
  int8 blocks of 32 (GGUF's Q8_0), as llama.cpp's 4-bit files keep it: the head's errors reach
  every logit directly.
- ``gguf``: the model's own GGUF blocks as the file stores them (models/gguf_blocks.py), so specjet
  computes with the weights llama.cpp does.
The embedding lookup stays float (the head is a copy even when tied), and so do the norms.

``auto`` (the engine's default, ``choose_method``): ``gguf`` where the model comes from a GGUF file
whose blocks the CPU's vectorised kernels (AVX2 / AVX-512) compute with, else none. The file's blocks are the model's own weights
(the float model is their dequantization), so this changes no weight; only the activations' rounding
differs, while a decode step reads ~4x fewer bytes than in float32.
"""
from __future__ import annotations

import logging

import torch

from specjet.kernels.qgemm import QuantizedLinear, describe_kernels
from specjet.kernels.quant_formats import BLOCK, QuantWeight, quantize_int8, quantize_q4_1

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
AUTO = "auto"


def check_method(method: str | None, allow_auto: bool = False) -> None:
    if method is None or method in QUANTIZATION_METHODS or (allow_auto and method == AUTO):
        return
    choices = ", ".join(((AUTO,) if allow_auto else ()) + QUANTIZATION_METHODS)
    raise ValueError(f"quantization {method!r} is not supported; use one of {choices} or None")


def _no_vectorised_kernels(device: torch.device) -> str | None:
    """Why ``auto`` keeps float weights on ``device`` (None: the quantized kernels run vectorised there;
    where they would run scalar, the float kernels are faster)."""
    if torch.device(device).type != "cpu":
        return "auto: the quantized kernels are CPU kernels"
    from specjet.kernels.qgemm import default_isa, extension

    if extension() is None or default_isa() == "scalar":
        return "auto: no vectorised quantized kernels on this CPU (AVX2 or AVX-512, and the C++ extension)"
    return None


def choose_method(requested: str | None, device: torch.device, gguf_path, config) -> tuple[str | None, str]:
    """The method to use for ``requested`` (``auto`` resolved) and why, for the start-up log."""
    if requested != AUTO:
        return requested, "asked for"
    if gguf_path is None and torch.device(device).type == "cpu":
        return None, "auto: the model is not a GGUF file (int8 / int4 would change its weights: ask for them)"
    missing = _no_vectorised_kernels(device)
    if missing:
        return None, missing
    from specjet.models.gguf_blocks import SUPPORTED_TYPES, blocks_supported

    if not blocks_supported(gguf_path, config):
        return None, f"auto: the GGUF file has weights outside {'/'.join(SUPPORTED_TYPES)}"
    return "gguf", "auto: the GGUF file's own blocks (quantization=None computes with their float dequantization)"


def choose_draft_method(requested: str | None, target_method: str | None, device: torch.device) -> tuple[str | None, str]:
    """The quantization of a draft model's weights (EAGLE head, DFlash draft; the engine's
    ``speculative_draft_model_quantization``) for ``requested`` (``auto`` resolved) and why, for the
    start-up log. A draft's forwards read all its weights for a few rows, every iteration: they are
    a stream of the weights, as a target's decode step is."""
    if requested != AUTO:
        if requested is not None and torch.device(device).type != "cpu":
            raise ValueError(f"speculative_draft_model_quantization={requested!r} has CPU kernels only; "
                             f"device is {device}")
        return requested, "asked for"
    if target_method is not None:
        return target_method, "auto: the target's"
    missing = _no_vectorised_kernels(device)
    if missing:
        return None, missing
    return "int8", "auto: int8 draft weights on a float target (half of bf16's bytes, a quarter of float32's)"


def quantize_weight(weight_t: torch.Tensor, method: str, is_head: bool = False) -> QuantWeight | None:
    """A [in, out] float weight in ``method``'s format, or None where its input width is not whole
    32-weight blocks (that projection stays float). ``gguf`` quantizes like ``int4`` (weights that are
    not in the file, e.g. an EAGLE head's)."""
    if weight_t.shape[0] % BLOCK:
        return None
    weight = weight_t.detach().float().t().contiguous()
    if method == "int8":
        return quantize_int8(weight)
    return quantize_int8(weight, BLOCK) if is_head else quantize_q4_1(weight)


def quantize_linears(model: torch.nn.Module, method: str, given: dict[str, QuantWeight] | None = None) -> int:
    """Give every ``Linear`` of ``model`` a quantized operand: the blocks in ``given`` under its module
    name, else its own weight quantized by ``method``. Returns how many were quantized."""
    from specjet.models.llama import Linear

    check_method(method)
    given = given or {}
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        weight = given.get(name)
        if weight is None and module.weight_t.is_meta:
            raise ValueError(f"{name} has neither blocks of its own nor a float weight to quantize")
        if weight is None:
            weight = quantize_weight(module.weight_t, method, is_head=name.endswith("lm_head"))
        elif weight.shape != (module.weight_t.shape[1], module.weight_t.shape[0]):
            raise ValueError(f"quantized {name}: blocks of shape {weight.shape}, layer [out, in] "
                             f"{tuple(module.weight_t.shape[::-1])}")
        if weight is None:
            logger.info("%s stays float: its input width %d is not whole blocks of %d", name,
                        module.weight_t.shape[0], BLOCK)
            continue
        module.packed = QuantizedLinear.build(weight, module.bias)
        count += 1
    return count


def quantize_model(model: torch.nn.Module, method: str, gguf_path=None) -> None:
    """Quantize a loaded target model's projections and LM head (``gguf``: from ``gguf_path``'s blocks)."""
    check_method(method)
    given = None
    if method == "gguf":
        if gguf_path is None:
            raise ValueError("quantization='gguf' needs a GGUF model: model_path None (the default model) or a "
                             ".gguf file")
        from specjet.models.gguf_blocks import read_gguf_linears

        given = read_gguf_linears(gguf_path, model.config)
    count = quantize_linears(model, method, given)
    from specjet.models.llama import Linear

    total = sum(isinstance(m, Linear) for m in model.modules())
    if count == 0:  # nothing would compute with the method asked for, while the engine reported it in effect
        raise ValueError(f"quantization={method!r}: none of the model's {total} projections has an input width of "
                         f"whole {BLOCK}-weight blocks (hidden_size {model.config.hidden_size}, intermediate_size "
                         f"{model.config.intermediate_size}), so none can be quantized; use quantization=None")
    if count < total:
        logger.warning("quantization %s: %d of %d projections stay float (their input width is not whole blocks of "
                       "%d; log_level='info' names them)", method, total - count, total, BLOCK)
    model.quantization = method
    logger.info("quantization %s: %d projections (%s)", method, count, describe_kernels())
