"""float32 products as three bf16 tile products (csrc/bf16_gemm.cpp's bf16x3_gemm, kernels/bf16_gemm.py's
Bf16x3Linear): the split, the kernel against its float64 emulation, its distance from float32 (far inside
bf16's), a row's bits at every row count, the operands it refuses, and a feature model's layers on it
(``LlamaForCausalLM.bf16x3_projections``). The kernel needs AMX tiles; elsewhere only the fallbacks run."""
from __future__ import annotations

import pytest
import torch

from model_harness import load_runner

from specjet.kernels import bf16_gemm, cpu_ops
from specjet.kernels.bf16_gemm import Bf16x3Linear, bf16x3_gemm_reference, split_bf16
from specjet.kernels.linear import PackedLinear

needs_tiles = pytest.mark.skipif(not bf16_gemm.bf16x3_available(), reason="no AMX tiles on this CPU (or no extension)")
SHAPES = [(576, 960), (1536, 576), (64, 48)]  # the default model's qkv and down projections, and a small one


def weights(k: int, n: int, seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(k, n, generator=torch.Generator().manual_seed(seed))


def rows_of(count: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, k, generator=torch.Generator().manual_seed(seed))


def test_the_split_keeps_sixteen_bits():
    t = torch.cat([rows_of(1, 4096).view(-1) * 10.0 ** torch.randint(-6, 6, (4096,)).float(),
                   torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf")])])
    hi, lo = split_bf16(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, t.to(torch.bfloat16))  # hi: torch's rounding to bf16 (to nearest even)
    finite = torch.isfinite(t)
    whole = hi.double() + lo.double()
    assert ((whole[finite] - t[finite].double()).abs() <= 2.0 ** -16 * t[finite].double().abs()).all()
    assert (lo[~finite] == 0).all() and torch.equal(hi[~finite].float(), t[~finite])
    # the rest is not within bf16's rounding of t alone (lo matters)
    assert ((hi.double() - t.double()).abs()[finite] > 2.0 ** -12 * t.double().abs()[finite]).any()


@needs_tiles
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_its_float64_emulation_summed_in_float32(shape):
    k, n = shape
    w, bias = weights(k, n), torch.randn(n)
    for count in (1, 17, 300):  # 300 rows cross the kernel's row blocks for these K
        x = rows_of(count, k)
        for b in (None, bias):
            y = Bf16x3Linear.build(w, b)(x)
            ref = bf16x3_gemm_reference(x, w, b)
            # float32 sums of 3K products in the tiles' order against float64 ones
            scale = (x.abs().double() @ w.abs().double()).float() + (0 if b is None else b.abs())
            assert ((y - ref).abs() <= 3 * k * 2.0 ** -24 * scale + 1e-30).all()


@needs_tiles
@pytest.mark.parametrize("shape", SHAPES)
def test_it_is_float32_to_about_two_to_the_minus_sixteen(shape):
    """Within 2^-15 of |x| @ |W| of float32's product; bf16's own product is not (so the bound tells the
    three products from one)."""
    k, n = shape
    w, x = weights(k, n), rows_of(40, k)
    exact = x.double() @ w.double()
    scale = x.abs().double() @ w.abs().double()
    y = Bf16x3Linear.build(w)(x).double()
    assert ((y - exact).abs() <= 2.0 ** -15 * scale).all()
    bf16 = (x.bfloat16().double() @ w.bfloat16().double())
    assert not ((bf16 - exact).abs() <= 2.0 ** -15 * scale).all()


@needs_tiles
def test_a_row_gets_its_bits_at_every_row_count():
    k, n = 576, 960
    linear = Bf16x3Linear.build(weights(k, n), torch.randn(n))
    x = rows_of(70, k)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(70)])
    for count in (2, 15, 16, 17, 33, 70):
        assert torch.equal(linear(x[:count]), alone[:count])


@needs_tiles
def test_shapes_and_dtypes_are_kept():
    linear = Bf16x3Linear.build(weights(64, 48))
    x = rows_of(6, 64).view(2, 3, 64)
    y = linear(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    y16 = linear(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and y16.shape == (2, 3, 48)
    assert linear(rows_of(0, 64)).shape == (0, 48)
    assert linear.out_features == 48


@needs_tiles
def test_the_kernel_refuses_operands_that_do_not_fit():
    ext = cpu_ops.extension()
    linear = Bf16x3Linear.build(weights(64, 48))
    with pytest.raises(RuntimeError, match="float32"):
        ext.bf16x3_gemm(rows_of(2, 64).bfloat16(), linear.weight, None)
    with pytest.raises(RuntimeError, match="columns"):
        ext.bf16x3_gemm(rows_of(2, 96), linear.weight, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16x3_gemm(rows_of(2, 64), linear.weight, torch.zeros(47))
    with pytest.raises(ValueError, match="does not apply"):
        Bf16x3Linear.build(weights(60, 48))  # K not a multiple of 32
    with pytest.raises(ValueError, match="does not apply"):
        Bf16x3Linear.build(weights(64, 48).bfloat16())


def test_without_tiles_nothing_applies(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(bf16_gemm, "bf16x3_available", lambda: False)
    assert not Bf16x3Linear.applies(weights(64, 48))
    runner = load_runner(tiny_model_dir, tokens=256)
    before = [m.packed for m in runner.model.modules() if hasattr(m, "packed")]
    assert runner.model.bf16x3_projections() is False
    assert [m.packed for m in runner.model.modules() if hasattr(m, "packed")] == before


@needs_tiles
def test_a_feature_model_on_bf16x3_layers(tiny_model_dir):
    """The decoder layers' float32 projections become Bf16x3Linear (the LM head keeps oneDNN), the C++ stack is
    rebuilt with them, its features equal the Python loop's bits and float32's to a small tolerance."""
    from specjet.models.forward_batch import FeatureLayers
    from specjet.train.features import target_features
    from specjet.train.data import Sample

    float32 = load_runner(tiny_model_dir, tokens=1024)
    float32.model.unchunk_projections()
    x3 = load_runner(tiny_model_dir, tokens=1024)
    x3.model.unchunk_projections()
    assert x3.config.hidden_size % 32 == 0
    assert x3.model.bf16x3_projections() is True
    layer_ops = [m.packed for layer in x3.model.layers for m in layer.modules() if hasattr(m, "packed")]
    assert layer_ops and all(isinstance(p, Bf16x3Linear) for p in layer_ops)
    assert isinstance(x3.model.lm_head.packed, PackedLinear)
    assert x3.model.layer_stack is not None
    g = torch.Generator().manual_seed(3)
    samples = [Sample(ids=torch.randint(0, 1000, (n,), generator=g).tolist(), prompt_len=4, source="x")
               for n in (37, 90, 5)]
    capture = FeatureLayers((0, 1))
    reference = target_features(float32, samples, capture)
    stacked = target_features(x3, samples, capture)
    stack = x3.model.layer_stack
    x3.model.layer_stack = None  # the same operands one Python call at a time
    looped = target_features(x3, samples, capture)
    x3.model.layer_stack = stack
    for a, b, c in zip(stacked, looped, reference):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-3, atol=2e-3)
