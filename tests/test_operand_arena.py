"""A model's packed weights gathered into one huge-page buffer (models/operand_arena.py): the same bits
before and after, every moved operand inside the one 2 MiB-aligned buffer, and the buffer advised for
transparent huge pages where Linux offers them."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from transformers import AutoConfig

import specjet.models.runner as runner_module
from model_harness import OneRequest
from specjet.kernels import fp32_gemm
from specjet.kernels.bf16_gemm import Bf16Linear
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.qgemm import QuantizedLinear
from specjet.models.config import ModelConfig
from specjet.models.operand_arena import HUGE_PAGE, advise_huge_pages, gather_operands
from specjet.models.weights import load_state_dict

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 1000, 12]


def _runner(model_dir, dtype: str, quantization: str | None, gather: bool):
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    with pytest.MonkeyPatch.context() as patch:
        if not gather:
            patch.setattr(runner_module, "gather_operands", lambda model: None)
        return runner_module.ModelRunner(config, load_state_dict(model_dir), dtype, "cpu", 256, 0.0, 1,
                                         quantization=quantization)


def _logits(runner) -> torch.Tensor:
    request = OneRequest(runner)
    prefill = request.extend(PROMPT).logits
    step = request.extend([int(prefill[-1].argmax())]).logits  # a decode step after the prefill
    return torch.cat([prefill, step])


def _operands(model) -> list[torch.Tensor]:
    out = []
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, QuantizedLinear):
            w = packed.weight
            out += [t for t in vars(w).values() if isinstance(t, torch.Tensor)]
        elif isinstance(packed, (Bf16Linear, Fp32Linear)):
            out.append(packed.weight)
        if isinstance(packed, (QuantizedLinear, Bf16Linear, Fp32Linear)) and packed.bias is not None:
            out.append(packed.bias)
    return out


def _thp_mode() -> str | None:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _thp_eligible(address: int) -> bool | None:
    """The THPeligible flag of the mapping holding ``address`` (/proc/self/smaps), None if not found."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


@pytest.mark.parametrize("dtype,quantization", [("float32", "int8"), ("float32", "int4"), ("bfloat16", None)])
def test_gathered_operands_give_the_same_logits_and_sit_in_one_aligned_buffer(tiny_model_dir, dtype, quantization):
    runner = _runner(tiny_model_dir, dtype, quantization, gather=False)
    if not _operands(runner.model):
        pytest.skip("no packed operand of specjet's own on this CPU (bf16 without AVX-512 BF16 goes to oneDNN)")
    before = _logits(runner)
    scattered = {t.data_ptr() for t in _operands(runner.model)}

    buffer = gather_operands(runner.model)
    runner.model.use_native_ops()  # the layer stack again, over the moved operands
    assert buffer is not None and buffer.data_ptr() % HUGE_PAGE == 0
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    moved = _operands(runner.model)
    assert all(start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end for t in moved)
    assert all(t.data_ptr() % 64 == 0 for t in moved)
    assert not scattered & {t.data_ptr() for t in moved}  # copies, not the old memory
    runner.kv_cache.k.zero_(), runner.kv_cache.v.zero_()
    assert torch.equal(_logits(runner), before)


@pytest.mark.parametrize("quantization", ["int8", None])
def test_the_runner_gathers_its_operands_and_a_onednn_model_keeps_its_own(tiny_model_dir, quantization, monkeypatch,
                                                                         request):
    """Quantized blocks and specjet's packed float32 weights move (the same logits); a float32 model on oneDNN's
    blocked weights (SPECJET_FP32_GEMM=onednn) has nothing that moves."""
    if quantization is None and fp32_gemm.default_isa() == "onednn":
        pytest.skip("no float32 GEMM of specjet's here (no AVX2 + FMA, or no extension)")
    gathered = _runner(tiny_model_dir, "float32", quantization, gather=True)
    pointers = sorted(t.data_ptr() for t in _operands(gathered.model))
    assert pointers and pointers[0] % HUGE_PAGE == 0  # the first operand opens the buffer
    assert torch.equal(_logits(gathered), _logits(_runner(tiny_model_dir, "float32", quantization, gather=False)))
    request.addfinalizer(fp32_gemm.default_isa.cache_clear)
    monkeypatch.setenv(fp32_gemm.ISA_ENV, "onednn")
    fp32_gemm.default_isa.cache_clear()
    plain = _runner(tiny_model_dir, "float32", None, gather=False)
    assert gather_operands(plain.model) is None  # oneDNN's blocked weights and dense parameters stay


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages to ask for here")
def test_the_buffer_is_advised_for_huge_pages():
    raw = torch.empty(4 * HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[skip:skip + 2 * HUGE_PAGE]
    assert advise_huge_pages(buffer)
    assert _thp_eligible(buffer.data_ptr()) is True
