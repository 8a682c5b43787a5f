"""specjet's bf16 GEMM (csrc/bf16_gemm.cpp, kernels/bf16_gemm.py): close to the float32 reference, each
instruction set batch-invariant (a row's bits alone == among others, at every row count a verify or a
prefill gives it), the packed layout, which CPUs get which kernel, and which weights stay on oneDNN."""
from __future__ import annotations

import os
import platform

import pytest
import torch

from isa_checks import check_forced_isa, check_masked_head, cpu_flags

from specjet.kernels import bf16_gemm
from specjet.kernels.bf16_gemm import Bf16Linear, bf16_gemm_reference
from specjet.kernels.linear import PackedLinear, pack_weight

KERNELS = [isa for isa in bf16_gemm.supported_isas() if isa != "onednn"]
needs_kernel = pytest.mark.skipif(not KERNELS, reason="no AVX-512 BF16 on this CPU (or no extension): oneDNN only")


def weights(k: int, n: int, seed: int = 0) -> torch.Tensor:
    return (0.05 * torch.randn(k, n, generator=torch.Generator().manual_seed(seed))).bfloat16()


def rows_of(count: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_the_packed_layout():
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48).bfloat16()
    packed = bf16_gemm.pack(w)
    assert packed.shape == (3, 32, 16, 2)
    for g, p, c, j in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 7, 1), (2, 31, 15, 0), (2, 31, 15, 1)]:
        assert packed[g, p, c, j] == w[2 * p + j, 16 * g + c]


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 16), (576, 48)])
def test_close_to_the_float32_reference_with_and_without_bias(isa, shape):
    """Sums in float32 in another order than the reference's: at most one bf16 rounding step apart."""
    k, n = shape
    w, x = weights(k, n), rows_of(37, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    for b in (None, bias):
        ref = bf16_gemm_reference(x, w, b).float()
        got = Bf16Linear.build(w, b, isa)(x).float()
        assert got.dtype == torch.float32 and got.shape == ref.shape
        ulp = ref.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at each output's magnitude
        assert ((got - ref).abs() <= ulp + 1e-6).all(), (isa, shape, (got - ref).abs().max().item())
        # a wrong bias or a missing one is far more than a rounding step
        if b is not None:
            assert not torch.allclose(got, bf16_gemm_reference(x, w, None).float(), atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 3072), (576, 112), (96, 80)])
def test_each_kernel_gives_a_row_its_bits_at_every_row_count(isa, shape):
    """Rows 1..67 (the AMX kernel's whole tiles, remainders, two or three tiles that go in pairs through each
    weight tile (17-48 rows, over odd and even group counts) and four or more that do not; the VDPBF16PS kernel's
    row blocks of 6 and every remainder, and its 7-10-row calls that take the k-pairs in chunks, over
    4-group sets and the 1-3 groups left, chunks whole and cut short): each row has the bits it has alone."""
    k, n = shape
    lin = Bf16Linear.build(weights(k, n, seed=2), None, isa)
    x = rows_of(67, k, seed=4)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(67)])
    for m in range(1, 68):
        assert torch.equal(lin(x[:m]), alone[:m]), (isa, shape, m)


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
def test_the_lm_head_shape(isa):
    """The default model's head (576 -> 49152) at a decode's and a verify's row counts."""
    lin = Bf16Linear.build(weights(576, 49152, seed=5), None, isa)
    x = rows_of(17, 576, seed=6)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(17)])
    for m in (2, 16, 17):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    ref = bf16_gemm_reference(x, weights(576, 49152, seed=5), None).float()
    assert ((alone.float() - ref).abs() <= ref.abs().clamp_min(1e-3) * 2.0 ** -7 + 1e-6).all()


@needs_kernel
def test_three_dimensional_and_float_inputs_keep_their_shape_and_dtype():
    lin = Bf16Linear.build(weights(64, 32), None, KERNELS[0])
    x = rows_of(6, 64).reshape(2, 3, 64)
    y = lin(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 32), lin(x.reshape(6, 64)))
    yf = lin(x.float())
    assert yf.dtype == torch.float32 and torch.equal(yf.bfloat16(), y)


@needs_kernel
def test_pack_weight_takes_the_kernel_where_it_applies_and_onednn_elsewhere():
    # The kernel is this process's default where the CPU has AVX-512 BF16 (test_the_kernels_are_offered_where_the_
    # cpu_has_them pins that choice to the CPU's flags), unless SPECJET_BF16_GEMM=onednn says otherwise.
    on_kernel = bf16_gemm.default_isa() != "onednn"
    assert isinstance(pack_weight(weights(576, 960)), Bf16Linear if on_kernel else PackedLinear)
    assert isinstance(pack_weight(weights(40, 32)), PackedLinear)  # K not a multiple of 32
    assert isinstance(pack_weight(weights(64, 40)), PackedLinear)  # N not a multiple of 16
    assert not isinstance(pack_weight(weights(64, 32).float()), Bf16Linear)  # float32 weights (kernels/fp32_gemm.py)


@pytest.mark.skipif(platform.system() != "Linux", reason="AMX is asked for from the Linux kernel")
def test_the_kernels_are_offered_where_the_cpu_has_them():
    """A silent fallback to oneDNN would leave bf16 decoding at half speed: where Linux lists the flags,
    the kernels must be offered, and the tiles chosen where they are."""
    flags = cpu_flags()
    from specjet.kernels import cpu_ops

    if cpu_ops.extension() is None:
        pytest.skip("the C++ extension is not built")
    assert ("avx512_bf16" in bf16_gemm.supported_isas()) == ("avx512_bf16" in flags)
    assert ("amx" in bf16_gemm.supported_isas()) == ({"avx512_bf16", "amx_tile", "amx_bf16"} <= flags)
    if not os.environ.get(bf16_gemm.ISA_ENV):  # the tiles by default, else the VDPBF16PS chains
        offered = bf16_gemm.supported_isas()
        assert bf16_gemm.default_isa() == ("amx" if "amx" in offered else "avx512_bf16" if "avx512_bf16" in offered
                                           else "onednn")


def test_a_forced_instruction_set_is_checked(monkeypatch, request):
    """SPECJET_BF16_GEMM: an unknown name, or a set this CPU does not run, is refused with the reason;
    onednn always runs (and gives the oneDNN plans)."""
    check_forced_isa(bf16_gemm, monkeypatch, request, "onednn, avx512_bf16, amx", "onednn")
    assert isinstance(pack_weight(weights(576, 960)), PackedLinear)


def test_a_named_instruction_set_the_build_lacks_is_refused_at_build(monkeypatch):
    """Without the extension (or on a CPU without the set), build(isa=...) is a ValueError naming what is there; it
    was built, and its first call failed with "'NoneType' object has no attribute 'bf16_gemm'"."""
    from specjet.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    for isa in ("avx512_bf16", "amx"):
        with pytest.raises(ValueError, match=f"isa '{isa}' is not available here"):
            Bf16Linear.build(weights(64, 32), None, isa)


@needs_kernel
def test_the_kernel_refuses_operands_that_do_not_fit():
    from specjet.kernels import cpu_ops

    ext, lin = cpu_ops.extension(), Bf16Linear.build(weights(64, 32), None, KERNELS[0])
    isa = bf16_gemm.ISAS[KERNELS[0]]
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_gemm(rows_of(2, 64).float(), lin.weight, None, isa)
    with pytest.raises(RuntimeError, match="columns"):
        ext.bf16_gemm(rows_of(2, 96), lin.weight, None, isa)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16_gemm(rows_of(2, 64), lin.weight, torch.zeros(16), isa)
    with pytest.raises(RuntimeError, match="instruction set"):
        ext.bf16_gemm(rows_of(2, 64), lin.weight, None, 7)
    assert ext.bf16_gemm(rows_of(0, 64), lin.weight, None, isa).shape == (0, 32)


@pytest.mark.skipif("avx512_bf16" not in KERNELS, reason="no AVX-512 BF16 on this CPU (or no extension)")
def test_masked_rows_get_the_full_calls_bits_on_their_allowed_columns():
    """``Bf16Linear.masked`` (bf16_gemm_masked): a masked row allowing few columns has exactly the full call's
    values there (as float32) and -inf elsewhere, whichever groups its columns fall in (one, several, more
    than a work item's eight, the last); masked rows allowing many, and unmasked rows, are the full call's;
    columns past the mask's width are computed; every row sparse, and a row alone, give the same bits."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1008, 96  # 63 groups; the mask covers 992 columns (31 words): the last 16 lie past it
    lin = Bf16Linear.build(weights(k, n, seed=12), torch.randn(n, generator=gen).bfloat16(), "avx512_bf16")
    assert lin.has_masked_kernel
    x = rows_of(7, k, seed=13)
    check_masked_head(lin, x, gen)
    # A mask covering every column that allows none (a node after the grammar's end): -inf everywhere.
    covered = Bf16Linear.build(weights(k, 992, seed=12), None, "avx512_bf16")
    nothing = covered.masked(x[:2].contiguous(), torch.zeros(2, 31, dtype=torch.int32), torch.tensor([True, False]))
    assert bool((nothing[0] == float("-inf")).all())
    assert torch.equal(nothing[1], covered(x[1:2]).float()[0])


@needs_kernel
def test_the_masked_kernel_is_the_vdpbf16ps_one_and_checks_its_masks():
    from specjet.kernels import cpu_ops

    ext, isa = cpu_ops.extension(), bf16_gemm.ISAS["avx512_bf16"]
    lin = Bf16Linear.build(weights(64, 32), None, "avx512_bf16")
    x, bitmask, masked = rows_of(2, 64), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="bitmask"):
        ext.bf16_gemm_masked(x, lin.weight, None, isa, bitmask.long(), masked, 256)
    with pytest.raises(RuntimeError, match="bitmask"):
        ext.bf16_gemm_masked(x, lin.weight, None, isa, bitmask[:1], masked, 256)
    with pytest.raises(RuntimeError, match="masked"):
        ext.bf16_gemm_masked(x, lin.weight, None, isa, bitmask, masked[:1], 256)
    if "amx" in KERNELS:  # the tiles' sums are not recomputed column by column: no masked head on AMX
        amx = Bf16Linear.build(weights(64, 32), None, "amx")
        assert not amx.has_masked_kernel and amx.masked(x, bitmask, masked) is None
        with pytest.raises(RuntimeError, match="VDPBF16PS"):
            ext.bf16_gemm_masked(x, amx.weight, None, bf16_gemm.ISAS["amx"], bitmask, masked, 256)
