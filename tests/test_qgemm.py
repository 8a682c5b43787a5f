"""The quantized GEMM kernels (csrc/, kernels/qgemm.py, kernels/dot_layout.py): each instruction set
this CPU runs equals the reference arithmetic (int8 activations per 32-block, exact integer block
sums, then float) within fp32 rounding, every instruction set gives the same bits, and a row gets the
same bits in a call of any number of rows or threads; the packing round-trips; the formats quantize
within half a step; the activations' quantization costs little against the float product; the
fallback path agrees. "amx" (AVX-512 VNNI, and AMX tile products for calls of enough rows) is one of
the instruction sets where the CPU has the tiles."""
from __future__ import annotations

import platform

import pytest
import torch

from isa_checks import check_forced_isa, cpu_flags, token_bitmask

from specjet.engine.args import EngineArgs
from specjet.kernels import qgemm
from specjet.kernels.dot_layout import error_bound, pack, quantize_activations, reference_gemm, unpack
from specjet.kernels.linear import pack_weight
from specjet.kernels.quant_formats import quantize_int8, quantize_q4_1

# The default model's projections ([out, in]: q|k|v, o, gate|up, down), an odd N and a short K.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (13, 96), (40, 64)]
FORMATS = {
    "q4_1": quantize_q4_1,
    "int8-channel": quantize_int8,
    "int8-g32": lambda w: quantize_int8(w, 32),
    "int8-g64": lambda w: quantize_int8(w, 64),
}
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 47, 63, 64)

pytestmark = pytest.mark.skipif(qgemm.extension() is None, reason="the C++ extension is not built")


def close_to_reference(y, x, weight, bias=None):
    ref = reference_gemm(x, weight, bias)
    return bool(((y.double() - ref).abs() <= error_bound(x, weight)).all())


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request):
    n, k = request.param
    return 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_isa_matches_the_reference_and_the_others_and_is_batch_invariant(weight, fmt):
    if fmt == "int8-g64" and weight.shape[1] % 64:
        pytest.skip("K is not whole groups of 64")
    qw = FORMATS[fmt](weight)
    packed = pack(qw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS) + 3, weight.shape[1], generator=gen)  # 67 rows: > one 8-row tile
    x[5, :32] = 0  # an all-zero block: scale 0
    x[6] *= 1e4  # a large row
    bias = torch.randn(weight.shape[0], generator=gen)
    results = {}
    for isa in qgemm.supported_isas():
        if isa == "scalar" and weight.numel() > 576 * 576:
            continue  # the scalar fallback is slow; the smaller shapes cover it
        full = qgemm.gemm(x, packed, bias, isa)
        assert close_to_reference(full, x, qw, bias), isa
        assert close_to_reference(qgemm.gemm(x, packed, None, isa), x, qw), isa
        alone = torch.cat([qgemm.gemm(x[i:i + 1], packed, bias, isa) for i in range(x.shape[0])])
        assert torch.equal(full, alone), isa
        for rows in ROW_COUNTS:  # each row of an M-row call == that row alone, M odd and even
            start = rows % 3
            got = qgemm.gemm(x[start:start + rows].contiguous(), packed, bias, isa)
            assert torch.equal(got, alone[start:start + rows]), (isa, rows)
        results[isa] = full
    first = next(iter(results.values()))
    for isa, full in results.items():  # integer sums are exact and the float steps are the same
        assert torch.equal(full, first), isa


@pytest.fixture
def wide_tiles(request):
    """The extension's Q4_1 tiling switch, put back to the CPU's choice after the test."""
    ext = qgemm.extension()
    request.addfinalizer(lambda: ext.set_q4_1_wide_tiles(-1))
    return ext


@pytest.mark.skipif("avx512" not in (qgemm.supported_isas() if qgemm.extension() else []),
                    reason="the 3-group x 4-row tiles are the AVX-512 kernel's")
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (13 * 16 + 5, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_q4_1_wide_and_one_group_tiles_give_the_same_bits(shape, wide_tiles):
    """A Q4_1 call of 12 rows or more runs 3-group x 4-row tiles or one-group 8-row tiles, by CPU: each row's
    bits are the same either way, and the same as that row alone (13 x 16 + 5 columns: whole triples, a
    leftover group and a partial one)."""
    n, k = shape
    packed = pack(quantize_q4_1(0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(10))
    for isa in [i for i in ("avx512", "amx") if i in qgemm.supported_isas()]:
        alone = torch.cat([qgemm.gemm(x[i:i + 1], packed, bias, isa) for i in range(x.shape[0])])
        for rows in (12, 13, 15, 16, 17, 24, 31, 40):
            got = {}
            for wide in (0, 1):
                wide_tiles.set_q4_1_wide_tiles(wide)
                assert wide_tiles.q4_1_wide_tiles() == bool(wide)
                got[wide] = qgemm.gemm(x[:rows], packed, bias, isa)
            assert torch.equal(got[0], got[1]), (isa, rows)
            assert torch.equal(got[1], alone[:rows]), (isa, rows)


def test_q4_1_wide_tiles_are_off_on_a_zen_4_alone(monkeypatch, wide_tiles):
    """The CPU's choice: every CPU but AMD's family 25 (Zen 4, whose 512-bit instructions issue as two halves)
    keeps the 3-group tiles; SPECJET_QGEMM_WIDE_TILES=0 or 1 overrides it."""
    from specjet.kernels import cpu_features
    info = cpu_features._cpuinfo()
    zen4 = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    monkeypatch.delenv("SPECJET_QGEMM_WIDE_TILES", raising=False)
    wide_tiles.set_q4_1_wide_tiles(-1)
    assert wide_tiles.q4_1_wide_tiles() == (not zen4)
    for forced in ("0", "1"):
        monkeypatch.setenv("SPECJET_QGEMM_WIDE_TILES", forced)
        wide_tiles.set_q4_1_wide_tiles(-1)
        assert wide_tiles.q4_1_wide_tiles() == (forced == "1")
    with pytest.raises(RuntimeError, match="mode must be"):
        wide_tiles.set_q4_1_wide_tiles(2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_round_trips(fmt):
    weight = torch.randn(37, 128, generator=torch.Generator().manual_seed(2))  # 37: a partial group
    qw = FORMATS[fmt](weight)
    back = unpack(pack(qw))
    assert type(back) is type(qw)
    for name, value in vars(qw).items():
        assert torch.equal(getattr(back, name), value) if torch.is_tensor(value) else getattr(back, name) == value
    assert pack(qw).shape == (37, 128)


def test_activation_quantization_is_half_a_step_and_the_kernel_s():
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(8))
    xq, dx, sums = quantize_activations(x)
    step = dx.repeat_interleave(32, dim=1)
    assert bool(((xq.float() * step - x).abs() <= step / 2 + 1e-6).all())
    assert int(xq.abs().max()) == 127
    assert torch.equal(sums, dx * xq.view(16, 48, 32).sum(-1).float())
    # A scaled identity (codes 127, scale 1/128: exact in fp16) picks single activations, so the
    # kernel's output is 127 xq * (dx / 128) in one rounding: its quantization is this one.
    eye = quantize_int8(torch.eye(1536) * 127 / 128, 32)
    assert int(eye.q.max()) == 127 and float(eye.s.float().max()) == 1 / 128
    for isa in qgemm.supported_isas():
        assert torch.equal(qgemm.gemm(x, eye, None, isa), (127 * xq.float()) * (step / 128)), isa


def test_lm_head_shape_and_thread_count():
    """The head's shape (49152 x 576, Q8_0 blocks) under 1 and 2 threads: the same bits."""
    weight = 0.05 * torch.randn(49152, 576, generator=torch.Generator().manual_seed(3))
    qw = pack(quantize_int8(weight, 32))
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemm.gemm(x, qw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(qgemm.gemm(x, qw), one)
    assert torch.equal(qgemm.gemm(x[2:3].contiguous(), qw), one[2:3])


@pytest.mark.parametrize("fmt", ["q4_1", "int8-g32"])
def test_a_teams_shared_quantization_gives_each_row_its_bits(fmt):
    """A call of 64 row blocks or more (here 4 to 33 rows of the down projection's K = 1536) quantizes its
    activations on the whole team, each thread its share of the row blocks, before the columns: on 1 to 4
    threads, every instruction set, each row gets the bits it gets alone (a 1-row call quantizes on the
    calling thread)."""
    weight = 0.05 * torch.randn(576, 1536, generator=torch.Generator().manual_seed(5))
    packed = pack(FORMATS[fmt](weight))
    x = torch.randn(33, 1536, generator=torch.Generator().manual_seed(6))
    x[3, 64:96] = 0  # an all-zero block in a share
    threads = torch.get_num_threads()
    try:
        for isa in qgemm.supported_isas():
            if isa == "scalar":
                continue  # the scalar kernel is slow at this shape; the shared quantizer is the same per build
            alone = torch.cat([qgemm.gemm(x[i:i + 1], packed, None, isa) for i in range(x.shape[0])])
            for n in (1, 2, 3, 4):
                torch.set_num_threads(n)
                for rows in (4, 7, 16, 33):
                    assert torch.equal(qgemm.gemm(x[:rows], packed, None, isa), alone[:rows]), (isa, n, rows)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q4_1", "int8-g32"])
def test_int8_activations_stay_close_to_the_float_product(fmt):
    """Against x @ dequantize(W)^T: the int8 activations' rounding (<= half a step of 1/127 of the
    block's largest input) moves a well-spread output by well under 1% of its scale."""
    weight = 0.05 * torch.randn(576, 1536, generator=torch.Generator().manual_seed(9))
    qw = FORMATS[fmt](weight)
    x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(10))
    y = qgemm.gemm(x, qw)
    exact = x @ qw.dequantize().t()
    assert float((y - exact).abs().max() / exact.abs().max()) < 0.01


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
    layer = qgemm.QuantizedLinear(pack(weight), None, fallback=pack_weight(weight.dequantize().t().contiguous()))
    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(7))
    y = layer(x)
    assert y.shape == (3, 7, 96)
    assert torch.allclose(y.reshape(21, 96), x.reshape(21, 128) @ weight.dequantize().t(), atol=1e-5)
    assert torch.equal(layer.blocks().qs, weight.qs)


def test_bad_inputs_are_refused():
    qw = pack(quantize_q4_1(torch.randn(8, 64)))
    with pytest.raises(RuntimeError, match="takes K = 64"):
        qgemm.gemm(torch.randn(2, 48), qw)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        qgemm.gemm(torch.randn(2, 64, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match="int8, int4, gguf"):
        EngineArgs.from_kwargs(quantization="int3")
    with pytest.raises(TypeError, match="quantization"):
        EngineArgs.from_kwargs(quantization=4)


@pytest.mark.parametrize("group", [32, None])
def test_masked_rows_get_the_full_gemms_bits_on_their_allowed_columns(group, monkeypatch, request):
    """``QuantizedLinear.masked`` (int8_gemm_masked), per instruction set: a masked row allowing few columns
    has exactly the full GEMM's values there and -inf elsewhere; masked rows allowing many, and unmasked
    rows, are the full GEMM's rows; columns past the mask's width are computed; every row sparse (the
    weight never read) and none sparse."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1000, 96  # the mask covers 992 columns (31 words): the last 8 lie past it
    weight = 0.05 * torch.randn(n, k, generator=gen)
    qw = quantize_int8(weight, group) if group else quantize_int8(weight)
    layer = qgemm.QuantizedLinear.build(qw, torch.randn(n, generator=gen))
    x = torch.randn(6, k, generator=gen)
    allowed = torch.zeros(6, 992, dtype=torch.bool)
    allowed[0, [0, 31, 32, 500, 991]] = True  # sparse
    allowed[1] = torch.rand(992, generator=gen) < 0.5  # dense: > max_allowed
    allowed[2, 7] = True  # one column
    allowed[4, :300] = True  # 300 columns: sparse under a larger limit only
    masked = torch.tensor([True, True, True, False, True, True])  # row 3 unmasked; row 5 allows nothing
    bitmask = token_bitmask(allowed)
    request.addfinalizer(qgemm.default_isa.cache_clear)  # no forced instruction set outlives the test
    for isa in qgemm.supported_isas():
        full = qgemm.gemm(x, layer.weight, layer.bias, isa)
        monkeypatch.setenv(qgemm.ISA_ENV, isa)
        qgemm.default_isa.cache_clear()
        for limit in (256, 400):
            got = layer.masked(x, bitmask, masked, limit)
            dense = {1, 3} | ({4} if limit < 300 else set())
            for r in range(6):
                if r in dense:
                    assert torch.equal(got[r], full[r]), (isa, limit, r)
                    continue
                keep = torch.cat([allowed[r], torch.ones(8, dtype=torch.bool)])  # past the mask: computed
                assert torch.equal(got[r][keep], full[r][keep]), (isa, limit, r)
                assert bool((got[r][~keep] == float("-inf")).all()), (isa, limit, r)
    monkeypatch.delenv(qgemm.ISA_ENV)
    qgemm.default_isa.cache_clear()
    # Every row sparse, and the batch-invariance of the rest: one row alone gives its bits.
    sparse_only = layer.masked(x[[0, 2, 5]].contiguous(), bitmask[[0, 2, 5]].contiguous(), masked[[0, 2, 5]].contiguous())
    assert torch.equal(sparse_only, layer.masked(x, bitmask, masked)[[0, 2, 5]])
    assert torch.equal(layer.masked(x[1:2].contiguous(), bitmask[1:2].contiguous(), masked[1:2].contiguous()),
                       qgemm.gemm(x[1:2].contiguous(), layer.weight, layer.bias))
    with pytest.raises(RuntimeError, match="bitmask"):
        layer.masked(x, bitmask[:2].contiguous(), masked)
    with pytest.raises(RuntimeError, match="masked must be"):
        layer.masked(x, bitmask, masked[:3].contiguous())
    assert qgemm.QuantizedLinear.build(quantize_q4_1(weight)).masked(x, bitmask, masked) is None  # no Q4_1 kernel
    # A mask covering every column that allows none (a node after the grammar's end): -inf everywhere, never
    # the output buffer's leftovers.
    covered = qgemm.QuantizedLinear.build(quantize_int8(weight[:992], group) if group else quantize_int8(weight[:992]))
    for _ in range(3):
        nothing = covered.masked(x[:2].contiguous(), torch.zeros(2, 31, dtype=torch.int32), torch.tensor([True, False]))
        assert bool((nothing[0] == float("-inf")).all())
        assert torch.equal(nothing[1], qgemm.gemm(x[1:2].contiguous(), covered.weight, covered.bias)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_rows_of_low_precision_activations_are_rounded_as_the_full_call(dtype):
    """With bf16 / fp16 activations (a quantized model in dtype bfloat16) ``self(x)`` rounds its sums to x's dtype:
    ``masked`` gives every row those same values (as float32), so a free row's logits, and its greedy token where
    two round alike, do not depend on whether a grammar-masked row shares its batch."""
    gen = torch.Generator().manual_seed(5)
    n, k = 1000, 96
    layer = qgemm.QuantizedLinear.build(quantize_int8(0.05 * torch.randn(n, k, generator=gen), 32))
    x = torch.randn(3, k, generator=gen).to(dtype)
    allowed = torch.zeros(3, 992, dtype=torch.bool)
    allowed[0, [3, 40, 500]] = True  # sparse
    masked = torch.tensor([True, False, False])
    got = layer.masked(x, token_bitmask(allowed), masked)
    full = layer(x).float()
    assert got.dtype == torch.float32
    assert torch.equal(got[1:], full[1:])  # the unmasked rows: the full call's rounded values
    assert torch.equal(got[0, [3, 40, 500]], full[0, [3, 40, 500]])


@pytest.mark.skipif(platform.system() != "Linux", reason="AMX is asked for from the Linux kernel")
def test_amx_tiles_are_offered_where_the_cpu_has_them():
    """Linux lists AMX flags only where it manages the tile state; there the kernels must get the
    permission and offer the tiles (a silent fallback would leave verify at VNNI speed)."""
    if "avx512" not in qgemm.supported_isas():
        pytest.skip("no AVX-512 VNNI kernels on this CPU")
    assert ("amx" in qgemm.supported_isas()) == ({"amx_tile", "amx_int8"} <= cpu_flags())


@pytest.mark.parametrize("fmt", ["q4_1", "int8-g32"])
def test_amx_tiles_at_the_lm_head_shape(fmt):
    """The head (49152 x 576) at a verify's row counts: the tiles' rows, a remainder on tiles and one on
    the VNNI kernel; the same bits as the VNNI kernel and as each row alone."""
    if "amx" not in qgemm.supported_isas():
        pytest.skip("no AMX tiles on this CPU")
    weight = 0.05 * torch.randn(49152, 576, generator=torch.Generator().manual_seed(5))
    packed = pack(FORMATS[fmt](weight))
    x = torch.randn(30, 576, generator=torch.Generator().manual_seed(6))
    vnni = qgemm.gemm(x, packed, None, "avx512")
    for rows in (16, 17, 30):
        assert torch.equal(qgemm.gemm(x[:rows].contiguous(), packed, None, "amx"), vnni[:rows]), rows


def test_a_forced_instruction_set_is_checked(monkeypatch, request):
    """SPECJET_QGEMM_ISA: an unknown name, or a set this CPU does not run (e.g. amx on a CPU without
    tiles), is refused with the reason, not run into a SIGILL."""
    check_forced_isa(qgemm, monkeypatch, request, "scalar, avx2, avx512, amx", "scalar")
