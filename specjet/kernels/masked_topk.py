"""Tokens chosen under a grammar's token bitmask. ``masked_topk_logp``: the k best tokens a grammar allows
in each row of a drafter's logits, with their log-probabilities renormalised over the allowed tokens
(grammar-aware drafting picks a block position's candidates so, spec_v2/dflash_drafter.py);
``masked_argmax``: plain greedy decoding's token under a grammar (scheduler/worker.py).

``bitmask`` [R, W] int32 is xgrammar's token bitmask (bit t of the little-endian words is token t). For
``masked_topk_logp``, ``logits`` [R, K] holds K columns whose target token ids are ``token_ids`` [K] (a
draft's hot vocabulary; None: column c is token c), and it returns ids [R, k] (-1 past the allowed
finite columns), log-probs [R, k] (-inf there) and the count of allowed columns per row [R], best first;
without a bitmask (None) every column is allowed: an unconstrained drafter's top-k with log-probs.

The C++ ops (csrc/draft_ops.cpp) on the CPU: one pass over a row's columns (and one over its allowed
logits for the log-probs) instead of a dozen small torch ops, each a dispatch; the torch references
elsewhere."""
from __future__ import annotations

import torch

from specjet.kernels import cpu_ops


def _allowed(bitmask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[R, len(tokens)] bool: bit ``tokens[c]`` of each bitmask row (tokens within its 32 W bits).
    (grammar.bitmask_allows is the same test above this layer; kernels do not import grammar.)"""
    words = bitmask[:, tokens >> 5].to(torch.int64)
    return ((words >> (tokens & 31)) & 1) == 1


def masked_topk_logp_reference(logits: torch.Tensor, bitmask: torch.Tensor | None, token_ids: torch.Tensor | None,
                               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = logits.shape
    device = logits.device
    tokens = torch.arange(cols, device=device) if token_ids is None else token_ids.to(device=device, dtype=torch.int64)
    if bitmask is None:
        allowed = torch.ones((rows, cols), dtype=torch.bool, device=device)
    else:
        vocab = 32 * bitmask.shape[1]
        inside = (tokens >= 0) & (tokens < vocab)
        allowed = _allowed(bitmask.to(device), tokens.clamp(0, vocab - 1)) & inside
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    logp, best = torch.log_softmax(masked, -1).topk(min(k, cols), -1)
    keep = torch.isfinite(logp)  # fewer allowed finite columns than k (NaN: a row that allows nothing)
    ids = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    out_logp = torch.full((rows, k), float("-inf"), dtype=torch.float32, device=device)
    ids[:, :best.shape[1]] = torch.where(keep, tokens[best], -1)
    out_logp[:, :best.shape[1]] = torch.where(keep, logp, float("-inf"))
    return ids, out_logp, allowed.sum(-1)


def masked_topk_logp(logits: torch.Tensor, bitmask: torch.Tensor | None, token_ids: torch.Tensor | None,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = cpu_ops.extension()
    if ext is not None and logits.device.type == "cpu" and (bitmask is None or bitmask.device.type == "cpu"):
        ids = None if token_ids is None else token_ids.cpu()
        return tuple(ext.masked_topk_logp(logits.float(), bitmask, ids, k))
    return masked_topk_logp_reference(logits, bitmask, token_ids, k)


def masked_topk_row(logits: torch.Tensor, bitmask: torch.Tensor | None, token_ids: torch.Tensor | None,
                    k: int) -> tuple[list[tuple[int, float]], int]:
    """``masked_topk_logp`` of one row ``logits`` [K] under ``bitmask`` [1, W] (or None) as host values: the
    (token, log-prob) pairs of its allowed finite columns, best first (at most k), and the allowed count. A
    grammar-aware drafter calls it once per block position: one C++ call and no tensors to build or read
    back on the CPU."""
    ext = cpu_ops.extension()
    if ext is not None and logits.device.type == "cpu" and (bitmask is None or bitmask.device.type == "cpu"):
        return ext.masked_topk_row(logits.float(), bitmask, None if token_ids is None else token_ids.cpu(), k)
    ids, logp, allowed = masked_topk_logp_reference(logits[None], bitmask, token_ids, k)
    return [(t, lp) for t, lp in zip(ids[0].tolist(), logp[0].tolist()) if t >= 0], int(allowed[0])


def masked_argmax_reference(logits: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """torch.argmax of each row of ``logits`` [R, V] after the columns its ``bitmask`` row forbids are set
    to -inf, for the rows where ``masked`` [R] bool is set (columns past the mask's 32 W tokens stay)."""
    rows, cols = logits.shape
    covered = min(cols, 32 * bitmask.shape[1])
    c = torch.arange(covered, device=logits.device)
    forbidden = ~_allowed(bitmask.to(logits.device), c) & masked.to(logits.device)[:, None]
    values = logits.float().clone()
    values[:, :covered] = values[:, :covered].masked_fill(forbidden, float("-inf"))
    return values.argmax(-1)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's tokens under a grammar: ``masked_argmax_reference``'s result (int64 [R]) in one
    C++ pass a row on the CPU (the mask is not written into the logits)."""
    ext = cpu_ops.extension()
    if ext is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return ext.masked_argmax(logits, bitmask.cpu(), masked.cpu())
    return masked_argmax_reference(logits, bitmask, masked)
