"""RoPE on q and k and the K/V write as one Triton kernel, used on CUDA for inference.

A decode step on a small model is bound by kernel launches (a CUDA graph replays them, but each still
runs): torch's ``apply_rotary`` on q and k and the two ``index_copy_`` writes are a dozen kernels a
layer; this is one, one program per token over all its heads. The CUDA counterpart of the C++
``cpu_ops.rope_store`` (kernels/cpu_ops.py): same contract, same math as ``apply_rotary`` (models/llama.py:
neox layout, rotate the two halves of each head) with each product and sum rounded to the dtype, within
a rounding of torch's results (not always its bits). A token's bits depend on nothing but its own row,
and every CUDA forward (decode, verify, prefill) takes this kernel, so speculation stays exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, c, s, dt: tl.constexpr):
    """(x1*c - x2*s, x2*c + x1*s), each product and sum rounded to ``dt`` as torch's ops round them."""
    a = (x1.to(tl.float32) * c).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x2.to(tl.float32) * s).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    d = (x2.to(tl.float32) * c).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    e = (x1.to(tl.float32) * s).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    return (a - b).to(dt, fp_downcast_rounding="rtne"), (d + e).to(dt, fp_downcast_rounding="rtne")


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                       stride_qkv, stride_cos, stride_q, stride_kslot, stride_vslot,
                       NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = q_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    c = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    row = qkv_ptr + t * stride_qkv

    # q: heads [0, NUM_HEADS) of the row -> q[t]
    m = (offs_h < NUM_HEADS)[:, None] & d_ok[None, :]
    src = row + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    o1, o2 = _rotate(tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0), c, s, dt)
    dst = q_ptr + t * stride_q + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dst, o1, mask=m)
    tl.store(dst + HALF, o2, mask=m)

    # k: the next NUM_KV heads -> k_cache[slot]; v: the last NUM_KV heads -> v_cache[slot], as they are
    m = (offs_h < NUM_KV)[:, None] & d_ok[None, :]
    src = row + (NUM_HEADS + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
    o1, o2 = _rotate(tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0), c, s, dt)
    dst = k_ptr + slot * stride_kslot + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dst, o1, mask=m)
    tl.store(dst + HALF, o2, mask=m)
    src = row + (NUM_HEADS + NUM_KV + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
    dst = v_ptr + slot * stride_vslot + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=m, other=0.0), mask=m)
    tl.store(dst + HALF, tl.load(src + HALF, mask=m, other=0.0), mask=m)


def rope_store_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KV) D] (rows of unit stride), cos/sin [T, D/2], k_cache/v_cache [slots, KV, D]
    (contiguous per slot), slots [T]: writes token t's rotated k and its v at ``slots[t]`` and returns
    its rotated q, [T, H, D]."""
    tokens = qkv.shape[0]
    num_kv, head_dim = k_cache.shape[1], k_cache.shape[2]
    assert qkv.shape[1] == (num_heads + 2 * num_kv) * head_dim and head_dim % 2 == 0
    for cache in (k_cache, v_cache):
        assert cache.stride(2) == 1 and cache.stride(1) == head_dim, "a slot's heads must be contiguous"
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _rope_store_kernel[(tokens,)](
            qkv, cos, sin, slots, q, k_cache, v_cache,
            qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0),
            NUM_HEADS=num_heads, NUM_KV=num_kv, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv)), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            num_warps=4)
    return q
