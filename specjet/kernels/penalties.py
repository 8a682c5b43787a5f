"""Repetition, frequency and presence penalties and a logit bias on logits.

A request's penalties depend on the tokens before the position being predicted: its output so far
(OpenAI's frequency and presence penalties) and its prompt and output (the repetition penalty,
as in SGLang and HF); its output's length decides whether its stop tokens may be drawn (SGLang's
min_new_tokens). Its logit bias (OpenAI's ``logit_bias``) is a constant added to chosen
tokens' logits after the penalties, so the caller's bias has the last word. Plain decoding applies
them to each request's row; speculative verification
applies them to every node of a draft tree with the tokens on that node's own path added, so a
node sees exactly the logits plain decoding would see after that path. Every operation here is
elementwise on a row, so a row's result does not depend on how many rows share the call: greedy
speculative output stays equal to plain output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0  # subtracted once per occurrence of the token in the output so far
    presence: float = 0.0  # subtracted once if the token occurs in the output so far
    repetition: float = 1.0  # a seen token's logit divided by it when positive, multiplied when not
    bias_ids: tuple[int, ...] = ()  # added to these tokens' logits after the penalties ...
    bias_values: tuple[float, ...] = ()  # ... these values (logit_bias)
    # SGLang's min_new_tokens: while the output so far is shorter, these tokens (the request's stop tokens: its
    # stop_token_ids, and EOS unless it ignores EOS) cannot be drawn (their logits -inf, after the bias).
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    @property
    def contextual(self) -> bool:
        """Whether the row's tokens so far change anything (a bias alone needs no context)."""
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0

    @property
    def holds_stops(self) -> bool:
        """Whether some output lengths keep the stop tokens from being drawn (min_new_tokens)."""
        return self.min_new_tokens > 0 and bool(self.stop_ids)

    @property
    def active(self) -> bool:
        return self.contextual or bool(self.bias_ids) or self.holds_stops

    def needed_from(self, output_len: int) -> bool:
        """Whether they change the logits of a row predicting the output's token after ``output_len`` tokens, or of
        any later one: once the stop tokens are free, a hold alone changes nothing (the request's rows go back to
        the paths for unpenalised ones)."""
        return self.contextual or bool(self.bias_ids) or (self.holds_stops and output_len < self.min_new_tokens)

    def bias_tensors(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns int64, values) of the logit bias, made once per device and dtype (a request's Penalties lives
        as long as the request: its bias is not rebuilt from Python tuples at every step)."""
        cache = self.__dict__.setdefault("_bias_tensors", {})  # not a field: equality and hashing ignore it
        key = (str(device), dtype)
        if key not in cache:
            cols = torch.tensor(self.bias_ids, dtype=torch.int64, device=device)
            cache[key] = (cols, torch.tensor(self.bias_values, dtype=torch.float32, device=device).to(dtype))
        return cache[key]

    def stop_columns(self, device) -> torch.Tensor:
        """The stop tokens held back below min_new_tokens (int64), made once per device."""
        cache = self.__dict__.setdefault("_stop_tensors", {})  # not a field, as the bias tensors
        key = str(device)
        if key not in cache:
            cache[key] = torch.tensor(self.stop_ids, dtype=torch.int64, device=device)
        return cache[key]


def context_rows(contexts: list[list[int]], prompt_lens: list[int], vocab_size: int, device=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per context (the tokens before the predicted position): output-token counts [R, V] float32
    (tokens from ``prompt_lens[r]`` on) and the tokens seen anywhere [R, V] bool."""
    counts = torch.zeros((len(contexts), vocab_size), dtype=torch.float32, device=device)
    seen = torch.zeros((len(contexts), vocab_size), dtype=torch.bool, device=device)
    for r, (tokens, prompt_len) in enumerate(zip(contexts, prompt_lens)):
        if len(tokens) > prompt_len:
            out = torch.tensor(tokens[prompt_len:], dtype=torch.int64, device=device)
            counts[r].index_add_(0, out, torch.ones(out.shape[0], dtype=torch.float32, device=device))
        if tokens:
            seen[r, torch.tensor(tokens, dtype=torch.int64, device=device)] = True
    return counts, seen


def apply_penalties_(logits: torch.Tensor, counts: torch.Tensor | None, seen: torch.Tensor | None,
                     penalties: list[Penalties], output_lens: list[int]) -> None:
    """Penalise ``logits`` [R, V] float32 in place, row r with ``penalties[r]`` given the row's
    ``counts`` and ``seen`` (``context_rows``; None where no row's penalties are ``contextual``) and the length of
    the output before the token it predicts (``output_lens[r]``): the repetition penalty first, then frequency and
    presence, then the logit bias, then the stop tokens held back below ``min_new_tokens``."""
    if any(p.contextual for p in penalties):
        _penalise_(logits, counts, seen, penalties)
    add_bias_(logits, penalties)
    hold_stops_(logits, penalties, output_lens)


def hold_stops_(logits: torch.Tensor, penalties: list[Penalties], output_lens: list[int]) -> None:
    """Row r's stop tokens at -inf where its output so far (``output_lens[r]`` tokens) is shorter than its
    ``min_new_tokens``: the row cannot end there, whatever the logits (SGLang's min_new_tokens)."""
    for r, (p, length) in enumerate(zip(penalties, output_lens)):
        if p.holds_stops and length < p.min_new_tokens:
            logits[r, p.stop_columns(logits.device)] = float("-inf")


def add_bias_(logits: torch.Tensor, penalties: list[Penalties]) -> None:
    """Row r's ``bias_values`` added to its ``bias_ids`` columns. Rows sharing one ``Penalties`` (a
    verified tree's nodes) take theirs in one indexed add."""
    groups: dict[int, tuple[Penalties, list[int]]] = {}
    for r, p in enumerate(penalties):
        if p.bias_ids:
            groups.setdefault(id(p), (p, []))[1].append(r)
    for p, rows in groups.values():
        cols, values = p.bias_tensors(logits.device, logits.dtype)
        if len(rows) == logits.shape[0]:
            logits[:, cols] += values
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)[:, None]
            logits[index, cols] += values


def _penalise_(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, penalties: list[Penalties]) -> None:
    device = logits.device
    rep = torch.tensor([p.repetition for p in penalties], dtype=torch.float32, device=device)[:, None]
    freq = torch.tensor([p.frequency for p in penalties], dtype=torch.float32, device=device)[:, None]
    pres = torch.tensor([p.presence for p in penalties], dtype=torch.float32, device=device)[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, scaled, logits))
    logits.sub_(freq * counts + pres * (counts > 0).to(torch.float32))
