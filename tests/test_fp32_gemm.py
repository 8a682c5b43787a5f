"""specjet's float32 GEMM (csrc/fp32_gemm.cpp, kernels/fp32_gemm.py): close to torch's product, batch-invariant
(a row's bits alone == among others at every row count a decode step, a verify or a prefill gives it, across the
kernel's row blocks, chunks and slabs), the same bits from its AVX2 and AVX-512 builds, the packed layout, which
weights it takes, and a float32 engine on it: speculative == plain."""
from __future__ import annotations

import pytest
import torch

from isa_checks import check_forced_isa, check_masked_head

import specjet
from specjet.kernels import cpu_ops, fp32_gemm
from specjet.kernels.fp32_gemm import Fp32Linear, fp32_gemm_reference
from specjet.kernels.linear import PackedLinear, check_input, pack_onednn, pack_weight

KERNELS = [isa for isa in fp32_gemm.supported_isas() if isa != "onednn"]
needs_kernel = pytest.mark.skipif(not KERNELS, reason="no AVX2 + FMA on this CPU (or no extension): oneDNN only")


def weights(k: int, n: int, seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(k, n, generator=torch.Generator().manual_seed(seed))


def test_the_packed_layout_and_its_inverse():
    w = torch.arange(5 * 48, dtype=torch.float32).reshape(5, 48)
    packed = fp32_gemm.pack(w)
    assert packed.shape == (3, 5, 16)
    for g, k, c in [(0, 0, 0), (1, 4, 7), (2, 3, 15)]:
        assert packed[g, k, c] == w[k, 16 * g + c]
    assert torch.equal(fp32_gemm.unpack(packed), w)


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 8192), (37, 48), (1, 16)])
@pytest.mark.parametrize("rows", [1, 2, 5, 10, 17])
def test_close_to_torchs_product_with_and_without_bias(isa, shape, rows):
    k, n = shape
    w = weights(k, n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    for b in (None, bias):
        y = Fp32Linear.build(w, b, isa=isa)(x)
        ref = x.double() @ w.double() + (0.0 if b is None else b.double())
        # float32 sums against float64's: a few ulps of the sum's magnitude, growing with K; torch's own float32
        # product (the reference beside the kernel) within the same bound
        assert torch.allclose(fp32_gemm_reference(x, w, b).double(), ref, rtol=1e-5, atol=1e-6 * k ** 0.5)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (101, 80)])
def test_a_row_has_the_same_bits_alone_and_among_others(isa, shape):
    """Every row count from 1 to 17 (decode steps and verifies, every row-block remainder), then counts that cross
    the kernel's slab of 48 rows and the chunks of a long call: each row equals the same row computed alone.
    Inputs of widely spread magnitudes, whose sums another order rounds apart (kernels/linear.py's check)."""
    k, n = shape
    lin = Fp32Linear.build(weights(k, n), torch.randn(n), isa=isa)
    x = check_input(130, weights(k, n))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in list(range(2, 18)) + [47, 48, 49, 96, 130]:
        for start in range(0, x.shape[0] - rows + 1, max(rows, 29)):
            assert torch.equal(lin(x[start:start + rows]), alone[start:start + rows]), (rows, start)


@pytest.mark.skipif(len(KERNELS) < 2, reason="the AVX-512 build needs AVX-512F")
def test_the_avx2_and_avx512_builds_give_the_same_bits():
    w, bias = weights(576, 960), torch.randn(960)
    x = check_input(64, w)
    for rows in (1, 3, 10, 16, 64):
        ys = [Fp32Linear.build(w, bias, isa=isa)(x[:rows]) for isa in KERNELS]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), rows


@needs_kernel
def test_the_calls_shapes_dtypes_and_refusals():
    w, bias = weights(64, 32), torch.randn(32)
    lin = Fp32Linear.build(w, bias)
    x = torch.randn(2, 3, 64)
    y = lin(x)
    assert y.shape == (2, 3, 32) and torch.equal(y.reshape(6, 32), lin(x.reshape(6, 64)))
    assert torch.equal(lin(x.reshape(6, 64).t().contiguous().t()), lin(x.reshape(6, 64)))  # a strided input
    assert lin(x.double()).dtype == torch.float64
    assert lin(torch.randn(0, 64)).shape == (0, 32)
    assert lin.out_features == 32 and torch.equal(lin.weight_t(), w)
    empty_k = Fp32Linear.build(torch.zeros(0, 16), torch.arange(16.0))
    assert torch.equal(empty_k(torch.zeros(3, 0)), torch.arange(16.0).expand(3, 16))  # no products: the bias
    ext = cpu_ops.extension()
    with pytest.raises(RuntimeError, match="x has 63 columns"):
        ext.fp32_gemm(torch.randn(2, 63), lin.weight, None, lin.isa)
    with pytest.raises(RuntimeError, match="float32"):
        ext.fp32_gemm(torch.randn(2, 64).double(), lin.weight, None, lin.isa)
    with pytest.raises(RuntimeError, match="bias must be"):
        ext.fp32_gemm(torch.randn(2, 64), lin.weight, torch.randn(31), lin.isa)
    with pytest.raises(RuntimeError, match="not supported"):
        ext.fp32_gemm(torch.randn(2, 64), lin.weight, None, 7)
    with pytest.raises(ValueError, match="does not apply"):
        Fp32Linear.build(weights(64, 40))  # N not a multiple of 16


def test_a_named_instruction_set_the_build_lacks_is_refused_at_build(monkeypatch):
    """Without the extension (or on a CPU without the set), build(isa=...) is a ValueError naming what is there; it
    was built, and its first call failed with "'NoneType' object has no attribute 'fp32_gemm'"."""
    monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    for isa in ("avx2", "avx512"):
        with pytest.raises(ValueError, match=f"isa '{isa}' is not available here"):
            Fp32Linear.build(weights(64, 32), isa=isa)


@needs_kernel
def test_pack_weight_takes_the_kernel_for_float32_and_onednn_elsewhere():
    on_kernel = fp32_gemm.default_isa() != "onednn"
    assert isinstance(pack_weight(weights(576, 960)), Fp32Linear if on_kernel else PackedLinear)
    assert isinstance(pack_weight(weights(64, 40)), PackedLinear)  # N not a multiple of 16
    assert isinstance(pack_onednn(weights(576, 960)), PackedLinear)


def test_a_forced_instruction_set_is_checked(monkeypatch, request):
    """SPECJET_FP32_GEMM: an unknown name, or a set this CPU does not run, is refused with the reason; onednn always
    runs (and gives oneDNN's plans)."""
    check_forced_isa(fp32_gemm, monkeypatch, request, "onednn, avx2, avx512", "onednn")
    assert isinstance(pack_weight(weights(576, 960)), PackedLinear)


@needs_kernel
@pytest.mark.parametrize("overlap", [False, True])
def test_a_float32_engine_decodes_on_the_kernel_and_speculation_keeps_plain_ids(tiny_model_dir, overlap):
    """The tiny model's float32 projections all on the kernel (so every float32 engine test runs it), a greedy
    n-gram engine's ids equal plain decoding's on a mixed batch whose verifies take drafts, on the plain and the
    overlap loop, KV invariant after."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [9, 10, 11, 9, 10, 11, 9, 10], [20, 21]]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    outputs = {}
    for algorithm in (None, "NGRAM"):
        kwargs = {} if algorithm is None else {"speculative_algorithm": algorithm,
                                               "disable_overlap_schedule": not overlap}
        with specjet.Engine(model_path=str(tiny_model_dir), dtype="float32", quantization=None,
                            max_total_tokens=2048, **kwargs) as eng:
            packed = [m.packed for m in eng.worker.runner.model.modules() if getattr(m, "packed", None) is not None]
            assert packed and all(isinstance(p, Fp32Linear) for p in packed)
            outputs[algorithm] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
            if algorithm is not None:
                assert eng.get_server_info()["stats"]["spec_phases"]["tree_nodes"] > 1  # drafts were verified
            eng.check_kv_invariant()
    assert outputs["NGRAM"] == outputs[None]


@needs_kernel
def test_a_feature_extractor_gets_onednns_single_call(tiny_model_dir):
    """unchunk_projections (train/): no batch invariance asked, oneDNN's one call of a long pack instead."""
    from test_layer_stack import make_runner

    runner = make_runner(tiny_model_dir, "float32", None)
    model = runner.model
    assert any(isinstance(getattr(m, "packed", None), Fp32Linear) for m in model.modules())
    model.unchunk_projections()
    assert not any(isinstance(getattr(m, "packed", None), Fp32Linear) for m in model.modules())


@needs_kernel
@pytest.mark.parametrize("isa", KERNELS)
def test_masked_rows_get_the_full_calls_bits_on_their_allowed_columns(isa):
    """``Fp32Linear.masked`` (fp32_gemm_masked): a masked row allowing few columns has exactly the full call's values
    there and -inf elsewhere, whichever groups its columns fall in (one, several, more than a work item's eight,
    the last); masked rows allowing many, and unmasked rows, are the full call's; columns past the mask's width are
    computed; every row sparse, and a row alone, give the same bits."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1008, 96  # 63 groups; the mask covers 992 columns (31 words): the last 16 lie past it
    lin = Fp32Linear.build(weights(k, n, seed=12), torch.randn(n, generator=gen), isa)
    assert lin.has_masked_kernel
    x = check_input(7, weights(k, n))
    bitmask, masked = check_masked_head(lin, x, gen)
    ext = cpu_ops.extension()
    with pytest.raises(RuntimeError, match="bitmask"):
        ext.fp32_gemm_masked(x, lin.weight, None, lin.isa, bitmask.long(), masked, 256)
    with pytest.raises(RuntimeError, match="masked"):
        ext.fp32_gemm_masked(x, lin.weight, None, lin.isa, bitmask, masked[:1], 256)
