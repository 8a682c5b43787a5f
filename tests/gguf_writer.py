"""Small GGUF files for tests, written from a tiny Hugging Face model as llama.cpp's converter lays them out (its
"llama" architecture's q and k rows permuted for its RoPE), with the default model's tokenizer."""
from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import torch


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> dict:
    import gguf

    from specjet.models.weights import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    return {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.")}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: Hugging Face's (head, 2, dim / 2) rows as (head, dim / 2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: pathlib.Path, path: pathlib.Path, arch: str, kind: str = "Q8_0",
               rope_freqs: list[float] | None = None) -> pathlib.Path:
    """``hf_dir``'s weights as a GGUF of architecture ``arch``, its matrices in ``kind`` ("Q8_0" or "F32")."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update({k: v.float() for k, v in load_file(f).items()})
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(1)
    fields = _tokenizer_fields()
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(fields["tokenizer.chat_template"])
    qtype = getattr(gguf.GGMLQuantizationType, kind)

    def matrix(name: str, key: str, permute_heads: int | None = None) -> None:
        w = sd[key].numpy().astype(np.float32)
        if permute_heads is not None and arch == "llama":
            w = _permute(w, permute_heads)
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)

    def vector(name: str, key: str) -> None:
        writer.add_tensor(name, sd[key].numpy().astype(np.float32))

    matrix("token_embd.weight", "model.embed_tokens.weight")
    if not cfg.get("tie_word_embeddings", False):
        matrix("output.weight", "lm_head.weight")
    vector("output_norm.weight", "model.norm.weight")
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        vector(b + "attn_norm.weight", p + "input_layernorm.weight")
        vector(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        matrix(b + "attn_q.weight", p + "self_attn.q_proj.weight", heads)
        matrix(b + "attn_k.weight", p + "self_attn.k_proj.weight", kv_heads)
        matrix(b + "attn_v.weight", p + "self_attn.v_proj.weight")
        matrix(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        matrix(b + "ffn_gate.weight", p + "mlp.gate_proj.weight")
        matrix(b + "ffn_up.weight", p + "mlp.up_proj.weight")
        matrix(b + "ffn_down.weight", p + "mlp.down_proj.weight")
        for n in "qkv":
            if p + f"self_attn.{n}_proj.bias" in sd:
                vector(b + f"attn_{n}.bias", p + f"self_attn.{n}_proj.bias")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def default_over_scaled_inv_freq(hf_dir: pathlib.Path) -> list[float]:
    """The factors llama.cpp's ``rope_freqs`` holds for ``hf_dir``'s RoPE scaling: each default frequency over the
    scaled one, as transformers computes them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(hf_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, torch.device("cpu"))
    dim = config.head_dim
    default = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return (default / scaled).tolist()
