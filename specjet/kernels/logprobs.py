"""Log probabilities of the tokens a request emits, under the model's own next-token distribution: the
log-softmax of the target's logits (in float32), before grammar masks, penalties and temperature change
what is drawn. The rows come from wherever the token was decided (a decode step's, a prefill's last, a
verify node's), and the batch-invariant kernels give a token the same row on every path, so speculative and
plain decoding report the same numbers."""
from __future__ import annotations

import torch


class LoggedTokens(list):
    """A request's new tokens (a list, as every path hands tokens on) with, per token, its logprob and the
    most likely alternatives, ``[(logprob, token id)]`` best first (empty when none were asked for)."""

    def __init__(self, tokens: list[int], logprobs: list[float], tops: list[list[tuple[float, int]]]):
        super().__init__(tokens)
        self.logprobs = logprobs
        self.tops = tops


def log_softmax_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[len(rows), V] float32 log-probabilities of these rows: a new tensor, so the caller may go on to
    mask or penalise ``logits`` in place."""
    return torch.log_softmax(logits[rows].float(), dim=-1)


def logged(tokens: list[int], logprobs: torch.Tensor, top_n: int) -> LoggedTokens:
    """``tokens`` with their logprobs: row i of ``logprobs`` is the distribution token i was drawn from."""
    index = torch.tensor(tokens, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    tops: list[list[tuple[float, int]]] = [[] for _ in tokens]
    if top_n:
        tops = [top_alternatives(row, top_n) for row in logprobs]
    return LoggedTokens(tokens, chosen, tops)


def top_alternatives(row: torch.Tensor, top_n: int) -> list[tuple[float, int]]:
    """The ``top_n`` best ``(logprob, token id)`` of one row, best first, equal logprobs in ascending id order:
    the order greedy decoding breaks a tie in (the first maximum), so a greedy token heads its own list. (torch's
    topk orders ties arbitrarily, and a low-precision model's logits tie often.)"""
    top_n = min(top_n, row.shape[-1])
    kth = row.topk(top_n).values[-1]
    above = (row > kth).nonzero()[:, 0]  # every one of them is in the list
    tied = (row == kth).nonzero()[:, 0][:top_n - above.shape[0]]  # the lowest ids of those tied with the last
    ids = torch.cat([above, tied])  # ascending within each part
    order = torch.sort(row[ids], descending=True, stable=True).indices  # ties keep ascending ids
    ids = ids[order]
    return list(zip(row[ids].tolist(), ids.tolist()))


__all__ = ["LoggedTokens", "log_softmax_rows", "logged", "top_alternatives"]
