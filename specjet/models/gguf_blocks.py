"""A GGUF file's quantized linear weights, kept in their own blocks, under specjet's fused names.

``quantization="gguf"`` computes with the very blocks llama.cpp reads (Q4_1 layers, a Q8_0 head in
the default model) instead of the float32 weights they were dequantized into (models/weights.py).
Two things change on the way: llama.cpp's converter permutes the rows of the q and k projections
for its RoPE layout (its "llama" architecture only), which is undone here row by row (a row's blocks move whole); and q|k|v and
gate|up are concatenated along the output dimension as Llama's fused projections expect.

gguf's reader parses every metadata field in Python before it lists a tensor (the tokenizer's
vocabulary and merges: seconds of each engine's start), so the blocks are read from the GGUF once and
kept in specjet's cache (``gguf-linears/<stem>-<content hash>.safetensors``, keyed by the file's content as the
converted model is): later starts read that file (or only its header, for ``blocks_supported``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pathlib
import threading
import zlib

import numpy as np
import torch

from specjet.kernels.quant_formats import BLOCK, Int8Weight, Q41Weight, QuantWeight
from specjet.models.config import ModelConfig
from specjet.models.gguf_file import gguf_reader

logger = logging.getLogger(__name__)

# bytes of one 32-weight block
_Q4_1_BYTES, _Q8_0_BYTES = 20, 34
SUPPORTED_TYPES = ("Q4_1", "Q8_0")
# The cache of GGUFs' linear blocks (a file per GGUF content, under specjet's cache directory), and the
# version of the layout ``read_gguf_linears`` gives them: a file of another version is written again.
CACHE_DIR = "gguf-linears"
CACHE_LAYOUT = "3"  # 2: q and k unpermuted only for the "llama" architecture; 3: a checksum of the blocks


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
        raise ValueError("a fused projection's parts are in more than one GGUF block type")
    if isinstance(first, Q41Weight):
        return Q41Weight(*(torch.cat([getattr(w, f) for w in weights]).contiguous() for f in ("qs", "d", "m")))
    return Int8Weight(torch.cat([w.q for w in weights]).contiguous(), torch.cat([w.s for w in weights]).contiguous(),
                      first.group)


def _tensors(path: str | pathlib.Path) -> dict:
    """The file's tensors by name. gguf's reader parses all metadata in Python first (the tokenizer's
    vocabulary: seconds), so one reading per file is kept for the process."""
    return _read(path)[0]


def _architecture(path: str | pathlib.Path) -> str:
    """The file's ``general.architecture`` ("" where it has none)."""
    return _read(path)[1]


def _read(path: str | pathlib.Path) -> tuple[dict, str]:
    reader = gguf_reader(path)
    return _table_of(reader)


@functools.lru_cache(maxsize=4)
def _table_of(reader) -> tuple[dict, str]:
    field = reader.fields.get("general.architecture")
    return {t.name: t for t in reader.tensors}, (str(field.contents()) if field is not None else "")


_LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _head_name(tensors: dict, config: ModelConfig) -> str:
    return "token_embd.weight" if config.tie_word_embeddings or "output.weight" not in tensors else "output.weight"


def _linears_from_file(path: str | pathlib.Path, config: ModelConfig) -> dict[str, QuantWeight]:
    """``read_gguf_linears`` from the GGUF itself."""
    tensors = _tensors(path)
    # llama.cpp's converter permutes q and k only for its "llama" architecture (Llama's and Mistral's files), as
    # transformers' GGUF loader undoes it only there: a Qwen2 file's rows are in Hugging Face's order already.
    permuted = _architecture(path) == "llama"
    unpermute = _unpermute_rows if permuted else (lambda weight, num_heads: weight)
    out = {"lm_head": _blocks(tensors[_head_name(tensors, config)])}
    for i in range(config.num_layers):
        get = lambda name: _blocks(tensors[f"blk.{i}.{name}.weight"])  # noqa: E731
        q = unpermute(get("attn_q"), config.num_heads)
        k = unpermute(get("attn_k"), config.num_kv_heads)
        out[f"layers.{i}.self_attn.qkv_proj"] = _cat([q, k, get("attn_v")])
        out[f"layers.{i}.self_attn.o_proj"] = get("attn_output")
        out[f"layers.{i}.mlp.gate_up_proj"] = _cat([get("ffn_gate"), get("ffn_up")])
        out[f"layers.{i}.mlp.down_proj"] = get("ffn_down")
    return out


def _unsupported(path: str | pathlib.Path, config: ModelConfig) -> str | None:
    """Why the GGUF's blocks cannot serve (a weight missing or of another type), or None (reads its tensor table)."""
    tensors = _tensors(path)
    names = [_head_name(tensors, config)] + [f"blk.{i}.{part}.weight" for i in range(config.num_layers)
                                             for part in _LAYER_PARTS]
    for name in names:
        if name not in tensors:
            return f"GGUF tensor {name} is missing"
        if tensors[name].tensor_type.name not in SUPPORTED_TYPES:
            return f"GGUF tensor {name} is {tensors[name].tensor_type.name}"
    return None


def cache_path(path: str | pathlib.Path) -> pathlib.Path:
    """Where the GGUF's blocks are kept: ``<specjet cache>/gguf-linears/<its content key>.safetensors``."""
    from specjet.models.weights import gguf_content_key, specjet_cache_dir

    return specjet_cache_dir() / CACHE_DIR / f"{gguf_content_key(pathlib.Path(path))}.safetensors"


def _cached_header(file: pathlib.Path) -> dict | None:
    """The cache file's metadata, or None where it is absent, unreadable or of another layout."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError):  # absent, truncated or not safetensors: written again
        return None
    # A file written where other block types were supported (an older specjet's "no") is written again.
    current = meta.get("layout") == CACHE_LAYOUT and meta.get("supported") == ",".join(SUPPORTED_TYPES)
    return meta if current and {"unsupported", "kinds"} <= meta.keys() else None


def _checksum(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes in name order: a cache file whose data (not its layout or length) changed on the
    disk (a flipped page) would otherwise be computed with, garbage out (~0.1 s a start for the default model's 97 MB)."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).reshape(-1).numpy(), crc)
    return crc


def _save(file: pathlib.Path, tensors: dict[str, torch.Tensor], why: str | None, kinds: dict[str, str]) -> dict:
    """Keep ``tensors`` in ``file`` with what ``read_gguf_linears`` needs to rebuild them (or why they cannot serve);
    returns the metadata. Written under a temporary name and renamed, so a reader sees no file or a whole one; a
    cache that cannot be written (a read-only directory) is skipped: the next start reads the GGUF again."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    meta = {"layout": CACHE_LAYOUT, "supported": ",".join(SUPPORTED_TYPES), "unsupported": why or "",
            "kinds": json.dumps(kinds), "crc32": str(_checksum(tensors))}
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        tmp.chmod(0o644)  # safetensors writes it owner-only; the cache's converted models are readable by all
        os.replace(tmp, file)
    except (OSError, SafetensorError) as exc:
        logger.debug("GGUF blocks not cached in %s: %s", file, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return meta


def _write_cache(path: str | pathlib.Path, config: ModelConfig, file: pathlib.Path) -> dict:
    """Read the GGUF's blocks and keep them in ``file`` (or why they cannot serve); returns its metadata."""
    why = _unsupported(path, config)
    linears = {}
    if why is None:
        try:
            linears = _linears_from_file(path, config)
        except ValueError as exc:  # e.g. a fused projection's parts in two block types
            why = str(exc)
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, weight in linears.items():
        if isinstance(weight, Q41Weight):
            kinds[name] = "Q4_1"
            tensors.update({f"{name}.qs": weight.qs, f"{name}.d": weight.d, f"{name}.m": weight.m})
        else:
            kinds[name] = f"Q8_0:{weight.group}"
            tensors.update({f"{name}.q": weight.q, f"{name}.s": weight.s})
    return _save(file, tensors, why, kinds)


def read_gguf_linears(path: str | pathlib.Path, config: ModelConfig) -> dict[str, QuantWeight]:
    """{specjet Linear module name: its [out, in] blocks} for every projection and the LM head."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = cache_path(path)
    meta = _cached_header(file)
    if meta is None:
        meta = _write_cache(path, config, file)
    if meta["unsupported"]:
        raise ValueError(f"quantization='gguf' computes with {' and '.join(SUPPORTED_TYPES)} blocks; "
                         f"{meta['unsupported']} (use quantization='int8' or 'int4', which quantize the float weights)")
    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError):  # the cache could not be written (or went away): the GGUF itself
        return _linears_from_file(path, config)
    if str(_checksum(tensors)) != meta.get("crc32"):
        logger.warning("the GGUF blocks cached in %s are damaged (their checksum differs); reading the GGUF again", file)
        _write_cache(path, config, file)
        return _linears_from_file(path, config)
    out: dict[str, QuantWeight] = {}
    for name, kind in json.loads(meta["kinds"]).items():
        if kind == "Q4_1":
            out[name] = Q41Weight(tensors[f"{name}.qs"], tensors[f"{name}.d"], tensors[f"{name}.m"])
        else:
            out[name] = Int8Weight(tensors[f"{name}.q"], tensors[f"{name}.s"], int(kind.split(":")[1]))
    return out


def blocks_supported(path: str | pathlib.Path, config: ModelConfig) -> bool:
    """Whether every weight ``read_gguf_linears`` keeps is in a block type the kernels compute with: the cache's
    header, else the GGUF's tensor table (an answer of no is kept in the cache; the blocks are kept by
    ``read_gguf_linears``)."""
    file = cache_path(path)
    meta = _cached_header(file)
    if meta is not None:
        return not meta["unsupported"]
    why = _unsupported(path, config)
    if why is not None:
        _save(file, {}, why, {})
    return why is None
