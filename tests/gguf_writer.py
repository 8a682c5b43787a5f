"""Small GGUF files for tests, written from a tiny Hugging Face model as llama.cpp's converter lays them out (its
"llama" architecture's q and k rows permuted for its RoPE; Qwen3's per-head q/k norms and ``attention.key_length``),
with the default model's tokenizer."""
from __future__ import annotations

import functools
import json
import pathlib
import shutil

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


def _fake_q4_k(rows: int, cols: int) -> np.ndarray:
    """Q4_K bytes for a [rows, cols] matrix (gguf-py has no Q4_K quantizer): random nibbles and 6-bit scales under
    small fp16 super-block scales. What they mean is gguf-py's dequantization, which the reference directory holds."""
    blocks = rows * cols // 256
    rng = np.random.default_rng(rows * 7919 + cols)
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    raw[:, 0:2] = np.full(blocks, 0.004, dtype=np.float16).view(np.uint8).reshape(blocks, 2)  # d
    raw[:, 2:4] = np.full(blocks, 0.002, dtype=np.float16).view(np.uint8).reshape(blocks, 2)  # dmin
    return raw.reshape(rows, cols // 256 * 144)


def write_gguf(hf_dir: pathlib.Path, path: pathlib.Path, arch: str, kind: str = "Q8_0",
               rope_freqs: list[float] | None = None, reference_dir: pathlib.Path | None = None) -> pathlib.Path:
    """``hf_dir``'s weights as a GGUF of architecture ``arch``, its matrices in ``kind`` ("Q8_0", "Q4_1", "Q4_K",
    "F16" or "F32"). ``reference_dir``: a copy of ``hf_dir`` whose weights are the file's, dequantized by gguf-py
    (what the file's numbers mean, independently of specjet), for transformers to compute the expected output."""
    import gguf
    from safetensors.torch import load_file, save_file

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
    if arch == "qwen3":  # as llama.cpp's converter: the config's head_dim as key/value lengths, no vocab_size (the
        writer.add_key_length(head_dim)  # token list's length is the vocabulary) and no RoPE dimension count
        writer.add_value_length(head_dim)
    else:
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(1)
    fields = _tokenizer_fields()
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    # Qwen's files name their pre-tokenizer "qwen2" (a GPT-2 style BPE with Qwen's split pattern)
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(fields["tokenizer.chat_template"])
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    reference = dict(sd)

    def matrix(name: str, key: str, permute_heads: int | None = None) -> None:
        w = np.ascontiguousarray(sd[key].numpy().astype(np.float32))
        permuted = permute_heads is not None and arch == "llama"
        stored = np.ascontiguousarray(_permute(w, permute_heads)) if permuted else w
        if kind == "F32":
            data, raw, meaning = stored, None, stored
        elif kind == "F16":
            data, raw = stored.astype(np.float16), None
            meaning = data.astype(np.float32)
        else:
            data = _fake_q4_k(*stored.shape) if kind == "Q4_K" else gguf.quants.quantize(stored, qtype)
            raw, meaning = qtype, gguf.quants.dequantize(data, qtype).reshape(stored.shape).astype(np.float32)
        if permuted:  # the reference holds Hugging Face's row order
            heads = permute_heads
            meaning = meaning.reshape(heads, meaning.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        reference[key] = torch.from_numpy(np.ascontiguousarray(meaning))
        writer.add_tensor(name, data, raw_dtype=raw)

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
        for n in "qk":  # Qwen3's per-head RMSNorm weights
            if p + f"self_attn.{n}_norm.weight" in sd:
                vector(b + f"attn_{n}_norm.weight", p + f"self_attn.{n}_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reference_dir is not None:
        shutil.copytree(hf_dir, reference_dir)
        for f in pathlib.Path(reference_dir).glob("model*.safetensors*"):
            f.unlink()
        if cfg.get("tie_word_embeddings", False):  # the head is the embedding's (dequantized) matrix
            reference.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in reference.items()},
                  str(pathlib.Path(reference_dir) / "model.safetensors"), metadata={"format": "pt"})
        # the file holds the epsilon as a float32
        config_file = pathlib.Path(reference_dir) / "config.json"
        config_file.write_text(json.dumps(dict(cfg, rms_norm_eps=float(np.float32(cfg["rms_norm_eps"]))), indent=2))
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
