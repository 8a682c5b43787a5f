"""What an engine given no dtype or quantization runs the embedded default model in, on this CPU
(``auto`` for both: the GGUF's own blocks, whose kernels compute in float32), for the benchmark tests
that check the configuration their reports print."""
from __future__ import annotations

import torch

from specjet.models.quantize import choose_method
from specjet.models.runner import resolve_dtype
from specjet.models.weights import default_gguf_path


def default_model_dtype_name() -> str:
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.weights import resolve_model_path

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_path(None)))
    cpu = torch.device("cpu")
    quantization, _ = choose_method("auto", cpu, default_gguf_path(), config)
    return str(resolve_dtype("auto", cpu, quantization)).removeprefix("torch.")
