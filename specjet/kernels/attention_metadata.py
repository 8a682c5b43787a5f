"""What one forward's attention needs to know about its batch, built once and shared by every layer
(so the gather indices and the mask cost one construction, not one per layer) and by both
attention implementations (``attention.py``'s torch paths, ``triton_attention.py``'s kernel).

Every request in a batch owns a row of the request-to-token table: position p of the request
lives in KV slot ``req_to_token[row, p]``. A forward brings ``q_len`` new tokens per request whose
K/V have already been written into their slots; they sit at the last ``q_len`` of the request's
``kv_len`` positions.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    q_lens: torch.Tensor  # [B] int64, new tokens per request (flattened in batch order)
    kv_lens: torch.Tensor  # [B] int64, cached prefix + new tokens
    q_starts: torch.Tensor  # [B] int64, offset of each request's first new token in the flat q
    kv_indices: torch.Tensor  # [B, max_kv] int64, KV slot of each position (padding -> slot 0)
    q_gather: torch.Tensor  # [B, max_q] int64, flat token index of each padded query (padding -> 0)
    q_valid: torch.Tensor  # [B, max_q] bool
    custom_mask: torch.Tensor | None  # [B, max_q, max_q] bool among new tokens, True = may attend
    max_q: int
    max_kv: int
    # The full mask (``mask``) as given, or built on first use from ``mask_inputs``: only the torch paths
    # read it, and the C++ kernel (the CPU's path) takes the lengths and ``custom_mask`` instead.
    mask_tensor: torch.Tensor | None = field(default=None, repr=False)
    mask_inputs: tuple | None = field(default=None, repr=False)  # _full_mask's arguments, until built
    # Per-forward caches of the invariant path, computed on first use and shared by every layer:
    # requests grouped by similar KV length (their flat token indices, their own metadata), and the
    # float64 additive mask (0 where a query may look, -inf elsewhere), and the work plan: the pieces
    # the batch runs in (flat token indices, metadata, KV slots shared by the piece's rows or None).
    length_groups: list[tuple[torch.Tensor | None, "AttentionMetadata"]] | None = None
    mask_bias: torch.Tensor | None = None
    parts: list[tuple[torch.Tensor | None, "AttentionMetadata", torch.Tensor | None]] | None = None
    # The C++ kernel's metadata arguments (kernels/cpu_ops.py native_attention_args).
    native_args: tuple | None = None
    # The Triton kernel's invariant view of a masked batch (``rows_as_requests``), built on first use.
    row_requests: "AttentionMetadata | None" = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, max_q, max_kv] bool for the torch paths, True = may attend; None = no masking needed."""
        if self.mask_inputs is not None:
            kv_valid, pos_kv = _kv_layout(self.mask_inputs, self.max_kv)
            inputs = self.mask_inputs
            self.mask_tensor, self.mask_inputs = _full_mask(*inputs[:3], kv_valid, pos_kv, *inputs[5:]), None
        return self.mask_tensor

    def select(self, rows: torch.Tensor) -> "AttentionMetadata":
        """The metadata of the requests ``rows`` alone, padded only to their own longest q and KV;
        their new tokens numbered from 0 in the order they appear in the full batch."""
        q_lens, kv_lens = self.q_lens[rows], self.kv_lens[rows]
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        q_starts, q_valid, q_gather = _query_layout(q_lens, max_q)
        custom_mask = None if self.custom_mask is None else self.custom_mask[rows, :max_q, :max_q]
        if self.mask_inputs is not None:
            # Not built yet: the piece builds its own from its rows' inputs if a torch path reads it
            # (the same values as the full mask's rows; the C++ kernel never asks).
            kv_valid, pos_kv = _kv_layout(self.mask_inputs, self.max_kv)
            kv_valid, pos_kv = kv_valid[rows, :max_kv], pos_kv[:max_kv]
            mask = {"mask_inputs": (kv_lens, q_lens, q_valid, kv_valid, pos_kv, custom_mask, max_q)}
        else:
            mask = {"mask_tensor": None if self.mask_tensor is None else self.mask_tensor[rows, :, :max_q, :max_kv]}
        return AttentionMetadata(
            q_lens=q_lens,
            kv_lens=kv_lens,
            q_starts=q_starts,
            kv_indices=self.kv_indices[rows, :max_kv],
            q_gather=q_gather,
            q_valid=q_valid,
            custom_mask=custom_mask,
            max_q=max_q,
            max_kv=max_kv,
            **mask,
        )


def _query_layout(q_lens: torch.Tensor, max_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each request's new tokens sit in the flat q: (q_starts [B], q_valid [B, max_q],
    q_gather [B, max_q], the flat index of each padded query, padding -> 0)."""
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    pos_q = torch.arange(max_q, device=q_lens.device)
    q_valid = pos_q[None, :] < q_lens[:, None]
    q_gather = torch.where(q_valid, q_starts[:, None] + pos_q[None, :], torch.zeros_like(q_valid, dtype=torch.int64))
    return q_starts, q_valid, q_gather


def build_attention_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    static_sizes: tuple[int, int] | None = None,
) -> AttentionMetadata:
    """Gather indices and masks for one forward.

    req_to_token: [num_rows, max_context] int slot table; req_pool_indices: [B] rows of this batch;
    kv_lens, q_lens: [B] (python ints or int64 tensors on the device of ``req_to_token``);
    custom_mask: optional [B, max_q, max_q] bool; when None the new tokens attend causally;
    static_sizes: (max_q, max_kv) given, not read off the lengths (nothing is read back from the
    device, as a CUDA graph capture needs; the full mask is then always there for the torch paths).
    """
    device = req_to_token.device
    kv_lens = torch.as_tensor(kv_lens, dtype=torch.int64, device=device)
    q_lens = torch.as_tensor(q_lens, dtype=torch.int64, device=device)
    req_pool_indices = torch.as_tensor(req_pool_indices, dtype=torch.int64, device=device)
    batch = kv_lens.shape[0]
    if static_sizes is not None:
        max_q, max_kv = static_sizes
    else:
        max_q = int(q_lens.max()) if batch else 0
        max_kv = int(kv_lens.max()) if batch else 0
    q_starts, q_valid, q_gather = _query_layout(q_lens, max_q)

    pos_kv = torch.arange(max_kv, device=device)
    kv_valid = pos_kv[None, :] < kv_lens[:, None]  # [B, max_kv]
    kv_indices = req_to_token[req_pool_indices, :max_kv].to(torch.int64)
    kv_indices = torch.where(kv_valid, kv_indices, torch.zeros_like(kv_indices))
    need_mask = static_sizes is not None or custom_mask is not None or max_q > 1 or bool((kv_lens != max_kv).any())
    return _metadata(q_lens, kv_lens, q_starts, kv_indices, q_gather, q_valid, custom_mask, max_q, max_kv,
                     (kv_valid, pos_kv) if need_mask else None)


def host_attention_metadata(req_to_token: torch.Tensor, rows: Sequence[int], q_lens: list[int],
                            kv_lens: list[int], custom_mask: torch.Tensor | None = None) -> AttentionMetadata:
    """``build_attention_metadata`` from what the caller holds as host lists (a decode step's or a verify's:
    the requests' table ``rows`` and their lengths): the same metadata (tested) from a few small torch ops
    and no read of the device, since the padding and layout come from the lists. A decode step or a verify
    pays each op's fixed cost, more than the op's work, and pays it after the forward has streamed the
    weights through the caches."""
    device = req_to_token.device
    batch, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)
    lens = torch.tensor([q_lens, kv_lens], dtype=torch.int64)
    if device.type != "cpu":
        lens = lens.to(device, non_blocking=True)
    q_lens_t, kv_lens_t = lens.unbind()
    if max_q == 1 or batch == 1:  # no padded query: the layout is a range
        q_starts, q_gather, q_valid = _range_layout(device, batch, max_q)
    else:
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        layout = torch.tensor([[s + j if j < n else 0 for j in range(max_q)] + [int(j < n) for j in range(max_q)]
                               for s, n in zip(starts, q_lens)], dtype=torch.int64).to(device, non_blocking=True)
        q_gather, q_valid = layout[:, :max_q], layout[:, max_q:].bool()
        q_starts = q_gather[:, 0].clone()
    kv_indices = _table_rows(req_to_token, rows, max_kv)
    kv_valid = pos_kv = None  # all of every row: built for the torch paths' mask only if asked
    uniform = all(n == max_kv for n in kv_lens)
    if not uniform:  # shorter rows: padding -> slot 0
        pos_kv = torch.arange(max_kv, device=device)
        kv_valid = pos_kv[None, :] < kv_lens_t[:, None]
        kv_indices = kv_indices.masked_fill_(~kv_valid, 0)
    need_mask = custom_mask is not None or max_q > 1 or not uniform
    return _metadata(q_lens_t, kv_lens_t, q_starts, kv_indices, q_gather, q_valid, custom_mask, max_q, max_kv,
                     (kv_valid, pos_kv) if need_mask else None)


@functools.lru_cache(maxsize=256)
def _range_layout(device: torch.device, batch: int, max_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_starts, q_gather, q_valid) of a batch whose queries need no padding (every request max_q new tokens,
    or one request): the same for every such batch, so built once (read-only: no consumer writes them) as
    plain tensors, usable inside and outside inference mode."""
    with torch.inference_mode(False):
        flat = torch.arange(batch * max_q, device=device)
        return flat[::max_q], flat.view(batch, max_q), torch.ones(batch, max_q, dtype=torch.bool, device=device)


def _table_rows(req_to_token: torch.Tensor, rows: Sequence[int], width: int) -> torch.Tensor:
    """[len(rows), width] int64: the first ``width`` slots of each table row, a copy (callers may overwrite
    its padding). A CPU table is read through numpy, whose indexing costs a fraction of torch's."""
    if req_to_token.device.type == "cpu":
        return torch.from_numpy(req_to_token.numpy()[list(rows), :width]).to(torch.int64)
    index = torch.tensor(list(rows), dtype=torch.int64).to(req_to_token.device, non_blocking=True)
    return req_to_token[index, :width].to(torch.int64)


def _metadata(q_lens, kv_lens, q_starts, kv_indices, q_gather, q_valid, custom_mask, max_q: int, max_kv: int,
              kv_layout: tuple | None) -> AttentionMetadata:
    """The metadata of those tensors; ``kv_layout`` (kv_valid, pos_kv; either may be None: built if asked) where
    the torch paths need a mask, None where they need none."""
    mask_inputs = None
    if kv_layout is not None:
        mask_inputs = (kv_lens, q_lens, q_valid, kv_layout[0], kv_layout[1], custom_mask, max_q)
    return AttentionMetadata(q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_indices=kv_indices,
                             q_gather=q_gather, q_valid=q_valid, custom_mask=custom_mask, max_q=max_q, max_kv=max_kv,
                             mask_inputs=mask_inputs)


def _kv_layout(mask_inputs: tuple, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_valid [B, max_kv], pos_kv [max_kv]) of ``mask_inputs``, built where they were left out."""
    kv_lens, kv_valid, pos_kv = mask_inputs[0], mask_inputs[3], mask_inputs[4]
    if kv_valid is None:
        pos_kv = torch.arange(max_kv, device=kv_lens.device)
        kv_valid = pos_kv[None, :] < kv_lens[:, None]
    return kv_valid, pos_kv


def _full_mask(kv_lens: torch.Tensor, q_lens: torch.Tensor, q_valid: torch.Tensor, kv_valid: torch.Tensor,
               pos_kv: torch.Tensor, custom_mask: torch.Tensor | None, max_q: int) -> torch.Tensor:
    """[B, 1, max_q, max_kv]: the cached prefix, and the new tokens causally or as ``custom_mask`` says."""
    batch, max_kv = kv_valid.shape
    pos_q = torch.arange(max_q, device=kv_valid.device)
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
    return mask[:, None]


def rows_as_requests(meta: AttentionMetadata) -> AttentionMetadata:
    """Each (request, new token) slot of a masked batch as a request of its own: one new token whose KV
    row is the request's cached prefix followed by the new tokens it may see, in their order.

    A draft-tree node's ancestors sit among its non-ancestors; decoded alone after acceptance, the same
    token sees them contiguously, at consecutive positions. A kernel that sums over keys by position
    (the Triton kernel's blocks of ``BLOCK_N`` positions, and the order of its products inside one)
    then adds the same terms in another order and may round differently. In this view a node reads
    exactly the key sequence its decode will read, in the same places, so the kernel computes it the
    same way. Nothing is read back from the device (a CUDA graph may capture it): the view has one
    row per padded [B, max_q] query slot (a padded slot has no new token and is skipped) and the
    batch's KV width."""
    batch, width = meta.kv_indices.shape
    max_q = meta.max_q
    device = meta.kv_indices.device
    prefix = meta.kv_lens - meta.q_lens  # [B]
    j = torch.arange(max_q, device=device)
    if meta.custom_mask is not None:
        visible = meta.custom_mask[:, :max_q, :max_q].to(torch.bool)
    else:
        visible = j[None, None, :] <= j[None, :, None]  # causal among the new tokens
    visible = visible & (j < meta.q_lens[:, None])[:, None, :] & meta.q_valid[:, :, None]  # [B, max_q, max_q]
    seen = visible.sum(-1)  # [B, max_q] new tokens each row sees (itself included)
    # Row (b, i): the request's own row, then its visible new tokens' slots moved down to prefix + rank.
    own_new = meta.kv_indices.gather(1, (prefix[:, None] + j[None, :]).clamp(max=width - 1))  # [B, max_q]
    dest = torch.where(visible, prefix[:, None, None] + visible.cumsum(-1) - 1, width)  # width: a spill column
    rows = torch.cat([meta.kv_indices, meta.kv_indices.new_zeros(batch, 1)], 1)
    rows = rows[:, None, :].expand(batch, max_q, width + 1).clone()
    rows.scatter_(2, dest, own_new[:, None, :].expand(batch, max_q, max_q).contiguous())
    flat = batch * max_q
    q_lens = meta.q_valid.reshape(flat).to(torch.int64)
    kv_lens = torch.where(meta.q_valid, prefix[:, None] + seen, 0).reshape(flat)
    return AttentionMetadata(
        q_lens=q_lens,
        kv_lens=kv_lens,
        q_starts=meta.q_gather.reshape(flat),
        kv_indices=rows[:, :, :width].reshape(flat, width),
        q_gather=meta.q_gather.reshape(flat, 1),
        q_valid=meta.q_valid.reshape(flat, 1),
        custom_mask=None,
        max_q=1,
        max_kv=meta.max_kv,
    )
