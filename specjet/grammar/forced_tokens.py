"""Forced text in the tokenizer's own tokens: where a grammar allows only one text next, the model does not
choose how it is split.

A grammar often forces text: a JSON schema's keys and punctuation (``{"name": "``), a tool call's name, a
const. Decoding token by token under the mask alone lets the model spell that text in any tokens that spell
it, and a small model pushed off its preferred layout (a newline after ``{``, which the compact layout
forbids) takes ``{`` then ``"`` where its tokenizer writes ``{"``, or ``g`` then ``et`` for ``get`` (how often:
bench/RESULTS.md, session 111). Every later token is then conditioned on a
split the model never saw in training, a draft of the tokenizer's split is rejected there, and the text sent
back in the next turn (re-tokenized) no longer matches the tokens the prefix cache holds.

The rule (SGLang's jump-forward makes the same choice): at a grammar state whose forced text the tokenizer
splits into two or more tokens, the next token is the first of them, and the mask allows it alone. The last
token of a forced text is left to the model under the grammar's mask, because it may merge with what follows
(`` "`` then ``web``, or `` "web``), which the split of the forced text alone cannot see. The rule is a
function of the grammar state only, so plain decoding and every speculative path (whose per-node masks
apply it) take the same tokens, and a draft of the forced tokens is always accepted.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
import torch

# Forced texts repeat (a schema's keys and punctuation, every object): their splits are kept, up to this many
# texts of up to this many characters (a bounded cache, ~1 MB at most).
TOKENIZE_CACHE_TEXTS = 4096
TOKENIZE_CACHE_CHARS = 256
# Characters of forced text split to find its first token: the first token of a text is the first token of
# any long enough prefix of it (no token spells 64 characters of JSON's keys and punctuation), and the split
# of a kilobyte-long const every iteration would cost more than the step.
_SPLIT_CHARS = 64


def text_to_ids(tokenizer) -> Callable[[str], list[int]]:
    """Text -> token ids as ``tokenizer`` splits it, no special tokens: through a fast tokenizer's own
    backend where it has one (the same split, without transformers' wrapper, which costs more than
    the split itself on the few characters of forced text every constrained iteration tokenizes).
    Short texts' splits are cached: a split is a function of the text alone."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        split = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    else:
        split = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    cached = functools.lru_cache(maxsize=TOKENIZE_CACHE_TEXTS)(lambda text: tuple(split(text)))
    return lambda text: list(cached(text)) if len(text) <= TOKENIZE_CACHE_CHARS else list(split(text))


class ForcedTokens:
    """The rule above for one tokenizer: ``first_token`` of a forced text (``RequestGrammar`` applies it to its masks).

    ``token_bytes`` (each id's bytes) checks a split: a tokenizer that writes something before every text it splits
    (SentencePiece's "▁") gives splits that do not spell the forced text, and for those the rule forces nothing."""

    def __init__(self, tokenize: Callable[[str], list[int]], token_bytes: Callable[[], list[bytes]] | None = None):
        self.tokenize = tokenize
        self.token_bytes = token_bytes
        self._first = functools.lru_cache(maxsize=TOKENIZE_CACHE_TEXTS)(self._first_of)

    def _first_of(self, text: str) -> Optional[int]:
        ids = self.tokenize(text)
        if len(ids) < 2:
            return None
        if self.token_bytes is not None:
            vocab = self.token_bytes()
            if any(i >= len(vocab) for i in ids) or b"".join(vocab[i] for i in ids) != text.encode("utf-8"):
                return None
        return ids[0]

    def token_text(self, token: int) -> Optional[str]:
        """The text token ``token`` spells, or None where that is unknown or no whole text (no ``token_bytes``, an
        id past the vocabulary, bytes that are not whole UTF-8 characters, an empty piece such as a special
        token's)."""
        if self.token_bytes is None:
            return None
        vocab = self.token_bytes()
        if not 0 <= token < len(vocab) or not vocab[token]:
            return None
        try:
            return vocab[token].decode("utf-8")
        except UnicodeDecodeError:
            return None

    def first_token(self, text: str) -> Optional[int]:
        """The token the rule forces where ``text`` is the grammar's forced text ("" where it forces none), or None
        where the model chooses. A prefix of the forced text, so the grammar takes it."""
        return self._first(text[:_SPLIT_CHARS]) if text else None


def restrict_row(bitmask: torch.Tensor, index: int, token: int) -> bool:
    """Row ``index`` of a CPU int32 ``bitmask`` -> ``token`` alone, if the row allows it (else unchanged);
    whether it did."""
    words = bitmask.numpy().view(np.uint32)[index]
    word, bit = token >> 5, np.uint32(1 << (token & 31))
    if word >= words.shape[0] or not words[word] & bit:
        return False
    words[:] = 0
    words[word] = bit
    return True
