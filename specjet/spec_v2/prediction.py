"""A request's predicted output (OpenAI's Predicted Outputs): the reply the caller expects, such as the
last version of a document being revised. N-gram drafting (ngram.py) puts its continuation in the
request's tree wherever the reply so far matches it, ahead of the request's own continuations (after
only its own earlier spelling of a grammar's forced text).

A prediction is read in order, and text repeats in it (a JSON document's keys): of the places the
reply's last tokens match, the one nearest after the place the last continuation came from is taken
(else the nearest before it). Given as token ids (the model's own split, e.g. an earlier reply's
output ids) it is matched token by token (``PredictionIndex``). Given as text it is matched as bytes
(``PredictionText``): a model under a grammar often spells text in other pieces than the tokenizer
would ('{', '"' where the tokenizer says '{"'), which a token match would miss; its continuation is the
tokenizer's split of the text that follows.
"""
from __future__ import annotations

import bisect
from typing import Callable

from specjet.spec_v2.config import NgramConfig

# The reply's last tokens whose bytes are looked for in a text prediction, and the lengths of its tail
# tried, longest first (a short one matches more places, the nearest after the last match first).
TAIL_TOKENS = 16
NEEDLE_BYTES = (32, 16, 8, 4, 2)
# Bytes of the prediction tokenized for a continuation of n tokens (more than a token's usual length).
BYTES_PER_TOKEN = 8


class PredictionIndex:
    """A prediction of token ids, indexed like the request's own tokens: ``index`` is an
    ``ngram.NgramIndex`` of them."""

    def __init__(self, index):
        self.index = index
        self.cursor = 0  # the prediction position after the last match a continuation came from

    def continuation(self, cfg: NgramConfig, tokens: list[int], chain: list[int], max_len: int) -> list[int]:
        """What follows the longest suffix of ``tokens + chain`` (the request's tokens, then the grammar's
        forced ones) found in the prediction: at most ``max_len`` tokens; [] when none of
        ``cfg.min_window`` tokens or more is found."""
        tail = tokens[-cfg.max_window:] + list(chain)
        predicted = self.index.tokens
        for w in range(min(cfg.max_window, len(tail)), cfg.min_window - 1, -1):
            ends = self.index.ends_of(tail[len(tail) - w:])
            if not ends:
                continue
            k = bisect.bisect_left(ends, self.cursor)
            end = ends[k] if k < len(ends) else ends[-1]
            cont = predicted[end + 1: end + 1 + max_len]
            if cont:
                self.cursor = end + 1
                return cont
        return []


class TokenText:
    """What a text prediction needs of the tokenizer: the bytes each token id spells (``table()``, asked
    for on first use: the grammar backend's decoded vocabulary) and the tokenizer's split of a text."""

    def __init__(self, table: Callable[[], list[bytes]], tokenize: Callable[[str], list[int]]):
        self._make_table = table
        self.tokenize = tokenize
        self._table: list[bytes] | None = None

    def bytes_of(self, ids: list[int]) -> bytes:
        if self._table is None:
            self._table = self._make_table()
        table = self._table
        return b"".join(table[t] if 0 <= t < len(table) else b"" for t in ids)


class PredictionText:
    """A prediction of text, matched against the bytes of the reply's last tokens."""

    def __init__(self, text: str, prompt_len: int, token_text: TokenText):
        self.data = text.encode("utf-8")
        self.prompt_len = prompt_len  # the request's tokens after these are its reply
        self.text = token_text
        self.cursor = 0  # the byte after the last match a continuation came from

    def continuation(self, cfg: NgramConfig, tokens: list[int], chain: list[int], max_len: int) -> list[int]:
        """The tokenizer's split of the text after the reply's place in the prediction (``tokens``: the
        request's prompt and reply, then the grammar's forced ``chain``): at most ``max_len`` tokens, the
        last left out where the text was cut (it may be the start of a longer token)."""
        reply = tokens[self.prompt_len:]
        tail = self.text.bytes_of(reply[-TAIL_TOKENS:] + list(chain))
        start = None
        if len(reply) <= TAIL_TOKENS and self.data.startswith(tail):  # the whole reply so far: the beginning
            start = len(tail)
        for n in NEEDLE_BYTES if start is None else ():
            if len(tail) < n:
                continue
            needle = tail[-n:]
            pos = self.data.find(needle, max(0, self.cursor - n + 1))
            if pos < 0:
                pos = self.data.rfind(needle, 0, self.cursor)
            if pos >= 0:
                start = pos + n
                break
        if start is None or start >= len(self.data):
            return []
        chunk = self.data[start:start + BYTES_PER_TOKEN * (max_len + 1)]
        ids = self.text.tokenize(chunk.decode("utf-8", errors="ignore"))
        if start + len(chunk) < len(self.data):
            ids = ids[:-1]
        self.cursor = start
        return ids[:max_len]
