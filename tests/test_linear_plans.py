"""The projections' row plans (kernels/linear.py) when the GEMM's bits follow the call's row count.

A GPU GEMM library may pick its kernel by the row count, so that no chunking keeps a row's bits (fp32
cuBLAS did so on an H200). The plans padded to one fixed row count run one kernel for every call and
are tried for GPU weights only: on a CPU the padding would multiply a decode step's work."""
import pytest
import torch

from specjet.kernels import linear as L


def kernel_exact_only_at_16_rows(x, weight_t, bias):
    """x @ weight_t row by row (a row's bits its own), off by an amount that follows the call's row
    count and each row's place in the call, except in calls of exactly 16 rows."""
    out = torch.stack([row @ weight_t for row in x])
    rows = x.shape[0]
    if rows != 16:
        out = out + 1e-3 * torch.arange(1, rows + 1, dtype=out.dtype).unsqueeze(1) * rows
    return out


@pytest.fixture
def weight_t():
    return torch.randn(24, 10, generator=torch.Generator().manual_seed(3))


def test_a_fixed_row_count_plan_is_chosen_where_no_chunking_is_exact(monkeypatch, weight_t):
    monkeypatch.setattr(L, "linear_reference", kernel_exact_only_at_16_rows)
    plan, packed = L.choose_plan(weight_t, None, False, L.PLAIN_PLANS + L.FIXED_ROW_PLANS)
    assert plan == (None, 16, 16)
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([packed(x[i:i + 1]) for i in range(40)])
    torch.testing.assert_close(alone, x @ weight_t, rtol=0, atol=1e-5)  # the padded calls' rows are the exact ones
    for m in (2, 3, 15, 16, 17, 33, 40):
        calls = torch.cat([packed(x[i:i + m]) for i in range(0, 40, m)])
        assert torch.equal(calls, alone), f"rows changed with {m} rows per call"


def test_without_fixed_row_plans_the_fallback_is_one_row_per_call(monkeypatch, weight_t):
    monkeypatch.setattr(L, "linear_reference", kernel_exact_only_at_16_rows)
    plan, packed = L.choose_plan(weight_t, None, False, L.PLAIN_PLANS)
    assert plan == (None, 1, 1)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(5))
    assert torch.equal(packed(x), torch.cat([packed(x[i:i + 1]) for i in range(5)]))


def test_only_gpu_weights_try_fixed_row_plans(weight_t):
    assert not set(L.FIXED_ROW_PLANS) & set(L.plan_candidates(weight_t, blocked=False))
    assert not set(L.FIXED_ROW_PLANS) & set(L.plan_candidates(weight_t, blocked=True))
    if torch.cuda.is_available():
        assert set(L.FIXED_ROW_PLANS) <= set(L.plan_candidates(weight_t.cuda(), blocked=False))


def test_a_model_without_batch_invariance_runs_each_projection_in_one_call(monkeypatch, tiny_model_dir,
                                                                           onednn_float32):
    """``set_batch_invariant(False)`` (deterministic inference off) lifts the row chunking of oneDNN's plans: one
    kernel call a projection (oneDNN's, not torch's matmul); back on, the chunks and their bits return."""
    from tests.model_harness import load_runner

    runner = load_runner(tiny_model_dir)
    proj = runner.model.lm_head
    packed = proj.packed
    if not isinstance(packed, L.PackedLinear) or packed.max_rows >= 300:
        pytest.skip("no row-chunked plan for this weight on this CPU")
    calls = []
    real = L.PackedLinear.kernel
    monkeypatch.setattr(L.PackedLinear, "kernel", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    x = torch.randn(300, proj.weight_t.shape[0], generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        chunked = proj.project(x)
        assert len(calls) == -(-300 // packed.max_rows)
        runner.model.set_batch_invariant(False)
        calls.clear()
        whole = proj.project(x)
        assert calls == [300]
        torch.testing.assert_close(whole, x @ proj.weight_t, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(whole, chunked, rtol=1e-4, atol=1e-4)
        runner.model.set_batch_invariant(True)
        assert torch.equal(proj.project(x), chunked)
        assert torch.equal(proj.project(x[7:8]), chunked[7:8])  # a row alone: the invariant plan's bits


def bf16_products_summed(x, weight_t, bias, single_rows_apart: bool):
    """bf16 ``x @ weight_t`` summed in fp32 and rounded to bf16, a row at a time (a row's bits its own).
    With ``single_rows_apart`` a call of one row sums the two halves of its products apart and then adds
    them, as a one-row kernel may: its outputs round apart from the same row's among others only where an
    fp32 sum lies near a bf16 rounding edge, a few in 10^4 outputs."""
    # Float64 sums of these bf16 products (64 of them) are exact to far below float32's rounding, so neither
    # order depends on the BLAS torch calls on this CPU (an AVX2 fp32 GEMV summed a row's halves exactly as
    # the split does): a row's sum is rounded to float32 once, a lone row's two half sums each and then their sum.
    xd, wd = x.double(), weight_t.double()
    if single_rows_apart and x.shape[0] == 1:
        half = xd.shape[1] // 2
        return ((xd[:, :half] @ wd[:half]).float() + (xd[:, half:] @ wd[half:]).float()).to(x.dtype)
    return (xd @ wd).float().to(x.dtype)


@pytest.mark.parametrize("seed", range(4))
def test_the_check_finds_a_single_row_kernel_that_rounds_bf16_outputs_apart(monkeypatch, seed):
    """A narrow bf16 weight (64 -> 192) exposes another order in few of its rounded outputs; a check of
    128 normal rows passed such a kernel (session 79). Plans that run a row alone must be refused."""
    weight_t = (0.05 * torch.randn(64, 192, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)
    monkeypatch.setattr(L, "linear_reference",
                        lambda x, w, b: bf16_products_summed(x, w, b, single_rows_apart=True))
    plan, packed = L.choose_plan(weight_t, None, False, L.PLAIN_PLANS)
    assert plan == (None, 2, 32)
    x = (torch.randn(300, 64, generator=torch.Generator().manual_seed(100 + seed)) * 8).to(torch.bfloat16)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(300)])
    assert torch.equal(packed(x), alone)
    # The refusal is right: the kernel's single rows do round apart (in few outputs).
    single = torch.cat([bf16_products_summed(x[i:i + 1], weight_t, None, True) for i in range(300)])
    apart = (single != bf16_products_summed(x, weight_t, None, True)).sum().item()
    assert 0 < apart < single.numel() // 100


def test_a_kernel_whose_rows_keep_their_bits_keeps_single_row_calls(monkeypatch):
    weight_t = (0.05 * torch.randn(64, 192, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    monkeypatch.setattr(L, "linear_reference",
                        lambda x, w, b: bf16_products_summed(x, w, b, single_rows_apart=False))
    plan, _ = L.choose_plan(weight_t, None, False, L.PLAIN_PLANS)
    assert plan == (None, 1, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_check_input_is_finite_in_every_weight_dtype(dtype):
    """Spread magnitudes, but none that overflows the weight's dtype (fp16 ends at 65504): an infinite
    input would fail every plan and leave the weight at one row per call."""
    weight_t = torch.zeros(1536, 64, dtype=dtype)
    x = L.check_input(256, weight_t)
    assert x.dtype == dtype and torch.isfinite(x).all()
    magnitudes = x.abs().float()
    assert magnitudes.max() / magnitudes[magnitudes > 0].median() > 30  # normal rows: ~6
    assert torch.isfinite(x.float() @ torch.full((1536, 64), 0.05)).all()


@pytest.mark.parametrize("in_out, weights", [((576, 576), 2), ((576, 192), 8), ((576, 3072), 2), ((1536, 576), 2)])
def test_bf16_projections_of_the_default_models_shapes_keep_each_rows_bits(monkeypatch, in_out, weights):
    """Whatever kernel a bf16 weight of the default model's shapes gets on this CPU (specjet's bf16 GEMM,
    or oneDNN under a plan measured afresh for each weight), a row's bits do not depend on the call's rows.
    Inputs of spread magnitudes on 600 rows, another seed than the plan check's. On oneDNN's emulated bf16
    (an AVX-512 CPU without BF16) the check of 128 normal rows gave one of these eight k|v weights (576 ->
    192) an unpadded plan, whose lone rows round apart (session 79)."""
    k, n = in_out
    for seed in range(weights):
        monkeypatch.setattr(L, "_PLANS", {})
        gen = torch.Generator().manual_seed(seed)
        packed = L.pack_weight((0.05 * torch.randn(k, n, generator=gen)).to(torch.bfloat16))
        x = torch.randn(600, k, generator=gen) * torch.exp2(torch.randint(0, 12, (600, k), generator=gen).float())
        x = x.to(torch.bfloat16)
        with torch.inference_mode():
            alone = torch.cat([packed(x[i:i + 1]) for i in range(600)])
            for m in (2, 3, 16, 33, 128, 600):
                calls = torch.cat([packed(x[i:i + m]) for i in range(0, 600, m)])
                assert torch.equal(calls, alone), f"{k} -> {n}: rows changed with {m} rows per call"
