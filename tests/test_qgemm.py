"""The quantized GEMM kernels (csrc/, kernels/qgemm.py): each instruction set this CPU runs equals
the torch reference (dequantize, then matmul) within fp32 rounding, and gives a row the same bits in
a call of any number of rows; the formats quantize within half a step; the fallback path agrees."""
from __future__ import annotations

import pytest
import torch

from specjet.engine.args import EngineArgs
from specjet.kernels import qgemm
from specjet.kernels.linear import pack_weight
from specjet.kernels.quant_formats import quantize_int8, quantize_q4_1, reference_gemm

# The default model's projections ([out, in]: q|k|v, o, gate|up, down) and a small odd one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (13, 96)]
FORMATS = {
    "q4_1": quantize_q4_1,
    "int8-channel": quantize_int8,
    "int8-g32": lambda w: quantize_int8(w, 32),
    "int8-g64": lambda w: quantize_int8(w, 64),
}
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 47, 63, 64)

pytestmark = pytest.mark.skipif(qgemm.extension() is None, reason="the C++ extension is not built")


def within_fp32_rounding(y, x, weight, bias=None):
    """|y - reference| <= 1e-4 * sum_k |x_k w_k| (+ a floor): fp32 sums of up to 1536 products in
    another order stay far inside it, a wrong weight or block does not."""
    ref = reference_gemm(x, weight, bias)
    bound = 1e-4 * (x.abs() @ weight.dequantize().abs().t()) + 1e-6
    return bool(((y - ref).abs() <= bound).all())


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request):
    n, k = request.param
    return 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))


@pytest.mark.parametrize("isa", qgemm.ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference_and_is_batch_invariant(weight, fmt, isa):
    if isa not in qgemm.supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    if isa == "scalar" and weight.numel() > 576 * 576:
        pytest.skip("the scalar fallback is slow; the smaller shapes cover it")
    if fmt == "int8-g64" and weight.shape[1] % 64:
        pytest.skip("K is not whole groups of 64")
    qw = FORMATS[fmt](weight)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS) + 3, weight.shape[1], generator=gen)  # 67 rows: two row chunks
    bias = torch.randn(weight.shape[0], generator=gen)
    full = qgemm.gemm(x, qw, bias, isa)
    assert within_fp32_rounding(full, x, qw, bias)
    assert within_fp32_rounding(qgemm.gemm(x, qw, None, isa), x, qw)
    alone = torch.cat([qgemm.gemm(x[i:i + 1], qw, bias, isa) for i in range(x.shape[0])])
    assert torch.equal(full, alone)
    for rows in ROW_COUNTS:  # each row of an M-row call == that row alone, M odd and even
        start = rows % 3
        assert torch.equal(qgemm.gemm(x[start:start + rows].contiguous(), qw, bias, isa), alone[start:start + rows])


def test_lm_head_shape_and_thread_count():
    """The head's shape (49152 x 576, Q8_0 blocks) under 1 and 2 threads: the same bits."""
    weight = 0.05 * torch.randn(49152, 576, generator=torch.Generator().manual_seed(3))
    qw = quantize_int8(weight, 32)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemm.gemm(x, qw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(qgemm.gemm(x, qw), one)
    assert torch.equal(qgemm.gemm(x[2:3].contiguous(), qw), one[2:3])
    assert within_fp32_rounding(one, x, qw)


def test_quantizers_round_to_the_nearest_step():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    q4 = quantize_q4_1(weight)
    step = q4.d.float().repeat_interleave(32, dim=1)
    assert bool(((q4.dequantize() - weight).abs() <= step / 2 + 1e-3 * step + 1e-3).all())
    assert int(q4.codes().max()) <= 15
    for group in (None, 32):
        q8 = quantize_int8(weight, group)
        scale = q8.s.float().repeat_interleave(q8.group, dim=1)
        assert bool(((q8.dequantize() - weight).abs() <= scale / 2 + 1e-3 * scale).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.randn(4, 48))


def test_fallback_path_is_the_dequantized_float_weight():
    """Without the extension a QuantizedLinear runs its dequantized weight through kernels/linear.py."""
    weight = quantize_q4_1(0.05 * torch.randn(96, 128, generator=torch.Generator().manual_seed(6)))
    layer = qgemm.QuantizedLinear(weight, None, fallback=pack_weight(weight.dequantize().t().contiguous()))
    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(7))
    y = layer(x)
    assert y.shape == (3, 7, 96)
    assert within_fp32_rounding(y.reshape(21, 96), x.reshape(21, 128), weight)


def test_bad_inputs_are_refused():
    qw = quantize_q4_1(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32|K / 2"):
        qgemm.gemm(torch.randn(2, 48), qw)
    with pytest.raises(ValueError, match="int8, int4, gguf"):
        EngineArgs.from_kwargs(quantization="int3")
    with pytest.raises(TypeError, match="quantization"):
        EngineArgs.from_kwargs(quantization=4)
