"""What the tests of the kernels with several instruction sets share (kernels/qgemm.py, kernels/bf16_gemm.py): the
CPU flags Linux lists, grammar bitmasks for their masked LM heads, and the check of a forced set (SPECJET_QGEMM_ISA, SPECJET_BF16_GEMM): an unknown name, or
a set this CPU does not run, is refused with the reason (not run into a SIGILL); an available one is taken."""
from __future__ import annotations

import pytest
import torch


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def check_forced_isa(module, monkeypatch, request, names: str, available: str) -> None:
    """``module``: its ISA_ENV, ISAS, supported_isas() and the cached default_isa(); ``names``: the list its
    refusal gives; ``available``: a set every CPU runs."""
    request.addfinalizer(module.default_isa.cache_clear)
    monkeypatch.setenv(module.ISA_ENV, "avx1024")
    module.default_isa.cache_clear()
    with pytest.raises(ValueError, match=f"use one of {names}"):
        module.default_isa()
    missing = [isa for isa in module.ISAS if isa not in module.supported_isas()]
    if missing:
        monkeypatch.setenv(module.ISA_ENV, missing[-1])
        module.default_isa.cache_clear()
        with pytest.raises(ValueError, match="does not run it"):
            module.default_isa()
    monkeypatch.setenv(module.ISA_ENV, available)
    module.default_isa.cache_clear()
    assert module.default_isa() == available


def token_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] with bit t % 32 of word t // 32 set where allowed[r, t] (xgrammar's layout)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, 32 * ((vocab + 31) // 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
