"""Shared KV prefixes inside one forward's batch (cascade attention's plan).

With the prefix cache, requests that share a prompt prefix (a system prompt, few-shot examples)
hold the *same* KV slots for it. The invariant attention would gather and convert those keys once
per request per layer; the cascade path (``attention.py``) gathers them once and runs every
sharing request's queries against them in one product, then each request's own suffix as usual,
and merges the two softmax parts.

This module only finds the plan from the metadata: which rows share which leading slots, and the
metadata of their suffixes. It is built once per forward (every layer reuses it).
"""
from __future__ import annotations

import dataclasses

import torch

from specjet.kernels.attention_metadata import AttentionMetadata

# A shared prefix shorter than this is not worth a piece of its own.
MIN_SHARED_TOKENS = 64
# A group's cascade saves gathering (rows - 1) x shared positions and costs a fixed few dozen ops
# more (its own piece, the shared product, the merge): below this many saved positions (e.g. 4 EAGLE
# draft rows of one request over 600 positions) the plain path is as fast or faster.
MIN_SAVED_POSITIONS = 2048


@dataclasses.dataclass
class SharedPrefix:
    rows: torch.Tensor  # [R] sorted batch rows that share the prefix
    slots: torch.Tensor  # [L] the shared KV slots, in position order
    suffix: AttentionMetadata  # the rows' metadata with the first L positions removed


def find_shared_prefixes(meta: AttentionMetadata, max_query_tokens: int) -> list[SharedPrefix]:
    """Groups of >= 2 rows whose first ``L >= MIN_SHARED_TOKENS`` KV slots are identical and cached
    (seen by every query of those rows), where sharing saves at least ``MIN_SAVED_POSITIONS``
    gathered positions. Rows are grouped by their first slot, and a group's prefix is the longest
    run all its rows agree on. Only forwards of at most ``max_query_tokens`` new tokens per row
    (decode, verify, draft: attention there is a stream of gathered keys; prefill chunks are
    compute-bound) get a plan."""
    min_shared = MIN_SHARED_TOKENS
    batch = meta.kv_indices.shape[0]
    if batch < 2 or meta.max_q > max_query_tokens or meta.max_kv < min_shared:
        return []
    cached = (meta.kv_lens - meta.q_lens).tolist()
    by_first: dict[int, list[int]] = {}
    for row, first in enumerate(meta.kv_indices[:, 0].tolist()):
        if cached[row] >= min_shared:
            by_first.setdefault(first, []).append(row)
    plans = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        limit = min(cached[r] for r in rows)
        index = torch.tensor(rows, device=meta.kv_indices.device)
        block = meta.kv_indices[index, :limit]
        agree = (block == block[:1]).all(0)
        disagree = (~agree).nonzero()
        shared = int(disagree[0]) if disagree.numel() else limit
        if shared >= min_shared and (len(rows) - 1) * shared >= MIN_SAVED_POSITIONS:
            plans.append(SharedPrefix(index, block[0, :shared].clone(), suffix_metadata(meta.select(index), shared)))
    return plans


def suffix_metadata(meta: AttentionMetadata, shared: int) -> AttentionMetadata:
    """``meta`` with its first ``shared`` KV positions (cached, visible to every query) removed."""
    mask = None
    if meta.mask is not None:
        mask = meta.mask[..., shared:].clone()
        # A padded query row must still see one key (the softmax stays finite); its output is dropped.
        mask[:, 0, :, 0] |= ~meta.q_valid
    return dataclasses.replace(
        meta,
        kv_lens=meta.kv_lens - shared,
        kv_indices=meta.kv_indices[:, shared:],
        mask_tensor=mask,
        mask_inputs=None,
        max_kv=meta.max_kv - shared,
        length_groups=None,
        mask_bias=None,
        native_args=None,  # derived from the fields above: the kernel's arguments are rebuilt for the suffix
    )
