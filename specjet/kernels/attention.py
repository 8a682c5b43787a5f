"""Attention over the paged KV pool.

Every request in a batch owns a row of the request-to-token table: position p of the request
lives in KV slot ``req_to_token[row, p]``. A forward brings ``q_len`` new tokens per request whose
K/V have already been written into their slots; they sit at the last ``q_len`` of the request's
``kv_len`` positions. A new token always sees the whole cached prefix; among the new tokens it
sees the earlier ones (causal) or, for tree verification, those a caller-given mask allows.

``AttentionMetadata`` is built once per forward and shared by every layer, so the gather indices
and the mask cost one construction, not one per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    q_lens: torch.Tensor  # [B] int64, new tokens per request (flattened in batch order)
    kv_lens: torch.Tensor  # [B] int64, cached prefix + new tokens
    q_starts: torch.Tensor  # [B] int64, offset of each request's first new token in the flat q
    kv_indices: torch.Tensor  # [B, max_kv] int64, KV slot of each position (padding -> slot 0)
    q_gather: torch.Tensor  # [B, max_q] int64, flat token index of each padded query (padding -> 0)
    q_valid: torch.Tensor  # [B, max_q] bool
    custom_mask: torch.Tensor | None  # [B, max_q, max_q] bool among new tokens, True = may attend
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool for the reference; None = no masking needed
    max_q: int
    max_kv: int


def build_attention_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Gather indices and masks for one forward.

    req_to_token: [num_rows, max_context] int slot table; req_pool_indices: [B] rows of this batch;
    kv_lens, q_lens: [B] (python ints or int64 tensors on the device of ``req_to_token``);
    custom_mask: optional [B, max_q, max_q] bool; when None the new tokens attend causally.
    """
    device = req_to_token.device
    kv_lens = torch.as_tensor(kv_lens, dtype=torch.int64, device=device)
    q_lens = torch.as_tensor(q_lens, dtype=torch.int64, device=device)
    req_pool_indices = torch.as_tensor(req_pool_indices, dtype=torch.int64, device=device)
    batch = kv_lens.shape[0]
    max_q = int(q_lens.max()) if batch else 0
    max_kv = int(kv_lens.max()) if batch else 0
    q_starts = torch.cumsum(q_lens, 0) - q_lens

    pos_kv = torch.arange(max_kv, device=device)
    kv_valid = pos_kv[None, :] < kv_lens[:, None]  # [B, max_kv]
    kv_indices = req_to_token[req_pool_indices, :max_kv].to(torch.int64)
    kv_indices = torch.where(kv_valid, kv_indices, torch.zeros_like(kv_indices))

    pos_q = torch.arange(max_q, device=device)
    q_valid = pos_q[None, :] < q_lens[:, None]  # [B, max_q]
    q_gather = torch.where(q_valid, q_starts[:, None] + pos_q[None, :], torch.zeros_like(q_valid, dtype=torch.int64))

    prefix_lens = kv_lens - q_lens
    # Offset of each kv position inside the new-token block (negative = cached prefix).
    new_offset = pos_kv[None, :] - prefix_lens[:, None]  # [B, max_kv]
    in_prefix = new_offset < 0
    if custom_mask is None:
        allowed_new = new_offset[:, None, :] <= pos_q[None, :, None]  # causal among new tokens
    else:
        idx = new_offset.clamp(0, max(max_q - 1, 0))[:, None, :].expand(batch, max_q, max_kv)
        allowed_new = torch.gather(custom_mask.to(torch.bool), 2, idx)
    mask = (in_prefix[:, None, :] | allowed_new) & kv_valid[:, None, :]
    # Padded query rows would see nothing; let them see slot position 0 so softmax stays finite.
    mask[:, :, 0] |= ~q_valid
    need_mask = custom_mask is not None or max_q > 1 or bool((kv_lens != max_kv).any())
    return AttentionMetadata(
        q_lens=q_lens,
        kv_lens=kv_lens,
        q_starts=q_starts,
        kv_indices=kv_indices,
        q_gather=q_gather,
        q_valid=q_valid,
        custom_mask=custom_mask,
        mask=mask[:, None] if need_mask else None,
        max_q=max_q,
        max_kv=max_kv,
    )


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D] flat new tokens; k_cache/v_cache: [num_slots, H_kv, D]. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    batch = meta.kv_indices.shape[0]
    qp = q[meta.q_gather].transpose(1, 2)  # [B, H, max_q, D]
    # index_select on the flat index is ~4x faster than advanced indexing with a 2-D index on CPU.
    flat = meta.kv_indices.reshape(-1)
    k = k_cache.index_select(0, flat).view(batch, meta.max_kv, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(batch, meta.max_kv, num_kv_heads, head_dim).transpose(1, 2)
    # enable_gqa lets SDPA map query heads to their KV head without materialising repeated K/V.
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=num_kv_heads != num_heads)  # [B, H, max_q, D]
    out = out.transpose(1, 2)  # [B, max_q, H, D]
    if meta.max_q == 1 and num_tokens == out.shape[0]:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out[meta.q_valid]


# Score-matrix elements per chunk of query rows in the invariant path (float64: 8 bytes each).
INVARIANT_CHUNK_ELEMENTS = 1 << 22


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant attention: a query row's output depends only on its q and the K/V it may see,
    not on the other rows of the forward, the padding, or where its visible keys sit among masked ones
    (a tree node's ancestors are interleaved with its non-ancestors; alone, the same token sees them
    contiguously).

    SDPA's CPU kernel is not invariant: its blocking and GEMM kernels change with the number of query
    rows and keys, and its sums follow key positions. Here the two reductions run in float64:
    a q.k product of bf16 values is exact in float64 and a 64-term sum of them is exact as well
    (short of extreme exponent ranges), so scores do not depend on the reduction order at all; the
    softmax is elementwise; and the sums over keys (softmax denominator, weights x V) carry float64
    rounding only (relative 1e-16), far below the rounding to the model dtype at the end. Masked keys
    contribute exact zeros. [T, H, D] in, [T, H, D] out, in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    batch, max_q, max_kv = meta.kv_indices.shape[0], meta.max_q, meta.max_kv
    flat = meta.kv_indices.reshape(-1)
    # [B*KV, D, L] and [B*KV, L, D] in float64
    k = (k_cache.index_select(0, flat).to(torch.float64).view(batch, max_kv, num_kv_heads, head_dim)
         .permute(0, 2, 3, 1).reshape(batch * num_kv_heads, head_dim, max_kv))
    v = (v_cache.index_select(0, flat).to(torch.float64).view(batch, max_kv, num_kv_heads, head_dim)
         .transpose(1, 2).reshape(batch * num_kv_heads, max_kv, head_dim))
    decode = max_q == 1 and num_tokens == batch
    qp = q.to(torch.float64) if decode else q.to(torch.float64)[meta.q_gather]  # [B, max_q, H, D]
    qp = qp.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)  # [B, KV, max_q, g, D]
    out = torch.empty(batch, num_kv_heads, max_q, group, head_dim, dtype=torch.float64, device=q.device)
    step = max(1, INVARIANT_CHUNK_ELEMENTS // max(1, batch * num_heads * max_kv))
    for q0 in range(0, max_q, step):
        q1 = min(max_q, q0 + step)
        rows = (q1 - q0) * group
        qc = qp[:, :, q0:q1].reshape(batch * num_kv_heads, rows, head_dim)
        s = torch.bmm(qc, k).view(batch, num_kv_heads, q1 - q0, group, max_kv)
        if meta.mask is not None:
            s.masked_fill_(~meta.mask[:, 0, None, q0:q1, None, :], float("-inf"))
        s = s.view(batch * num_kv_heads, rows, max_kv)
        s = s.mul_(scale)
        s = s.sub_(s.amax(-1, keepdim=True)).exp_()
        o = torch.bmm(s, v).div_(s.sum(-1, keepdim=True))
        out[:, :, q0:q1] = o.view(batch, num_kv_heads, q1 - q0, group, head_dim)
    out = out.permute(0, 2, 1, 3, 4).reshape(batch, max_q, num_heads, head_dim).to(q.dtype)
    if decode:
        return out.view(num_tokens, num_heads, head_dim)
    return out[meta.q_valid]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the batch-invariant torch path elsewhere."""
    if q.is_cuda:
        from specjet.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_invariant(q, k_cache, v_cache, meta, scale)
