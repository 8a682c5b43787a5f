"""Turning a list of requests into the tensors of one forward (prefill or decode)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.scheduler.request import Req


class BatchKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ScheduledBatch:
    kind: BatchKind
    reqs: list[Req]


def build_prefill_batch(reqs: list[Req], req_to_token: torch.Tensor, device, capture_hidden=None) -> ForwardBatch:
    """Extend every request from its committed length to the end of its fill ids."""
    ids, positions, slots, q_lens, kv_lens = [], [], [], [], []
    for req in reqs:
        fill = req.fill_ids
        start, end = req.kv_committed_len, len(fill)
        ids.extend(fill[start:end])
        positions.append(torch.arange(start, end))
        slots.append(req_to_token[req.req_pool_idx, start:end])
        q_lens.append(end - start)
        kv_lens.append(end)
    return ForwardBatch.build(
        ForwardMode.EXTEND,
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.cat(positions).to(device),
        out_cache_loc=torch.cat(slots),
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=device),
        q_lens=torch.tensor(q_lens, dtype=torch.int64, device=device),
        logits="last",
        capture_hidden=capture_hidden,
    )


def build_decode_batch(reqs: list[Req], req_to_token: torch.Tensor, device) -> ForwardBatch:
    """Feed each request's last sampled token at position kv_committed_len."""
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device)
    positions = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64, device=device)
    ones = torch.ones_like(positions)
    return ForwardBatch.build(
        ForwardMode.DECODE,
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=device),
        positions=positions,
        out_cache_loc=req_to_token[rows, positions],
        req_to_token=req_to_token,
        req_pool_indices=rows,
        kv_lens=positions + 1,
        q_lens=ones,
        logits="all",
    )
