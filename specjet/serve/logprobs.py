"""The engine's per-token logprobs (``meta_info["output_token_logprobs"]`` and ``["output_top_logprobs"]``:
(logprob, token id, text) triples) in OpenAI's two layouts: chat's ``{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}`` and the legacy completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

A token's text is its own bytes: a byte-level BPE token's characters mapped back through GPT-2's byte alphabet
(transformers' ``bytes_to_unicode``), so a token holding part of a UTF-8 character keeps its exact bytes (its
text shows the replacement character, as OpenAI's does); a tokenizer of another kind gives its decoded text."""
from __future__ import annotations

import functools
from typing import Any, Optional

from specjet.scheduler.sampling_params import MAX_TOP_LOGPROBS

# OpenAI's limits: chat's top_logprobs (the engine's own limit) and the legacy completions' logprobs.
MAX_CHAT_TOP = MAX_TOP_LOGPROBS
MAX_COMPLETION_TOP = 5


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet; empty where transformers no longer has it (the
    tokens' decoded text is used then)."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return {}
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Token id -> (text, bytes), cached per id; ``special``: the ids a reply's text leaves out (an end-of-turn
    token the model wrote, say), whose entries chat's layout leaves out and the completions' layout gives an empty
    text, so a reply's entries spell its text."""

    def __init__(self, tokenizer, token_bytes: Optional[list[bytes]] = None):
        """``token_bytes``: each id's exact bytes (the grammar backend's decoded vocabulary), for a tokenizer that is
        not byte-level BPE: a SentencePiece byte-fallback piece such as ``<0x0A>`` is all ASCII, and read through the
        byte alphabet it was the text "<0x0A>", not a newline."""
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.lookup = functools.lru_cache(maxsize=65536)(self._compute)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if self.token_bytes is not None and token_id not in self.special and 0 <= token_id < len(self.token_bytes):
            raw = self.token_bytes[token_id]
            return raw.decode("utf-8", errors="replace"), list(raw)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        alphabet = _byte_alphabet()
        if isinstance(piece, str) and piece and all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_entries(texts: TokenTexts, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries of the tokens a reply (or a stream chunk) holds."""
    tops = meta.get("output_top_logprobs")
    entries = []
    for k, (logprob, token, _) in enumerate(meta.get("output_token_logprobs", [])):
        if token in texts.special:
            continue
        text, raw = texts.lookup(token)
        alternatives = []
        for alt_logprob, alt, _ in (tops[k] if tops else []):
            alt_text, alt_raw = texts.lookup(alt)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        entries.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return entries


def completion_logprobs(texts: TokenTexts, meta: dict[str, Any], offset: int = 0, prompt: bool = False) -> dict[str, Any]:
    """The legacy completions layout of a chunk's (or a whole reply's) tokens, whose text starts ``offset``
    characters into the response's text; ``prompt`` (echo): the prompt's tokens first, from the engine's
    input_token_logprobs (the first token's logprob None, as nothing comes before it)."""
    want_tops = meta.get("output_top_logprobs") is not None or meta.get("input_top_logprobs") is not None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if want_tops else None,
                           "text_offset": []}

    def add(token: int, logprob: Optional[float], top: Optional[list], text: Optional[str] = None) -> None:
        nonlocal offset
        text = texts.lookup(token)[0] if text is None else text
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["text_offset"].append(offset)
        offset += len(text)
        if want_tops:
            out["top_logprobs"].append(None if top is None else {texts.lookup(alt)[0]: lp for lp, alt, _ in top})

    if prompt:
        tops = meta.get("input_top_logprobs")
        for k, (logprob, token, _) in enumerate(meta.get("input_token_logprobs", [])):
            add(token, logprob, tops[k] if tops else None)
    tops = meta.get("output_top_logprobs")
    for k, (logprob, token, _) in enumerate(meta.get("output_token_logprobs", [])):
        # Every output token has its entry, as vLLM's and OpenAI's layout has: evaluation harnesses read the last
        # one as the generated token's. One the text leaves out (EOS, say) has the text it adds there: none.
        add(token, logprob, tops[k] if tops else None, "" if token in texts.special else None)
    return out


def engine_params(want: bool, top: Optional[int], limit: int, param: str) -> dict[str, Any]:
    """The engine's return_logprob / top_logprobs_num for a request that wants logprobs with ``top``
    alternatives (None: none)."""
    from specjet.serve.errors import bad_request

    if top is not None and not 0 <= top <= limit:
        raise bad_request(f"{param} must be in [0, {limit}], got {top}", param)
    if not want:
        if top:
            raise bad_request(f"{param} needs logprobs=true", param)
        return {}
    return {"return_logprob": True, "top_logprobs_num": top or 0}
