"""Turning output ids into text for a request: stop strings, and what a stream may send so far."""
from __future__ import annotations

from specjet.scheduler.request import Req


def update_text(req: Req, tokenizer) -> str | None:
    """Re-decode the request's output; return the stop string that ended it, if any (and cut the text there)."""
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    stops = req.sampling.stop
    if stops:
        # A stop string can only newly appear in the tail that changed since the last decode.
        start = max(0, len(req.text) - max(len(s) for s in stops))
        hits = [(text.find(s, start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            req.text = text[:index]
            return stop
    req.text = text
    return None


def streamable_len(req: Req) -> int:
    """How much of ``req.text`` a stream may send now: hold back an incomplete UTF-8 character and,
    while running, anything that could still turn out to be the start of a stop string."""
    n = len(req.text)
    if req.finished:
        return n
    while n > 0 and req.text[n - 1] == "\ufffd":
        n -= 1
    if req.sampling.stop:
        n = min(n, len(req.text) - max(len(s) for s in req.sampling.stop) + 1)
    return max(n, req.sent_len)
