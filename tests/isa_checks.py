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


def check_masked_head(lin, x: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked LM head's cases for ``lin`` (1008 outputs, ``lin.masked``) on 7 rows x: a masked row allowing few
    columns gets exactly the full call's values there (as float32) and -inf elsewhere, whichever groups its columns
    fall in (one, several, more than a work item's eight, the last); masked rows allowing many, and unmasked rows,
    get the full call's; columns past the mask's width (992 columns, 31 words) are computed; every row sparse, and a
    row alone, give the same bits. Returns the bitmask and the masked flags it used."""
    n = 1008
    allowed = torch.zeros(7, 992, dtype=torch.bool)
    allowed[0, [0, 15, 16, 500, 991]] = True  # sparse, four groups
    allowed[1] = torch.rand(992, generator=gen) < 0.5  # dense: > max_allowed
    allowed[2, 7] = True  # one column
    allowed[4, :300] = True  # 300 columns in 19 groups: sparse under a larger limit only
    allowed[6, ::37] = True  # 27 columns in as many groups: several work items
    masked = torch.tensor([True, True, True, False, True, True, True])  # row 3 unmasked; row 5 allows nothing
    bitmask = token_bitmask(allowed)
    full = lin(x).float()
    for limit in (256, 400):
        got = lin.masked(x, bitmask, masked, limit)
        assert got.dtype == torch.float32 and got.shape == (7, n)
        dense = {1, 3} | ({4} if limit < 300 else set())
        for r in range(7):
            if r in dense:
                assert torch.equal(got[r], full[r]), (limit, r)
                continue
            keep = torch.cat([allowed[r], torch.ones(16, dtype=torch.bool)])  # past the mask: computed
            assert torch.equal(got[r][keep], full[r][keep]), (limit, r)
            assert bool((got[r][~keep] == float("-inf")).all()), (limit, r)
    rows = [0, 2, 5, 6]
    sparse_only = lin.masked(x[rows].contiguous(), bitmask[rows].contiguous(), masked[rows].contiguous())
    assert torch.equal(sparse_only, lin.masked(x, bitmask, masked)[rows])
    assert torch.equal(lin.masked(x[1:2].contiguous(), bitmask[1:2].contiguous(), masked[1:2].contiguous()),
                       full[1:2])
    return bitmask, masked
