"""The Triton silu(gate) * up (kernels/triton_silu_mul.py) against the torch path of the model's MLP, and its
batch invariance: each row alone gives the bits it gets among the others. Compiled on a CUDA GPU when one is
present, else under Triton's interpreter in a subprocess (tests/triton_interpreter.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from triton_interpreter import report_cases, run_kernel_worker, to_kernel_device

# (rows, intermediate size, dtype): the default model's 1536, one more than a block, an odd size.
CASES = {"smollm2_bf16": (9, 1536, torch.bfloat16), "smollm2_fp32": (3, 1536, torch.float32),
         "past_block_fp16": (4, 1025, torch.float16), "odd_fp32": (2, 77, torch.float32)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, vs torch's


def run_case(case) -> dict:
    from specjet.kernels.triton_silu_mul import silu_mul_triton

    rows, width, dtype = case
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).double()  # the torch path on the CPU
    gate_up = to_kernel_device(gate_up)
    together = silu_mul_triton(gate_up)
    alone = torch.cat([silu_mul_triton(gate_up[i:i + 1]) for i in range(rows)])
    error = ((together.cpu().double() - expected).abs() / (expected.abs() + 1e-3)).max().item()
    return {"relative_error": error, "tolerance": TOLERANCE[dtype], "rows_equal": torch.equal(alone, together),
            "shape": list(together.shape)}


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return run_kernel_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_silu_mul_matches_torch_and_is_row_invariant(kernel_report, name):
    result = kernel_report[name]
    assert "error" not in result, result.get("error")
    assert result["shape"] == [CASES[name][0], CASES[name][1]]
    assert result["relative_error"] <= result["tolerance"], result
    assert result["rows_equal"], result


if __name__ == "__main__" and "--kernel-worker" in sys.argv:
    report_cases(CASES, run_case)
