"""The Triton RMSNorm (kernels/triton_norm.py) against the model's torch RMSNorm, and its batch
invariance: each row alone gives the bits it gets among the others. Compiled on a CUDA GPU when one
is present, else under Triton's interpreter in a subprocess (tests/triton_interpreter.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from triton_interpreter import interpreted, report_cases, run_kernel_worker, to_kernel_device

# (rows, hidden size, dtype): the default model's 576, a power of two, an odd size.
CASES = {"smollm2_bf16": (37, 576, torch.bfloat16), "smollm2_fp32": (5, 576, torch.float32),
         "pow2_fp16": (16, 256, torch.float16), "odd_fp32": (3, 77, torch.float32)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, vs torch's


def run_case(case) -> dict:
    from specjet.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton
    from specjet.models.llama import RMSNorm

    rows, n, dtype = case
    gen = torch.Generator().manual_seed(rows * n)
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=gen))
    norm = norm.to(dtype)
    x = (3 * torch.randn(rows, n, generator=gen)).to(dtype)
    with torch.no_grad():
        expected = norm(x).double()  # the torch path on the CPU
    x, weight = to_kernel_device(x), to_kernel_device(norm.weight.detach())
    together = rms_norm_triton(x, weight, 1e-5)
    alone = torch.cat([rms_norm_triton(x[i:i + 1], weight, 1e-5) for i in range(rows)])
    error = ((together.cpu().double() - expected).abs() / (expected.abs() + 1e-3)).max().item()
    # With a residual: the sum as torch's add rounds it (the same bits where compiled; the interpreter emulates
    # bf16 and may round a sum one unit the other way), and the norm of the kernel's own sum.
    residual = (2 * torch.randn(rows, n, generator=gen)).to(dtype)
    expected_sum = x.cpu() + residual
    total, normed = add_rms_norm_triton(x, to_kernel_device(residual), weight, 1e-5)
    with torch.no_grad():
        expected_norm = norm(total.cpu()).double()
    alone_sum = [add_rms_norm_triton(x[i:i + 1], to_kernel_device(residual[i:i + 1]), weight, 1e-5) for i in range(rows)]
    residual_error = ((normed.cpu().double() - expected_norm).abs() / (expected_norm.abs() + 1e-3)).max().item()
    ulp = torch.finfo(dtype).eps if interpreted() and dtype == torch.bfloat16 else 0.0
    sum_error = ((total.cpu().double() - expected_sum.double()).abs() / expected_sum.double().abs().clamp(min=1e-30))
    return {"relative_error": max(error, residual_error), "tolerance": TOLERANCE[dtype],
            "rows_equal": torch.equal(alone, together) and torch.equal(torch.cat([a[1] for a in alone_sum]), normed)
            and torch.equal(torch.cat([a[0] for a in alone_sum]), total),
            "sum_equal": bool((sum_error <= ulp).all())}


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return run_kernel_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_rms_norm_matches_torch_and_is_row_invariant(kernel_report, name):
    result = kernel_report[name]
    assert "error" not in result, result.get("error")
    assert result["relative_error"] <= result["tolerance"], result
    assert result["rows_equal"], result
    assert result["sum_equal"], result


if __name__ == "__main__" and "--kernel-worker" in sys.argv:
    report_cases(CASES, run_case)
