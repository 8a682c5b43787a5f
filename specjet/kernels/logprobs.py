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
        values, ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
    return LoggedTokens(tokens, chosen, tops)


__all__ = ["LoggedTokens", "log_softmax_rows", "logged"]
