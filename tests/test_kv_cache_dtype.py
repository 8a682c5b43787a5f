"""A bf16 KV cache beside float32 activations (``kv_cache_dtype="bfloat16"``): each key and value is
rounded to bf16 once as it is stored (as torch's .to(torch.bfloat16) rounds it), and the attention reads
it widened to float, with the bits it gives on a float32 cache holding the same (widened) values. Half
the pool's bytes per token; speculation stays lossless. The default beside quantized weights on the CPU."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.kernels import attention as A
from specjet.kernels import cpu_ops
from specjet.kernels.attention_metadata import build_attention_metadata
from specjet.models.llama import apply_rotary
from specjet.models.runner import resolve_kv_dtype
from test_cpu_ops import scattered_table, tree_mask

needs_ops = pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")


@needs_ops
def test_rope_store_rounds_keys_and_values_into_a_bf16_pool_as_torch_rounds_them():
    heads, kv_heads, dim, rows = 6, 2, 16, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    angles = torch.rand(rows, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([4, 1, 7, 2, 9])
    k16, v16 = torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16), torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16)
    k32, v32 = torch.zeros(10, kv_heads, dim), torch.zeros(10, kv_heads, dim)
    q16 = cpu_ops.rope_store(qkv, cos, sin, k16, v16, slots, heads)
    q32 = cpu_ops.rope_store(qkv, cos, sin, k32, v32, slots, heads)
    assert q16.dtype == torch.float32 and torch.equal(q16, q32)
    assert torch.equal(k16[slots], k32[slots].to(torch.bfloat16)) and torch.equal(v16[slots], v32[slots].to(torch.bfloat16))
    # and the float32 rotation is the model's own (apply_rotary), so the keys are its keys rounded once
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    assert torch.equal(k32[slots], apply_rotary(k, cos, sin))


@needs_ops
@pytest.mark.parametrize("q_lens,tree", [([1, 1, 1], False), ([1, 5, 2], False), ([4, 4, 4], True)],
                         ids=["decode", "extend", "tree"])
# 16: every head dimension in the kernel's tail loop; 64 (the default model's) in its register blocks,
# whose tiles of several row blocks read a bf16 pool's values widened once for the chunk; 80: both.
@pytest.mark.parametrize("dim", [16, 64, 80])
def test_attention_over_a_bf16_pool_is_the_float_pool_of_its_values(q_lens, tree, dim):
    heads, kv_heads = 6, 2
    kv_lens = [700, 45, 9]
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = scattered_table(kv_lens, gen)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    mask = tree_mask(3, max(q_lens), gen) if tree else None
    meta = build_attention_metadata(table, torch.arange(3), torch.tensor(kv_lens), torch.tensor(q_lens), mask)
    out = cpu_ops.native_attention(q, k, v, meta, 0.25)
    assert out.dtype == torch.float32
    floats = cpu_ops.native_attention(q, k.float(), v.float(), meta, 0.25)
    # the float32 lanes' builds read a bf16 pool as its float values, bit for bit; the amx build scores a bf16 pool on
    # tiles with q to ~16 bits (tests/test_cpu_ops.py test_amx_scores_*), within a few float32 roundings of them; the
    # bf16dp build (the default on CPUs with AVX-512 BF16) takes q and the softmax weights to bf16 for head_dims that
    # are multiples of 32 (the lanes' bits otherwise)
    amx = cpu_ops.isa() == cpu_ops.ISAS["amx"]
    bf16_products = cpu_ops.isa() == cpu_ops.ISAS["bf16dp"] and dim % 32 == 0
    tol = 3e-5 if amx else 1e-2 if bf16_products else 1e-5
    if amx or bf16_products:
        torch.testing.assert_close(out, floats, rtol=tol, atol=tol)
    else:
        assert torch.equal(out, floats)
    # the torch paths take the bf16 pool too (the engine's fallback without the C++ ops)
    torch.testing.assert_close(A._attention_float64(q, k, v, meta, 0.25).float(), out, rtol=tol, atol=tol)
    torch.testing.assert_close(A.paged_attention_reference(q, k, v, meta, 0.25), out, rtol=2e-2, atol=2e-2)


def test_the_kv_dtype_is_the_models_or_bf16_beside_float32_on_the_cpu():
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cpu) == torch.bfloat16
    # auto beside quantized weights (float32 activations on the CPU): bf16, unless float32 is asked for
    for method in ("gguf", "int8", "int4"):
        assert resolve_kv_dtype("auto", torch.float32, cpu, method) == torch.bfloat16
        assert resolve_kv_dtype("float32", torch.float32, cpu, method) == torch.float32
        assert resolve_kv_dtype("fp32", torch.float32, cpu, method) == torch.float32
    with pytest.raises(ValueError, match="needs float32 activations on the CPU"):
        resolve_kv_dtype("float32", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_dtype("fp8_e5m2", torch.float32, cpu)
    with pytest.raises(ValueError, match="needs float32 activations on the CPU"):
        resolve_kv_dtype("bfloat16", torch.float32, torch.device("cuda"))


@needs_ops
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_engine_with_a_bf16_kv_cache_speculates_losslessly_in_half_the_bytes(cyclic_model_dir, quantization, tmp_path):
    """The cyclic model, whose output repeats: the EAGLE tree's n-gram path is taken, so accepted nodes' K/V are
    kept in the bf16 cache and read by later steps."""
    from test_spec_eagle import random_head

    prompts = ["The cat sat on the mat. The cat", "1 2 3 4 1 2", "Hello there"]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    kw = dict(model_path=str(cyclic_model_dir), dtype="float32", quantization=quantization, max_total_tokens=4096)
    with specjet.Engine(kv_cache_dtype="float32", **kw) as eng:
        f32_bytes = eng.worker.runner.kv_cache.k.element_size()
        float_kv = [o["output_ids"] for o in eng.generate(prompts, params)]
        eng.check_kv_invariant()
    # The default: bf16 beside quantized weights, the model's float32 beside float ones.
    with specjet.Engine(kv_cache_dtype="auto" if quantization else "bfloat16", **kw) as eng:
        cache = eng.worker.runner.kv_cache
        assert cache.k.dtype == cache.v.dtype == torch.bfloat16 and 2 * cache.k.element_size() == f32_bytes
        plain = [o["output_ids"] for o in eng.generate(prompts, params)]
        eng.check_kv_invariant()
    if quantization is None:
        with specjet.Engine(**kw) as eng:
            assert eng.worker.runner.kv_cache.k.dtype == torch.float32
            eng.check_kv_invariant()
    head = random_head(tmp_path / "head", cyclic_model_dir)
    # Every iteration drafts (the measured payoff, which depends on timings, off).
    with specjet.Engine(kv_cache_dtype="bfloat16", speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                        speculative_measured_payoff=False, **kw) as eng:
        spec = [o["output_ids"] for o in eng.generate(prompts, params)]
        alone = eng.generate(prompts[0], params)
        eng.check_kv_invariant()
    assert spec == plain and alone["output_ids"] == plain[0]
    assert alone["meta_info"]["spec_accept_length"] > 1.5, alone["meta_info"]  # drafts were taken (int8: alone only)
    # Rounding the cache moves logits a little: most greedy tokens stay.
    same = sum(a == b for x, y in zip(plain, float_kv) for a, b in zip(x, y))
    assert same >= 0.5 * sum(len(x) for x in plain)


def test_an_unknown_kv_cache_dtype_is_refused_at_the_door():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        specjet.Engine(kv_cache_dtype="fp8")
