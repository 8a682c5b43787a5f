"""The model shape specjet needs, read from a Hugging Face config (Llama family)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 puts a bias on q/k/v
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # kept for RoPE scaling, which transformers knows how to compute

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        model_type = getattr(hf, "model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; specjet runs the Llama family: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        unsupported = _unsupported_variant(hf, model_type)
        if unsupported:
            raise ValueError(f"unsupported {model_type} variant: {unsupported}; specjet would compute another model")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            hf_config=hf,
        )

    @property
    def sliding_window(self) -> int | None:
        """The attention window of a config that sets one (Mistral's ``sliding_window``, Qwen's with
        ``use_sliding_window``), or None. specjet attends to the whole context, which is the same only while the
        context is no longer than the window (the engine caps it there)."""
        window = getattr(self.hf_config, "sliding_window", None)
        if self.model_type in ("qwen2", "qwen3") and not getattr(self.hf_config, "use_sliding_window", False):
            return None
        return int(window) if isinstance(window, int) and window > 0 else None

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and the attention scaling of the config's RoPE variant, on the CPU whatever device
        the caller builds under (the model is built on the meta device, where transformers' RoPE functions'
        tensors would have no data to copy)."""
        with torch.device("cpu"):
            return self._rope_inv_freq()

    def _rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        factors = getattr(self.hf_config, "rope_freq_factors", None)  # a GGUF's rope_freqs (models/weights.py)
        if rope_type == "default" or factors is not None:
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            dim = self.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            if factors is not None:  # llama.cpp divides each frequency by its factor
                if len(factors) != dim // 2:
                    raise ValueError(f"rope_freq_factors has {len(factors)} values for {dim // 2} frequencies")
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
            return inv_freq.float(), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)


def _unsupported_variant(hf: Any, model_type: str) -> str | None:
    """What in a config of a supported family specjet's Llama does not compute (it would drop those weights or
    compute another activation, and give another model's output without a word), or None."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} (specjet's MLP is SiLU-gated)"
    if getattr(hf, "mlp_bias", False):
        return "mlp_bias (biases on the MLP's projections)"
    if getattr(hf, "attention_bias", False) and model_type != "qwen2":
        return "attention_bias (a bias on the attention's output projection; specjet has Qwen2's on q, k and v only)"
    return None
