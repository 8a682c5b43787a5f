"""The CPU's description and bf16 capability, and dtype="auto" following it."""
from __future__ import annotations

import logging

import pytest
import torch

from model_harness import load_runner
from specjet.kernels import cpu_features
from specjet.models.config import ModelConfig
from specjet.models.runner import ModelRunner, auto_dtype, resolve_dtype
from specjet.models.weights import load_state_dict
from transformers import AutoConfig


def test_model_name_and_description():
    name = cpu_features.cpu_model()
    assert name and name.strip() == name
    described = cpu_features.describe_cpu()
    assert described.startswith(name) and f"({cpu_features.vector_isa()}, " in described
    assert ("no native bf16" in described) == (not cpu_features.has_native_bf16())


def test_description_names_the_x86_family_and_model(monkeypatch):
    def cpuinfo(fields):  # cpu_model() is cached: it reads the same fake
        monkeypatch.setattr(cpu_features, "_cpuinfo", lambda: fields)
        monkeypatch.setattr(cpu_features, "cpu_model", lambda: fields["model name"])

    # What /proc/cpuinfo says on a virtual machine that names its CPU only "AMD EPYC" (a Zen 5 here).
    cpuinfo({"model name": "AMD EPYC", "cpu family": "26", "model": "2", "flags": "avx2 avx512f avx512_bf16"})
    assert cpu_features.cpu_generation() == "family 26 model 2"
    assert cpu_features.describe_cpu().startswith("AMD EPYC, family 26 model 2 (")
    # Without the fields (another architecture): the model name alone.
    cpuinfo({"model name": "Neoverse-V2"})
    assert cpu_features.cpu_generation() == ""
    assert cpu_features.describe_cpu().startswith("Neoverse-V2 (")


def test_no_bf16_flag_means_no_native_bf16(monkeypatch):
    monkeypatch.delenv(cpu_features.NATIVE_BF16_ENV, raising=False)
    flags = cpu_features.cpu_flags()
    if flags and not any(f in flags for f in cpu_features.BF16_FLAGS):
        assert not cpu_features.has_native_bf16()
    if cpu_features.has_native_bf16():
        assert torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN must be allowed to use it


@pytest.mark.parametrize("value,native", [("0", False), ("false", False), ("1", True), ("on", True)])
def test_env_override_decides_auto_on_cpu(monkeypatch, value, native):
    monkeypatch.setenv(cpu_features.NATIVE_BF16_ENV, value)
    assert cpu_features.has_native_bf16() is native
    expected = torch.bfloat16 if native else torch.float32
    assert auto_dtype("cpu") == resolve_dtype("auto", torch.device("cpu")) == resolve_dtype(None, torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert "[forced]" in cpu_features.describe_cpu()
    # An explicit dtype and CUDA's auto do not depend on the CPU.
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_bad_override_says_what_it_takes(monkeypatch):
    monkeypatch.setenv(cpu_features.NATIVE_BF16_ENV, "maybe")
    with pytest.raises(ValueError, match="SPECJET_CPU_NATIVE_BF16='maybe': use 0 or 1"):
        cpu_features.has_native_bf16()


def test_runner_logs_its_dtype_and_the_cpu(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="specjet.models.runner"):
        runner = load_runner(tiny_model_dir, dtype="auto", tokens=64)
    assert runner.dtype == auto_dtype("cpu")
    dtype = str(runner.dtype).removeprefix("torch.")
    assert f"dtype {dtype} (auto) on {cpu_features.describe_cpu()}" in caplog.text


@pytest.mark.parametrize("native", ["0", "1"])
def test_bf16_asked_for_without_native_bf16_is_warned(monkeypatch, tiny_model_dir, caplog, native):
    """An explicit bf16 model on a CPU that emulates bf16 runs several times slower than float32: the
    runner says so (auto would have picked float32); with native bf16 it does not."""
    monkeypatch.setenv(cpu_features.NATIVE_BF16_ENV, native)
    with caplog.at_level(logging.WARNING, logger="specjet.models.runner"):
        runner = load_runner(tiny_model_dir, dtype="bfloat16", tokens=64)
    assert runner.dtype == torch.bfloat16
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "without native bf16" in r.getMessage()]
    assert len(warned) == (1 if native == "0" else 0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specjet.models.runner"):
        load_runner(tiny_model_dir, dtype="float32", tokens=64)
        # quantized weights run on the integer kernels: nothing emulated to warn of
        ModelRunner(ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir)), load_state_dict(tiny_model_dir),
                    "bfloat16", "cpu", 64, 0.0, 1, quantization="int8")
    assert "without native bf16" not in caplog.text
