"""Shared fixtures: the real default model's directory, and a tiny random-weight Llama for fast tests."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pathlib

import pytest
import torch

# Under pytest-xdist (``make test`` runs one worker per core) each worker keeps to its share of the
# cores: two workers each running two intra-op threads on two cores only add contention.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def default_model_dir() -> pathlib.Path:
    # SPECJET_TEST_MODEL_DIR: a directory holding the default model's config and tokenizer files,
    # for the tiny-model tests on a machine without the default model's package (scripts/gpu_check.sh
    # carries one to the lent GPU instead of the 98 MB GGUF).
    override = os.environ.get("SPECJET_TEST_MODEL_DIR")
    if override:
        return pathlib.Path(override)
    from specjet.models.weights import resolve_model_path

    return resolve_model_path(None)


def make_tiny_model_dir(path: pathlib.Path, tokenizer_dir: pathlib.Path, model_type: str = "llama", seed: int = 0,
                        tie: bool = True, weight_std: float = 0.15, hidden_size: int = 64,
                        intermediate_size: int = 128) -> pathlib.Path:
    """A 2-layer random-weight model of the given family that shares the default model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # 0.15: larger than the default init, so the logits are peaked enough to be stable
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, weight_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> pathlib.Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def cyclic_model_dir(tmp_path_factory, default_model_dir) -> pathlib.Path:
    """Smaller weights than ``tiny_model_dir``: greedy output falls into short cycles, so n-gram
    drafts are taken whole (and, with the overlap loop, the compute side runs far ahead of the host)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic"), default_model_dir, weight_std=0.05)


@pytest.fixture
def onednn_float32(monkeypatch, request):
    """float32 weights packed for oneDNN's measured row plans (``SPECJET_FP32_GEMM=onednn``) instead of specjet's
    float32 GEMM, for tests of the plans' paths."""
    from specjet.kernels import fp32_gemm

    request.addfinalizer(fp32_gemm.default_isa.cache_clear)
    monkeypatch.setenv(fp32_gemm.ISA_ENV, "onednn")
    fp32_gemm.default_isa.cache_clear()


@pytest.fixture(scope="session")
def dev_schemas() -> list[dict]:
    """The dev set of JSON schemas with prompts (../shared/data/jsonschema)."""
    import json

    folder = SHARED_DATA / "jsonschema"
    entries = json.loads((folder / "index.json").read_text())["schemas"]
    return [dict(e, schema=json.loads((folder / e["file"]).read_text())) for e in entries]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """A plain (non-speculative) engine on the tiny model: the reference of the speculative tests."""
    import specjet

    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_guided_drafting=True) as eng:
        yield eng
        eng.check_kv_invariant()  # after every reference workload of the module
