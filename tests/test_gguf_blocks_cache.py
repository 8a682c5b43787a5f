"""The GGUF's linear blocks kept in specjet's cache (models/gguf_blocks.py), so that an engine's start does not parse
the GGUF's metadata again: what a later start reads is what the file holds (raw bytes, compared exactly), a later start
parses no GGUF, a cache file of another layout or a damaged one is written again, a file whose blocks cannot serve is
remembered as such, and a cache that cannot be written costs only the time."""
from __future__ import annotations

import json

import pytest
import torch

from specjet.models import gguf_blocks
from specjet.models.weights import default_gguf_path
from test_quant_auto import ONE_LAYER, PARTS, _write_gguf


@pytest.fixture(scope="module")
def config(default_model_dir):
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(default_model_dir))


@pytest.fixture(scope="module")
def from_file(config):
    """The default model's blocks as the GGUF itself gives them."""
    return gguf_blocks._linears_from_file(default_gguf_path(), config)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path))
    return tmp_path / gguf_blocks.CACHE_DIR


def _fields(weight) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(weight).items() if isinstance(v, torch.Tensor)}


def _assert_same(blocks, expected) -> None:
    assert blocks.keys() == expected.keys()
    for name, weight in expected.items():
        got = blocks[name]
        assert type(got) is type(weight) and getattr(got, "group", None) == getattr(weight, "group", None), name
        for field, tensor in _fields(weight).items():
            other = _fields(got)[field]
            assert other.dtype == tensor.dtype and torch.equal(other, tensor), f"{name}.{field}"


def _no_gguf_parsing(monkeypatch):
    def parsed(*_args):
        raise AssertionError("the GGUF was parsed")
    monkeypatch.setattr(gguf_blocks, "_tensors", parsed)


def test_cached_blocks_are_the_files(config, from_file, cache_dir, monkeypatch):
    first = gguf_blocks.read_gguf_linears(default_gguf_path(), config)  # reads the GGUF, writes the cache
    file = gguf_blocks.cache_path(default_gguf_path())
    assert file.parent == cache_dir and file.is_file() and file.stat().st_mode & 0o777 == 0o644
    assert not list(cache_dir.glob("*.tmp-*"))
    _assert_same(first, from_file)
    _no_gguf_parsing(monkeypatch)  # a later start
    assert gguf_blocks.blocks_supported(default_gguf_path(), config)
    _assert_same(gguf_blocks.read_gguf_linears(default_gguf_path(), config), from_file)


@pytest.mark.parametrize("damage", ["truncated", "other layout"])
def test_a_damaged_or_outdated_cache_is_written_again(config, from_file, cache_dir, damage):
    from safetensors.torch import save_file

    file = gguf_blocks.cache_path(default_gguf_path())
    file.parent.mkdir(parents=True)
    if damage == "truncated":
        file.write_bytes(b"\x10\x00\x00\x00")
    else:  # a file an older specjet wrote: its blocks in another arrangement
        save_file({"lm_head.q": torch.zeros(2, 32, dtype=torch.int8)}, str(file),
                  metadata={"layout": "0", "unsupported": "", "kinds": json.dumps({"lm_head": "Q8_0:32"})})
    _assert_same(gguf_blocks.read_gguf_linears(default_gguf_path(), config), from_file)
    assert gguf_blocks._cached_header(file)["layout"] == gguf_blocks.CACHE_LAYOUT


def test_a_cache_whose_data_changed_on_the_disk_is_read_again(config, from_file, cache_dir):
    """A page of the cache's data flipped (its header and length intact, so it still reads as safetensors): the
    blocks were computed with as they were (the model's replies became whitespace); the checksum finds it, the GGUF
    gives the blocks, and the cache is written again."""
    gguf_blocks.read_gguf_linears(default_gguf_path(), config)
    file = gguf_blocks.cache_path(default_gguf_path())
    size = file.stat().st_size
    with open(file, "r+b") as handle:
        handle.seek(size // 2)
        page = handle.read(4096)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in page))
    _assert_same(gguf_blocks.read_gguf_linears(default_gguf_path(), config), from_file)
    with open(file, "rb") as handle:  # written again: the page as the GGUF has it
        handle.seek(size // 2)
        assert handle.read(4096) == page
    _assert_same(gguf_blocks.read_gguf_linears(default_gguf_path(), config), from_file)


def test_an_unwritable_cache_costs_only_time(config, from_file, tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(blocked))  # nothing can be created below it, not even a key's pointer
    monkeypatch.setattr("specjet.models.weights._CONTENT_KEYS", {})
    assert gguf_blocks.blocks_supported(default_gguf_path(), config)
    _assert_same(gguf_blocks.read_gguf_linears(default_gguf_path(), config), from_file)


def test_unusable_blocks_are_remembered(tmp_path, cache_dir, monkeypatch):
    mixed = _write_gguf(tmp_path / "mixed.gguf", quantize_names=["token_embd.weight"])  # float32 projections
    assert not gguf_blocks.blocks_supported(mixed, ONE_LAYER)
    with monkeypatch.context() as patch:
        _no_gguf_parsing(patch)
        assert not gguf_blocks.blocks_supported(mixed, ONE_LAYER)  # from the cache's header
        with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight is F32.*int8"):
            gguf_blocks.read_gguf_linears(mixed, ONE_LAYER)
    # A specjet that computes with more block types does not take an older one's "no" for its answer.
    monkeypatch.setattr(gguf_blocks, "SUPPORTED_TYPES", gguf_blocks.SUPPORTED_TYPES + ("F32",))
    assert gguf_blocks.blocks_supported(mixed, ONE_LAYER)


def test_a_small_q8_file_round_trips(tmp_path, cache_dir, monkeypatch):
    all_q8 = _write_gguf(tmp_path / "q8.gguf", quantize_names=["token_embd.weight"] + [f"blk.0.{p}.weight" for p in PARTS])
    one_layer = type(ONE_LAYER)(**vars(ONE_LAYER), num_heads=2, num_kv_heads=2)
    expected = gguf_blocks._linears_from_file(all_q8, one_layer)
    assert gguf_blocks.blocks_supported(all_q8, one_layer)
    _assert_same(gguf_blocks.read_gguf_linears(all_q8, one_layer), expected)
    _no_gguf_parsing(monkeypatch)
    _assert_same(gguf_blocks.read_gguf_linears(all_q8, one_layer), expected)
