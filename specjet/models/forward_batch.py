"""What one model forward needs: token ids, positions, KV slots to write, attention metadata.

Built by the scheduler (or a speculative worker) from its requests; the model only reads it.
"""
from __future__ import annotations

import itertools

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from specjet.kernels.attention_metadata import AttentionMetadata, build_attention_metadata, host_attention_metadata


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, possibly after a cached prefix
    DECODE = "decode"  # one new token per request
    VERIFY = "verify"  # several new tokens per request under a caller-given mask (draft tree)


@dataclass(frozen=True)
class FeatureLayers:
    """Capture for EAGLE-3 style drafters: ``ModelOutput.hidden`` is the residual stream after each
    of ``layers`` and the final normed hidden state, concatenated in that order ([T, (n + 1) h]),
    for every row (like "last")."""

    layers: tuple[int, ...]


# Hidden-state capture: None, "last" (final normed hidden, what the LM head sees), FeatureLayers, or
# layer ids (``ModelOutput.layer_hidden``: residual stream after those decoder layers, for tests).
CaptureHidden = None | str | FeatureLayers | tuple[int, ...]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, flattened in batch order
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # [N] rows of T that need logits; None = all rows
    capture_hidden: CaptureHidden = None
    # (bitmask [T, W] int32, masked [T] bool): rows whose logits a grammar restricts, where only the columns a
    # row's mask allows matter (a verify under a grammar); a quantized LM head may then compute only those
    # and leave -inf elsewhere (QuantizedLinear.masked, Bf16Linear.masked). Needs logits for every row.
    logits_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # The LM head left to the caller (``ModelRunner.head``): the output's ``hidden`` holds the normed rows that
    # need logits and ``logits`` is None. A plain decode under a grammar, whose masks come after the forward.
    defer_logits: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.attn.q_lens.shape[0])

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        q_lens: torch.Tensor,
        custom_mask: torch.Tensor | None = None,
        logits: str | torch.Tensor = "last",
        capture_hidden: CaptureHidden = None,
        static_sizes: tuple[int, int] | None = None,
    ) -> "ForwardBatch":
        """``logits``: "last" (last new token of each request), "all", "none", or the flat rows that
        need them (an int64 tensor). ``static_sizes``:
        (max_q, max_kv) to use instead of reading them off ``q_lens`` / ``kv_lens`` (a CUDA graph's
        capture cannot read the device)."""
        attn = build_attention_metadata(req_to_token, req_pool_indices, kv_lens, q_lens, custom_mask, static_sizes)
        if isinstance(logits, torch.Tensor):
            logits_indices = logits
        elif logits == "last":
            logits_indices = attn.q_starts + attn.q_lens - 1
        elif logits == "all":
            logits_indices = None
        elif logits == "none":
            logits_indices = torch.zeros(0, dtype=torch.int64, device=input_ids.device)
        else:
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        return cls(mode, input_ids, positions, out_cache_loc, attn, logits_indices, capture_hidden)


    @classmethod
    def from_host(cls, mode: ForwardMode, input_ids: torch.Tensor, positions: torch.Tensor,
                  out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, rows: Sequence[int],
                  q_lens: list[int], kv_lens: list[int], custom_mask: torch.Tensor | None = None,
                  capture_hidden: CaptureHidden = None,
                  logits_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                  defer_logits: bool = False, last_logits: bool = False,
                  logit_rows: list[int] | None = None) -> "ForwardBatch":
        """``build(..., logits="all")`` (``last_logits``: ``logits="last"``; ``logit_rows``: those flat rows) from
        the requests' table rows and lengths as host lists (a decode step's, a verify's, a draft extend's): the
        same batch (tested) with fewer small ops."""
        attn = host_attention_metadata(req_to_token, rows, q_lens, kv_lens, custom_mask)
        if last_logits:  # each request's last row
            logit_rows = [end - 1 for end in itertools.accumulate(q_lens)]
        logits_indices = None
        if logit_rows is not None:
            logits_indices = torch.tensor(logit_rows, dtype=torch.int64).to(input_ids.device, non_blocking=True)
        return cls(mode, input_ids, positions, out_cache_loc, attn, logits_indices, capture_hidden, logits_mask,
                   defer_logits)


def host_token_tensors(req_to_token: torch.Tensor, ids: list[int], positions: list[int], slot_rows: list[int],
                       slot_cols: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's or a verify's (input_ids, positions, out_cache_loc), int64 on the table's device, from
    host lists: token i writes the slot ``req_to_token[slot_rows[i], slot_cols[i]]``. A CPU table is read
    through numpy and the three come from one tensor (a step pays each small op's fixed cost)."""
    if req_to_token.device.type == "cpu":
        slots = req_to_token.numpy()[slot_rows, slot_cols].tolist()
        return torch.tensor([ids, positions, slots], dtype=torch.int64).unbind()
    host = torch.tensor([ids, positions, slot_rows, slot_cols], dtype=torch.int64)
    host = host.to(req_to_token.device, non_blocking=True)
    return host[0], host[1], req_to_token[host[2], host[3]].to(torch.int64)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [N, vocab] float32; None: deferred (ForwardBatch.defer_logits)
    hidden: torch.Tensor | None = None  # [T, hidden] for capture "last", [T, (n + 1) hidden] for FeatureLayers
    layer_hidden: dict[int, torch.Tensor] | None = None  # layer id -> [T, hidden]
    head_seconds: float = 0.0  # a deferred head's time, set by whoever ran it (the forward's share of it)
    # A prefill's prompt logprobs: batch index -> {prompt position: (logprob, top alternatives)} (the worker's).
    prompt_logprobs: dict[int, dict[int, tuple[float, list[tuple[float, int]]]]] | None = None
