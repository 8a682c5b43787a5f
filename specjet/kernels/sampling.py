"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request randomness.

Randomness enters as one uniform number per request, the coin of the position the token takes
(kernels/coins.py, the caller's), so a seeded request samples the same tokens whatever batch it shares. The draw is an
inverse-CDF lookup on the filtered distribution, which is exact for any token order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.kernels import cpu_ops
from specjet.kernels.argmax import argmax_rows


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


def sampling_rows(st: SamplingTensors, index: torch.Tensor) -> SamplingTensors:
    """The parameters of rows ``index`` of ``st`` (an int64 index on its device: a subset of the requests, or
    each request's row repeated once per tree node), for rows that are sampled."""
    return SamplingTensors(temperatures=st.temperatures[index], top_ks=st.top_ks[index], top_ps=st.top_ps[index],
                           min_ps=st.min_ps[index], all_greedy=False, need_sort=st.need_sort)


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each sampled row draws from: softmax(logits / T) restricted by top-k,
    top-p and min-p, renormalised. Rows with temperature 0 get a one-hot at the argmax.
    logits: [B, V] float32 (already grammar-masked: forbidden tokens are -inf)."""
    greedy = st.temperatures <= 0
    temps = torch.where(greedy, torch.ones_like(st.temperatures), st.temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if st.need_sort:
        probs = _top_k_top_p(probs, logits, st)
    if bool((st.min_ps > 0).any()):
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < st.min_ps[:, None] * max_p, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


# Candidates the top-k / top-p filter looks at first: the best this many tokens of each row (a partial
# selection, O(V)), four times as many while some row's filter reaches past them. Sorting the whole
# vocabulary (tens of thousands of columns) per step cost most of a decode step's forward again on the
# CPU; a nucleus or a top-k rarely reaches past the first few dozen tokens.
TOP_CANDIDATES = 64


def _top_k_top_p(probs: torch.Tensor, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``probs`` with each row's tokens outside its top-k and its top-p nucleus set to 0 (top-p keeps the
    smallest prefix of the descending order whose mass reaches p: a token is dropped when the mass before
    it already does; the first is always kept). What filtering the fully sorted rows gives: the running
    sums of the best ``k + 1`` candidates are the first ``k + 1`` of the full ones, and a row is decided
    once its top-k is at most ``k`` or its candidate ``k`` (0-based) is dropped, the tokens after it
    being dropped too. A row with neither filter is left whole. The order is the ``logits``' (the
    probabilities' wherever they differ): at a huge temperature the probabilities round to equal values,
    which would rank tokens by id."""
    vocab = probs.shape[-1]
    top_ks = torch.where(st.top_ks > 0, st.top_ks.clamp(max=vocab), torch.full_like(st.top_ks, vocab))
    top_ps = st.top_ps.to(probs.dtype)
    filtered = (top_ks < vocab) | (top_ps < 1.0)
    k = min(vocab - 1, TOP_CANDIDATES)
    while True:
        order = logits.topk(k + 1, dim=-1, sorted=True).indices
        values = probs.gather(-1, order)
        mass_before = values.cumsum(-1) - values
        if k + 1 == vocab or bool((~filtered | (top_ks <= k) | (mass_before[:, k] >= top_ps)).all()):
            break
        k = min(vocab - 1, 4 * k)
    ranks = torch.arange(k + 1, device=probs.device)[None, :]
    keep = (ranks < top_ks[:, None]) & (~(mass_before >= top_ps[:, None]) | (ranks == 0))  # the first always kept
    kept = torch.zeros_like(probs).scatter_(-1, order, values.masked_fill(~keep, 0.0))
    return torch.where(filtered[:, None], kept, probs)


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
    """``sample_reference``'s draw. On the CPU one C++ pass a row (csrc/sampling.cpp: the same filters and the
    same inverse-CDF rule over the kept tokens in id order, its weights from its own exp, so a token at the edge
    of two tokens' shares may differ from the reference's; tested against the reference's distribution); on
    other devices the torch reference (a partial selection and a cumulative sum a step)."""
    if st.all_greedy:
        return argmax_rows(logits)
    if uniforms is None or not cpu_sampler_serves(logits):
        return sample_reference(logits, st, uniforms)
    lists = [t.tolist() for t in (st.temperatures, st.top_ks, st.top_ps, st.min_ps, uniforms.to(torch.float32))]
    return torch.tensor(sample_lists(logits, *lists), dtype=torch.int64)


def sample_lists(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                 min_ps: list[float], uniforms: list[float],
                 grammar: tuple[torch.Tensor, list[bool]] | None = None) -> list[int] | None:
    """``sample``'s draw with the parameters as host lists (a decode step builds no tensors for them) and,
    with ``grammar`` (bitmask [R, W] int32, masked flags), the flagged rows read through their token bitmask
    as if xgrammar had written -inf over the forbidden columns (the logits are left as they are). One C++ pass
    a row; None where the C++ ops do not serve these logits (not built, not a CPU float32 tensor)."""
    if not cpu_sampler_serves(logits):
        return None
    bitmask, masked = grammar if grammar is not None else (None, [])
    return cpu_ops.extension().sample_rows_lists(logits, temperatures, top_ks, top_ps, min_ps, uniforms, bitmask,
                                                 masked)


def cpu_sampler_serves(logits: torch.Tensor) -> bool:
    """Whether the C++ draws (``sample``'s, ``sample_lists``, the verifier's tree walk) serve these logits: the
    extension built, CPU float32 logits (a caller may draw its coins only then)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.extension() is not None

