"""quantization="auto" (the default): the GGUF file's own blocks on CPU where the model is a GGUF whose
block types the kernels take, float weights otherwise; what it chose is reported."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import specjet
from specjet.models.quantize import choose_method
from specjet.models.weights import default_gguf_path

ONE_LAYER = types.SimpleNamespace(num_layers=1, tie_word_embeddings=True)
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _write_gguf(path, quantize_names=()):
    """A one-layer GGUF whose linears are float32 except those in ``quantize_names`` (Q8_0)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    names = ["token_embd.weight"] + [f"blk.0.{p}.weight" for p in PARTS]
    for name in names:
        data = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
        if name in quantize_names:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_auto_takes_the_default_models_blocks():
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.weights import resolve_model_path

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_path(None)))
    method, why = choose_method("auto", torch.device("cpu"), default_gguf_path(), config)
    assert method == "gguf" and "GGUF" in why
    assert choose_method("auto", torch.device("cuda"), default_gguf_path(), config)[0] is None


def test_auto_keeps_float_weights_without_usable_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))  # what is kept of these files goes there
    assert choose_method("auto", torch.device("cpu"), None, ONE_LAYER)[0] is None  # not a GGUF
    all_q8 = _write_gguf(tmp_path / "q8.gguf", quantize_names=["token_embd.weight"] + [f"blk.0.{p}.weight" for p in PARTS])
    assert choose_method("auto", torch.device("cpu"), all_q8, ONE_LAYER)[0] == "gguf"
    some_f32 = _write_gguf(tmp_path / "mixed.gguf", quantize_names=["token_embd.weight"])
    method, why = choose_method("auto", torch.device("cpu"), some_f32, ONE_LAYER)
    assert method is None and "Q4_1" in why


@pytest.mark.parametrize("method", [None, "int8", "int4", "gguf"])
def test_an_explicit_method_is_kept(method):
    assert choose_method(method, torch.device("cpu"), None, ONE_LAYER)[0] == method


def test_unknown_method_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="auto, int8, int4, gguf"):
        specjet.Engine(model_path=str(tiny_model_dir), quantization="int3")


def test_engine_reports_what_auto_chose(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024) as eng:  # a directory: no GGUF
        info = eng.get_server_info()
        assert info["quantization"] is None and info["args"].quantization == "auto"
        assert info["dtype"] in ("float32", "bfloat16")
        assert eng.generate("a b c", {"max_new_tokens": 4, "temperature": 0})["meta_info"]["completion_tokens"] >= 1
        eng.check_kv_invariant()


def test_auto_keeps_float_weights_where_the_kernels_would_run_scalar(monkeypatch):
    from specjet.kernels import qgemm

    monkeypatch.setattr(qgemm, "default_isa", lambda: "scalar")
    method, why = choose_method("auto", torch.device("cpu"), default_gguf_path(), ONE_LAYER)
    assert method is None and "AVX2" in why
