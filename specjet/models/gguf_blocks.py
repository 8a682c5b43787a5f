"""A GGUF file's quantized linear weights, kept in their own blocks, under specjet's fused names.

``quantization="gguf"`` computes with the very blocks llama.cpp reads (Q4_1 layers, a Q8_0 head in
the default model) instead of the float32 weights they were dequantized into (models/weights.py).
Two things change on the way: llama.cpp's converter permutes the rows of the q and k projections
for its RoPE layout, which is undone here row by row (a row's blocks move whole); and q|k|v and
gate|up are concatenated along the output dimension as Llama's fused projections expect.
"""
from __future__ import annotations

import functools
import pathlib

import numpy as np
import torch

from specjet.kernels.quant_formats import BLOCK, Int8Weight, Q41Weight, QuantWeight
from specjet.models.config import ModelConfig

# bytes of one 32-weight block
_Q4_1_BYTES, _Q8_0_BYTES = 20, 34
SUPPORTED_TYPES = ("Q4_1", "Q8_0")


def _blocks(tensor) -> QuantWeight:
    kind = tensor.tensor_type.name
    k, n = (int(v) for v in tensor.shape)  # GGUF lists the fastest dimension first
    raw = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.uint8).reshape(n, k // BLOCK, -1)
    if kind == "Q4_1":
        d = raw[..., 0:2].contiguous().view(torch.float16).reshape(n, k // BLOCK)
        m = raw[..., 2:4].contiguous().view(torch.float16).reshape(n, k // BLOCK)
        qs = raw[..., 4:_Q4_1_BYTES].reshape(n, k // 2)
        return Q41Weight(qs.contiguous(), d.contiguous(), m.contiguous())
    if kind == "Q8_0":
        s = raw[..., 0:2].contiguous().view(torch.float16).reshape(n, k // BLOCK)
        q = raw[..., 2:_Q8_0_BYTES].contiguous().view(torch.int8).reshape(n, k)
        return Int8Weight(q.contiguous(), s.contiguous(), BLOCK)
    raise ValueError(f"quantization='gguf' computes with {' and '.join(SUPPORTED_TYPES)} blocks; GGUF tensor "
                     f"{tensor.name} is {kind} (use quantization='int8' or 'int4', which quantize the float weights)")


def _unpermute_rows(weight: QuantWeight, num_heads: int) -> QuantWeight:
    """Undo llama.cpp's q/k row order: its rows are (head, dim / 2, 2) of Hugging Face's (head, 2, dim / 2)."""
    n = weight.shape[0]
    order = torch.arange(n).reshape(num_heads, n // num_heads // 2, 2).transpose(1, 2).reshape(n)
    return weight.select_rows(order)


def _cat(weights: list[QuantWeight]) -> QuantWeight:
    first = weights[0]
    if not all(type(w) is type(first) for w in weights):
        raise ValueError("a fused projection's parts must share one GGUF block type")
    if isinstance(first, Q41Weight):
        return Q41Weight(*(torch.cat([getattr(w, f) for w in weights]).contiguous() for f in ("qs", "d", "m")))
    return Int8Weight(torch.cat([w.q for w in weights]).contiguous(), torch.cat([w.s for w in weights]).contiguous(),
                      first.group)


def _tensors(path: str | pathlib.Path) -> dict:
    """The file's tensors by name. gguf's reader parses all metadata in Python first (the tokenizer's
    vocabulary: seconds), so one reading per file is kept for the process."""
    path = pathlib.Path(path).resolve()
    stat = path.stat()
    return _read_tensors(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_tensors(path: str, size: int, mtime_ns: int) -> dict:  # size and mtime: a changed file is read again
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


_LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _head_name(tensors: dict, config: ModelConfig) -> str:
    return "token_embd.weight" if config.tie_word_embeddings or "output.weight" not in tensors else "output.weight"


def read_gguf_linears(path: str | pathlib.Path, config: ModelConfig) -> dict[str, QuantWeight]:
    """{specjet Linear module name: its [out, in] blocks} for every projection and the LM head."""
    tensors = _tensors(path)
    out = {"lm_head": _blocks(tensors[_head_name(tensors, config)])}
    for i in range(config.num_layers):
        get = lambda name: _blocks(tensors[f"blk.{i}.{name}.weight"])  # noqa: E731
        q = _unpermute_rows(get("attn_q"), config.num_heads)
        k = _unpermute_rows(get("attn_k"), config.num_kv_heads)
        out[f"layers.{i}.self_attn.qkv_proj"] = _cat([q, k, get("attn_v")])
        out[f"layers.{i}.self_attn.o_proj"] = get("attn_output")
        out[f"layers.{i}.mlp.gate_up_proj"] = _cat([get("ffn_gate"), get("ffn_up")])
        out[f"layers.{i}.mlp.down_proj"] = get("ffn_down")
    return out


def blocks_supported(path: str | pathlib.Path, config: ModelConfig) -> bool:
    """Whether every weight ``read_gguf_linears`` keeps is in a block type the kernels compute with
    (reads the file's tensor table only)."""
    tensors = _tensors(path)
    names = [_head_name(tensors, config)] + [f"blk.{i}.{part}.weight" for i in range(config.num_layers)
                                             for part in _LAYER_PARTS]
    return all(name in tensors and tensors[name].tensor_type.name in SUPPORTED_TYPES for name in names)
