"""The Triton RoPE + K/V write (kernels/triton_rope.py) against the model's torch path (``apply_rotary``
and ``KVCache.write``): within a rounding or two of torch's (not its bits: compiled, a product may round
differently from torch's own kernel, and the interpreter truncates float32 -> bfloat16); v copied as it is, untouched
slots unchanged, and each token's bits the same alone as among the others (what lossless decoding needs:
decode and verify rows go through this same kernel). Compiled on a CUDA GPU when one is
present, else under Triton's interpreter in a subprocess (tests/triton_interpreter.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from triton_interpreter import report_cases, run_kernel_worker, to_kernel_device

# (tokens, query heads, KV heads, head dim, dtype): the default model's 9 / 3 / 64, odd counts.
CASES = {"smollm2_bf16": (21, 9, 3, 64, torch.bfloat16), "smollm2_fp32": (4, 9, 3, 64, torch.float32),
         "gqa_fp16": (7, 8, 2, 32, torch.float16), "mha_bf16": (3, 4, 4, 16, torch.bfloat16)}


def run_case(case) -> dict:
    from specjet.kernels.triton_rope import rope_store_triton
    from specjet.models.llama import apply_rotary

    tokens, heads, kv, dim, dtype = case
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv) * dim, generator=gen)).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    num_slots = 3 * tokens + 1
    slots = torch.randperm(num_slots - 1, generator=gen)[:tokens] + 1
    k_cache = torch.randn(num_slots, kv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv, dim, generator=gen).to(dtype)

    # The torch path, on the CPU.
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], dim=-1)
    q_ref = apply_rotary(q.reshape(tokens, heads, dim), cos, sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.index_copy_(0, slots, apply_rotary(k.reshape(tokens, kv, dim), cos, sin))
    v_ref.index_copy_(0, slots, v.reshape(tokens, kv, dim))

    dev = to_kernel_device((qkv, cos, sin, k_cache.clone(), v_cache.clone(), slots))
    q_out = rope_store_triton(*dev, heads)
    k_out, v_out = dev[3].cpu(), dev[4].cpu()
    alone = torch.cat([rope_store_triton(dev[0][i:i + 1], dev[1][i:i + 1], dev[2][i:i + 1], dev[3], dev[4],
                                         dev[5][i:i + 1], heads) for i in range(tokens)])

    def error(a, b):  # the largest difference in units of the dtype's epsilon at the inputs' scale
        return ((a.double() - b.double()).abs().max() / (torch.finfo(dtype).eps * qkv.abs().max().double())).item()

    return {"q_error": error(q_out.cpu(), q_ref), "k_error": error(k_out, k_ref),
            "v_equal": torch.equal(v_out, v_ref), "rows_equal": torch.equal(alone, q_out)}


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return run_kernel_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_rope_store_matches_torch_and_is_row_invariant(kernel_report, name):
    result = kernel_report[name]
    assert "error" not in result, result.get("error")
    assert result["q_error"] <= 4 and result["k_error"] <= 4, result
    assert result["v_equal"] and result["rows_equal"], result


if __name__ == "__main__" and "--kernel-worker" in sys.argv:
    report_cases(CASES, run_case)
