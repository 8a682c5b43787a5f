"""Paged attention as a Triton kernel (flash-attention style), used on CUDA.

Same contract as ``paged_attention_reference`` in ``attention.py``: q [T, H, D] holds the new tokens
of every request flattened in batch order; K/V live in a slot-indexed pool [num_slots, H_kv, D]
and request b's position p is read from slot ``meta.kv_indices[b, p]``. The new tokens of a
request are the last ``q_lens[b]`` of its ``kv_lens[b]`` positions; each sees the whole cached
prefix, and among the new tokens the earlier ones (causal) or those ``meta.custom_mask`` allows.

Layout of the work: one program per (request, KV head, block of query rows). A "query row" is a
(new token, query head of this KV head's group) pair, so the GQA group shares every K/V block it
loads, and a decode step (one new token) still fills a block with ``group`` useful rows instead of
one. Each program streams the request's KV positions in blocks of ``BLOCK_N`` and keeps an online
softmax (running max, running sum, rescaled accumulator) in fp32, so nothing of size max_kv is
ever materialised and the padded [B, max_q, max_kv] mask of the reference is not needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specjet.kernels.attention_metadata import AttentionMetadata, rows_as_requests

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    q_lens_ptr, kv_lens_ptr, q_starts_ptr,
    kv_indices_ptr, custom_mask_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_ib, stride_ip,
    stride_mb, stride_mq, stride_mk,
    qk_scale_log2,  # softmax scale * log2(e): scores go through exp2, which is cheaper than exp
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HAS_CUSTOM_MASK: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: keep full precision instead of TF32 in tl.dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_block = tl.program_id(2)

    q_len = tl.load(q_lens_ptr + req).to(tl.int32)
    kv_len = tl.load(kv_lens_ptr + req).to(tl.int32)
    q_start = tl.load(q_starts_ptr + req)
    prefix_len = kv_len - q_len

    # The grid is sized for the longest request; shorter ones have nothing in the upper blocks.
    first_row = row_block * BLOCK_M
    if first_row >= q_len * GROUP:
        return

    # Row r of this block is new token r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = first_row + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP  # index among this request's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_valid = q_idx < q_len

    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_ptrs = q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Causal: no row of this block sees past the position of its last new token, so later KV
    # blocks are skipped entirely. A custom (tree) mask may allow any new token, so scan them all.
    if HAS_CUSTOM_MASK:
        kv_end = kv_len
    else:
        last_q = tl.minimum((first_row + BLOCK_M - 1) // GROUP, q_len - 1)
        kv_end = prefix_len + last_q + 1

    # Running max starts finite (not -inf) so a block where a row sees nothing gives
    # exp2(-inf - finite) = 0 rather than exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    for kv_start in range(0, kv_end, BLOCK_N):
        pos = kv_start + offs_n  # request positions of this KV block
        pos_valid = pos < kv_end
        slots = tl.load(kv_indices_ptr + req * stride_ib + pos * stride_ip, mask=pos_valid, other=0)

        k_ptrs = k_ptr + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None] * stride_kd
        k = tl.load(k_ptrs, mask=pos_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IEEE_DOT:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * qk_scale_log2  # fp32 [BLOCK_M, BLOCK_N], in log2 units

        # Which (row, position) pairs may attend: the cached prefix always; a new token by the
        # causal rule or by the caller's mask, indexed by offsets among the new tokens.
        new_off = pos - prefix_len
        in_prefix = new_off < 0
        if HAS_CUSTOM_MASK:
            m_ptrs = custom_mask_ptr + req * stride_mb + q_idx[:, None] * stride_mq + new_off[None, :] * stride_mk
            m_load = row_valid[:, None] & (new_off >= 0)[None, :] & pos_valid[None, :]
            allowed_new = tl.load(m_ptrs, mask=m_load, other=0) != 0
        else:
            allowed_new = new_off[None, :] <= q_idx[:, None]
        allowed = (in_prefix[None, :] | allowed_new) & pos_valid[None, :]
        scores = tl.where(allowed, scores, float("-inf"))

        # Online softmax: rescale what was accumulated under the old max by exp2(old - new).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=pos_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        # p goes to V's dtype so fp16/bf16 use the tensor-core path; the product accumulates in fp32.
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # A row that saw nothing (only possible with a custom mask that forbids everything and no
    # prefix) has l_i == 0: write zeros instead of 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """q: [T, H, D] flat new tokens; k_cache/v_cache: [num_slots, H_kv, D]. Returns [T, H, D].

    ``invariant``: a row's bits depend only on its query and the keys it sees, as plain decoding
    needs of a verify forward. Rows are independent in the kernel's products, and positions a row
    may not see add exact zeros, so under the causal rule a row is computed alike in any batch,
    given one block shape: 16 query rows always (a wider block takes other matrix instructions).
    A masked (tree) batch runs as one request per new token (``rows_as_requests``), each reading
    the keys it sees in decode order."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.shape[2] == head_dim and v_cache.shape[2] == head_dim
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = meta.q_lens.shape[0]
    if num_tokens == 0 or batch == 0 or meta.max_q == 0:
        return out

    if invariant and meta.custom_mask is not None:
        if meta.row_requests is None:
            meta.row_requests = rows_as_requests(meta)
        meta = meta.row_requests
        batch = meta.q_lens.shape[0]
    rows = meta.max_q * group
    # Decode and small verify batches have few rows per request: a 16-row block (tl.dot's minimum)
    # wastes the least. Prefill has many, and bigger blocks reuse each loaded K/V block more.
    block_m = 16 if rows <= 16 or invariant else 64
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32  # keep the K/V tiles within registers for big heads

    if meta.custom_mask is not None:
        # bool -> uint8 is a free reinterpretation; Triton reads it as bytes.
        custom_mask = meta.custom_mask.to(torch.bool).view(torch.uint8)
        mask_strides = custom_mask.stride()
    else:
        custom_mask = meta.kv_indices  # never read (HAS_CUSTOM_MASK=False); any tensor will do
        mask_strides = (0, 0, 0)

    grid = (batch, num_kv_heads, triton.cdiv(rows, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        meta.q_lens, meta.kv_lens, meta.q_starts,
        meta.kv_indices, custom_mask,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *meta.kv_indices.stride(),
        *mask_strides,
        scale * _LOG2E,
        HEAD_DIM=head_dim,
        GROUP=group,
        HAS_CUSTOM_MASK=meta.custom_mask is not None,
        IEEE_DOT=q.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
