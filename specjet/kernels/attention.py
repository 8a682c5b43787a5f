"""Attention over the paged KV pool.

Every request in a batch owns a row of the request-to-token table: position p of the request
lives in KV slot ``req_to_token[row, p]``. A forward brings ``q_len`` new tokens per request whose
K/V have already been written into their slots; they sit at the last ``q_len`` of the request's
``kv_len`` positions. A new token always sees the whole cached prefix; among the new tokens it
sees the earlier ones (causal) or, for tree verification, those a caller-given mask allows.

``AttentionMetadata`` (``attention_metadata.py``, shared with the Triton kernel) is built once per
forward and shared by every layer, so the gather indices and the mask cost one construction, not one
per layer.

Two torch paths: ``paged_attention_reference`` (SDPA; fast, but a row's bits depend on the rest of
the batch) and ``paged_attention_invariant`` (float64 math; a row's bits depend only on what it
sees), which ``paged_attention`` runs on CPU because lossless speculative decoding needs a verify
forward to reproduce plain decoding bit for bit.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from specjet.kernels.attention_metadata import AttentionMetadata
from specjet.kernels.cpu_ops import native_attention, native_attention_args, native_attention_available
from specjet.kernels.shared_prefix import find_shared_prefixes


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
    # index_select on the flat index: advanced indexing with a 2-D index is several times slower on CPU.
    flat = meta.kv_indices.reshape(-1)
    # .to: a bf16 KV cache beside float32 queries (kv_cache_dtype) is widened as it is read.
    k = k_cache.index_select(0, flat).to(q.dtype).view(batch, meta.max_kv, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).to(q.dtype).view(batch, meta.max_kv, num_kv_heads, head_dim).transpose(1, 2)
    # enable_gqa lets SDPA map query heads to their KV head without materialising repeated K/V.
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=num_kv_heads != num_heads)  # [B, H, max_q, D]
    out = out.transpose(1, 2)  # [B, max_q, H, D]
    if meta.max_q == 1 and num_tokens == out.shape[0]:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out[meta.q_valid]


# A batch whose KV padding (rows x longest KV) exceeds its real KV by more than this factor is run in
# groups of similar length: the invariant path converts every padded key to float64, so a batch that
# mixes 100- and 1000-token requests would otherwise pay for 1000 keys in every row.
PADDING_SLACK = 1.25


def _length_groups(meta: AttentionMetadata) -> list[tuple[torch.Tensor | None, AttentionMetadata]]:
    """Batch rows in groups of similar KV length (one group when padding is cheap: (None, meta)),
    each as its flat token indices (in batch order) and its own metadata."""
    if meta.length_groups is None:
        lens = meta.kv_lens.tolist()
        if len(lens) * meta.max_kv <= PADDING_SLACK * sum(lens):
            meta.length_groups = [(None, meta)]
        else:
            groups, current, total = [], [], 0
            for i in sorted(range(len(lens)), key=lambda i: lens[i]):
                # Ascending order: row i would be the group's longest.
                if current and (len(current) + 1) * lens[i] > PADDING_SLACK * (total + lens[i]):
                    groups.append(current)
                    current, total = [], 0
                current.append(i)
                total += lens[i]
            groups.append(current)
            meta.length_groups = []
            for g in groups:
                rows = torch.tensor(sorted(g), device=meta.kv_lens.device)
                meta.length_groups.append((meta.q_gather[rows][meta.q_valid[rows]], meta.select(rows)))
    return meta.length_groups


def _mask_bias(meta: AttentionMetadata) -> torch.Tensor | None:
    """The mask as a float64 addend shaped like the scores, [B, 1, max_q, 1, max_kv] (None: no mask)."""
    if meta.mask is not None and meta.mask_bias is None:
        bias = torch.zeros(meta.mask.shape, dtype=torch.float64, device=meta.mask.device)
        meta.mask_bias = bias.masked_fill_(~meta.mask, float("-inf"))[:, :, :, None, :]
    return meta.mask_bias


# Query rows per chunk in the invariant path: bounds the score buffer, and lets a causal chunk stop at
# its last key (a prefill computes about half the score matrix).
INVARIANT_Q_CHUNK = 64


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant attention: a query row's output depends only on its q and the keys and values
    it may see - not on the other rows of the forward, the padding, or where its visible keys sit among
    masked ones (a tree node's ancestors lie between its non-ancestors; decoded alone, the same token
    sees them contiguously).

    SDPA's CPU kernel is not invariant: its blocking and GEMM kernels change with the number of query
    rows and keys, and its sums follow key positions. Here the math runs in float64. A q.k product of
    bf16 values is exact in float64, and so is a head_dim-term sum of them (short of extreme exponent
    ranges), so a score does not depend on the order of its sum at all; scaling, masking (exact zeros
    for masked keys) and exp are elementwise; the sums over keys (softmax denominator, weights x V)
    carry float64 rounding only, ~1e-16 relative, far below the final rounding to the model dtype, so
    the order in which a kernel adds them does not reach the output. (For fp32 models the scores are
    not exact either, but their float64 rounding is as far below fp32's.) [T, H, D] in and out.

    Two implementations of that math: the C++ kernel (csrc/attention.cpp: each row on one thread,
    keys read in place from the pool, invariant by construction) where the extension is built, and
    torch float64 ops otherwise. The torch path pads requests to a common length, so requests of very
    different KV lengths run in separate groups (``_length_groups``); since a row's result does not
    depend on its batch, grouping changes no bit of it.

    Requests that share cached KV slots (a prefix-cache hit: one system prompt or few-shot prefix)
    run as a cascade on the torch path (``find_shared_prefixes``): the shared keys are gathered once
    for all of them and each row's softmax over [shared ; own suffix] is merged from the two parts in
    float64, which again moves a result only by float64 rounding.
    """
    parts = _work_parts(meta)
    if len(parts) == 1 and parts[0][0] is None:
        _, part_meta, shared = parts[0]
        return _run_part(q, k_cache, v_cache, part_meta, scale, shared)
    out = torch.empty_like(q)
    for tokens, part_meta, shared in parts:
        out[tokens] = _run_part(q[tokens], k_cache, v_cache, part_meta, scale, shared)
    return out


def native_whole_batch_args(meta: AttentionMetadata) -> tuple | None:
    """The C++ kernel's metadata arguments (the kernels/layer_stack.py loop passes them to every layer):
    where the kernel runs, ``paged_attention_invariant`` runs the whole batch as one call of it
    (``_work_parts``); None where it does not (the torch path)."""
    return native_attention_args(meta) if native_whole_batch() else None


def native_whole_batch() -> bool:
    """Whether a batch's attention runs as one call of the C++ kernel (``native_whole_batch_args``' test)."""
    return native_attention_available()


def _run_part(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, shared: torch.Tensor | None):
    if shared is None and native_attention_available(q, k_cache):
        return native_attention(q, k_cache, v_cache, meta, scale)
    return _attention_float64(q, k_cache, v_cache, meta, scale, shared)


def _whole(meta: AttentionMetadata) -> list[tuple[None, AttentionMetadata]]:
    """One group: the C++ kernel reads each row's own keys in place, so padding costs nothing."""
    return [(None, meta)]


def _work_parts(meta: AttentionMetadata) -> list[tuple[torch.Tensor | None, AttentionMetadata, torch.Tensor | None]]:
    """The pieces a batch runs in, built once per forward: each piece's flat token indices (None:
    the whole batch in order), its metadata, and the KV slots its rows share (None: no cascade).
    On the torch path rows sharing a prefix run as one cascade per group, the others as before, each in
    length groups; the C++ kernel takes the whole batch in one call."""
    if meta.parts is None:
        native = native_attention_available()
        # The cascade serves the torch path, whose per-row gather of the shared keys it saves. The C++
        # kernel reads shared slots in place (from cache after the first row): faster than the cascade
        # (bench/RESULTS.md, session 19), and each row keeps the bits it gets with no one sharing, which
        # the cascade's float64 merge does not give it.
        plans = [] if native else find_shared_prefixes(meta, INVARIANT_Q_CHUNK)  # one query chunk
        groups = _whole if native else _length_groups
        if not plans:
            meta.parts = [(tokens, group, None) for tokens, group in groups(meta)]
            return meta.parts
        batch = meta.kv_indices.shape[0]
        pieces = [(plan.rows, plan.suffix, plan.slots) for plan in plans]
        covered = torch.zeros(batch, dtype=torch.bool, device=meta.kv_indices.device)
        for plan in plans:
            covered[plan.rows] = True
        rest = (~covered).nonzero().flatten()
        if rest.numel():
            pieces.append((rest, meta.select(rest), None))
        meta.parts = []
        for rows, piece_meta, shared in pieces:
            whole = rows.numel() == batch  # rows are sorted: the piece is the batch in order
            tokens = None if whole else meta.q_gather[rows][meta.q_valid[rows]]
            for group_tokens, group in (_length_groups(piece_meta) if shared is not None else groups(piece_meta)):
                if group_tokens is not None:
                    group_tokens = group_tokens if tokens is None else tokens[group_tokens]
                else:
                    group_tokens = tokens
                meta.parts.append((group_tokens, group, shared))
    return meta.parts


# Per thread (engines in one process run forwards on their own threads; a thread's buffers go with
# it). They grow to the largest forward the thread has run and stay: ~0.3 GB after a decode step of
# 64 requests x 1000 tokens, a few MB at batch 1.
_workspace = threading.local()


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A reused scratch tensor of ``shape``; valid until the next call with the same name."""
    buffers = _workspace.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    # Inference-mode tensors may not be written outside inference mode, nor normal ones inside it.
    key = (name, dtype, str(device), torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _gather_float64(cache: torch.Tensor, flat: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    """cache[flat] as float64, heads-major: [batch * H_kv, L, D] (flat holds batch rows of L slots),
    in this thread's buffers."""
    num_kv_heads, head_dim = cache.shape[1:]
    length = flat.shape[0] // batch
    gathered = torch.index_select(cache, 0, flat, out=_buffer(name + "_gather", (flat.shape[0], num_kv_heads, head_dim),
                                                             cache.dtype, cache.device))
    out = _buffer(name + "_f64", (batch, num_kv_heads, length, head_dim), torch.float64, cache.device)
    out.copy_(gathered.view(batch, length, num_kv_heads, head_dim).transpose(1, 2))
    return out.view(batch * num_kv_heads, length, head_dim)


def _attention_float64(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention_invariant`` for one group, padded to its longest request; with ``shared``
    (KV slots every row sees before the positions ``meta`` describes), merged with that prefix."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    batch, max_q, max_kv = meta.kv_indices.shape[0], meta.max_q, meta.max_kv
    f64 = torch.float64
    flat = meta.kv_indices.reshape(-1)
    # Heads-major float64 copies in reused buffers (a fresh tensor of this size pays its page faults
    # on every call, which at large batches costs more than the conversion itself), so one bmm
    # covers every (request, KV head); a few ops per layer matter at batch 1, where attention is
    # dispatch-bound.
    k64 = _gather_float64(k_cache, flat, batch, "k").transpose(1, 2)  # [B*KV, D, L]
    v64 = _gather_float64(v_cache, flat, batch, "v")  # [B*KV, L, D]
    # Every request brings max_q tokens (a decode step, one request's verify or extend, equal trees):
    # the flat q is already [B, max_q] and needs no padding gather, nor the output an unpadding one.
    dense = num_tokens == batch * max_q
    # Scaling q rather than the scores: fewer elements, and still elementwise (for head_dim 64 the
    # scale is 1/8, exact).
    qp = q.to(f64).mul_(scale)
    qp = qp if dense else qp[meta.q_gather]  # [B, max_q, H, D]
    qp = qp.view(batch, max_q, num_kv_heads, group, head_dim).transpose(1, 2)  # [B, KV, max_q, g, D]
    bias = _mask_bias(meta)
    causal = meta.custom_mask is None and max_q > 1
    max_prefix = int((meta.kv_lens - meta.q_lens).max()) if causal else 0
    chunks = range(0, max_q, INVARIANT_Q_CHUNK)
    # One chunk (decode, verify, short extends) writes its result straight out; several fill a buffer.
    prefix = None if shared is None else _shared_partials(qp, k_cache, v_cache, shared)
    out = None if len(chunks) == 1 else torch.empty(batch, num_kv_heads, max_q, group, head_dim, dtype=f64,
                                                    device=q.device)
    for q0 in chunks:
        q1 = min(max_q, q0 + INVARIANT_Q_CHUNK)
        kv_end = min(max_kv, max_prefix + q1) if causal else max_kv  # later keys are masked for every row
        rows = (q1 - q0) * group
        s = torch.bmm(qp[:, :, q0:q1].reshape(batch * num_kv_heads, rows, head_dim), k64[:, :, :kv_end])
        if bias is not None:
            s.view(batch, num_kv_heads, q1 - q0, group, kv_end).add_(bias[:, :, q0:q1, :, :kv_end])
        s_max = s.amax(-1, keepdim=True)
        s = s.sub_(s_max).exp_()
        o = torch.bmm(s, v64[:, :kv_end])
        if prefix is None:
            o = o.div_(s.sum(-1, keepdim=True))
        else:  # the two softmax parts rescaled to their common maximum
            o1, m1, l1 = prefix
            m = torch.maximum(m1, s_max)
            a1, a2 = (m1 - m).exp_(), s_max.sub_(m).exp_()
            o = o.mul_(a2).add_(o1 * a1).div_(s.sum(-1, keepdim=True).mul_(a2).add_(l1 * a1))
        o = o.view(batch, num_kv_heads, q1 - q0, group, head_dim)
        if out is None:
            out = o
        else:
            out[:, :, q0:q1] = o
    out = out.transpose(1, 2).reshape(batch, max_q, num_heads, head_dim).to(q.dtype)
    if dense:
        return out.view(num_tokens, num_heads, head_dim)
    return out[meta.q_valid]


def _shared_partials(qp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's unnormalised attention over the shared slots, one product per KV head for the whole
    batch: (weights x V, row max, row sum of weights), shaped like the (single) suffix chunk's
    [B*KV, q*g, ...]. qp: [B, KV, max_q, g, D] float64, already scaled."""
    batch, num_kv_heads, max_q, group, head_dim = qp.shape
    k64 = _gather_float64(k_cache, shared, 1, "k_shared").transpose(1, 2)  # [KV, D, L]
    v64 = _gather_float64(v_cache, shared, 1, "v_shared")  # [KV, L, D]
    rows = qp.transpose(0, 1).reshape(num_kv_heads, batch * max_q * group, head_dim)
    s = torch.bmm(rows, k64)
    m = s.amax(-1, keepdim=True)
    s = s.sub_(m).exp_()
    o = torch.bmm(s, v64)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [KV, B*q*g, X] -> [B*KV, q*g, X]
        return t.view(num_kv_heads, batch, max_q * group, -1).transpose(0, 1).reshape(batch * num_kv_heads,
                                                                                     max_q * group, -1)

    return per_row(o), per_row(m), per_row(s.sum(-1, keepdim=True))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    invariant: bool = True,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (batch-invariant unless ``invariant`` is off); elsewhere the
    batch-invariant torch path, or SDPA when ``invariant`` is off."""
    if q.is_cuda:
        from specjet.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, invariant=invariant)
    if not invariant:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)
    return paged_attention_invariant(q, k_cache, v_cache, meta, scale)
