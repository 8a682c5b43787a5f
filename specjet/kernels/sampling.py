"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request randomness.

Randomness enters as one uniform number per request (drawn by the caller from that request's own
generator), so a seeded request samples the same tokens whatever batch it shares. The draw is an
inverse-CDF lookup on the filtered distribution, which is exact for any token order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float32; 0 means greedy
    top_ks: torch.Tensor  # [B] int64; <= 0 means no top-k
    top_ps: torch.Tensor  # [B] float32; 1.0 means no top-p
    min_ps: torch.Tensor  # [B] float32; 0.0 means no min-p
    all_greedy: bool
    need_sort: bool  # some row uses top-k or top-p

    @classmethod
    def from_lists(cls, temperatures, top_ks, top_ps, min_ps, device="cpu") -> "SamplingTensors":
        # The flags from the lists (a decode step builds these every iteration: no tensor ops for them).
        sampled = [t > 0 for t in temperatures]
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            all_greedy=not any(sampled),
            need_sort=any(s and (k > 0 or p < 1.0) for s, k, p in zip(sampled, top_ks, top_ps)),
        )


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each sampled row draws from: softmax(logits / T) restricted by top-k,
    top-p and min-p, renormalised. Rows with temperature 0 get a one-hot at the argmax.
    logits: [B, V] float32 (already grammar-masked: forbidden tokens are -inf)."""
    greedy = st.temperatures <= 0
    temps = torch.where(greedy, torch.ones_like(st.temperatures), st.temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if st.need_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        top_k = torch.where(st.top_ks > 0, st.top_ks, torch.full_like(st.top_ks, probs.shape[-1]))
        drop = ranks >= top_k[:, None]
        # top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it
        # already reaches p (the first token is always kept).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= st.top_ps[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if bool((st.min_ps > 0).any()):
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < st.min_ps[:, None] * max_p, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative mass exceeds u * total. probs [B, V], uniforms [B]."""
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def sample_reference(logits: torch.Tensor, st: SamplingTensors, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Next token per row. uniforms: [B] in [0, 1), unused (may be None) when every row is greedy."""
    if st.all_greedy:
        return logits.argmax(-1)
    ids = sample_from_probs(filtered_probs(logits, st), uniforms)
    greedy = st.temperatures <= 0
    return torch.where(greedy, logits.argmax(-1), ids)


def sample(logits: torch.Tensor, st: SamplingTensors, uniforms: torch.Tensor | None) -> torch.Tensor:
    # The torch reference is fast enough on CPU and on CUDA (a sort and a cumsum per step).
    return sample_reference(logits, st, uniforms)
