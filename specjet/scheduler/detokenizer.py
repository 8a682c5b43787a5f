"""Turning output ids into text for a request: stop strings, and what a stream may send so far.

Detokenization is incremental, as SGLang's detokenizer does it: a step decodes only a window of
recent ids, never the whole output, so a token costs O(1) however long the output grows (re-decoding
everything made a streaming or stop-string request O(n^2) on the scheduler thread).

The window (``req.detok_ids``) is a context part, ids whose text is already final (its decode is
cached in ``req.detok_surr_text``: SGLang's "surr" offset), then the ids whose text is not final yet
(from SGLang's "read" offset). The window's decode less the context's text is the new text; once it
is non-empty and does not end in an incomplete UTF-8 character ("\\ufffd") it is final: it is
appended to ``req.text`` and the new ids become the context of the next window. So ``req.text`` is
always a prefix of the full decode of the output (until a stop string cuts it), and a stream can
send all of it at once but for a possible stop string's start. Special tokens that decoding skips
are left out of the window (they decode to nothing wherever they are), so a run of them (an
``ignore_eos`` request repeating its EOS, say) does not grow it.

A finished request's text is one full decode of its output (cut at the stop string that ended it; without the stop
token that ended it unless ``no_stop_trim``, as SGLang's), exactly ``tokenizer.decode(output_ids[:-1] or output_ids,
skip_special_tokens=...)`` less a character cut in half at its end (``ends_inside_a_character``): once per request.
"""
from __future__ import annotations

import codecs
import weakref
from typing import Sequence

from specjet.scheduler.request import Req

_INCOMPLETE = "\ufffd"  # what decoding makes of an incomplete UTF-8 character at the end

# Per tokenizer: the ids that decoding with skip_special_tokens=True drops (special added tokens).
_skipped_ids: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def update_text(req: Req, tokenizer, token_bytes: Sequence[bytes] | None = None) -> str | None:
    """Bring ``req.text`` up to date with ``req.output_ids``; return the stop string that ended it, if
    any (and cut the text there). Called after each appended token (incremental: O(1) a token), and
    once more when the request has finished (one full decode: the exact final text). ``token_bytes``: the bytes
    each token id spells (the grammar backend's), which tell a character cut in half at the end from a whole
    U+FFFD; without them the final text is the decode as it is."""
    if req.detok_stop is not None:  # already cut at a stop string: nothing more to do
        return req.detok_stop
    if req.finished:
        return _final_text(req, tokenizer, token_bytes)
    skip = req.sampling.skip_special_tokens
    ids = req.output_ids
    if len(ids) < req.detok_seen:  # output ids only grow; should they ever shrink, start over
        _reset(req)
    if len(ids) > req.detok_seen:
        new_ids = ids[req.detok_seen:]
        if skip:
            dropped = skipped_ids(tokenizer)
            new_ids = [t for t in new_ids if t not in dropped]
        req.detok_ids.extend(new_ids)
        req.detok_seen = len(ids)

    pending = ""  # the window's text that is not final yet
    stops = req.sampling.stop
    # Search for stop strings from where the text may have changed since the last step (the end of
    # the text that was final then), less what a stop string beginning before it can span.
    searched = len(req.text)  # every stop string was searched for up to here
    start = max(0, searched - _max_len(stops) + 1) if stops else 0
    searched -= start  # as an index into the text from start
    if len(req.detok_ids) > req.detok_surr_len:
        window_text = tokenizer.decode(req.detok_ids, skip_special_tokens=skip)
        prefix = req.detok_surr_text
        new = window_text[len(prefix):]
        if new and not new.endswith(_INCOMPLETE) and window_text.startswith(prefix):
            _append_text(req, new)
            del req.detok_ids[:req.detok_surr_len]  # the new ids are the next window's context
            req.detok_surr_len = len(req.detok_ids)
            req.detok_surr_text = tokenizer.decode(req.detok_ids, skip_special_tokens=skip)
        else:
            pending = new
    if stops:
        tail = req.text[start:] + pending
        hit = _first_new_stop(tail, stops, searched)
        if hit is not None:
            return _cut(req, tokenizer, start, req.text[:start] + tail[:hit[0]], hit[1])
    return None


def _final_text(req: Req, tokenizer, token_bytes: Sequence[bytes] | None) -> str | None:
    """The finish path: one full decode, searched for a stop string in what no step has searched. A request a stop
    token ended is not searched (stop tokens are checked first, as in SGLang), and its text leaves the token out
    (the last id) unless ``no_stop_trim``: SGLang's trim."""
    ids = req.output_ids
    matched = (req.finished_reason or {}).get("matched")
    stopped_by_token = isinstance(matched, int) and bool(ids) and ids[-1] == matched
    if stopped_by_token and not req.sampling.no_stop_trim:
        ids = ids[:-1]
    full = tokenizer.decode(ids, skip_special_tokens=req.sampling.skip_special_tokens)
    stops = req.sampling.stop
    if stops and not stopped_by_token:
        hit = _first_stop(full, stops, max(0, len(req.text) - _max_len(stops) + 1))
        if hit is not None:
            index, stop = hit
            req.text = full[:_cut_at(req, index, stop)]
            req.detok_stop = stop
            return stop
    # An incomplete character at the end (a reply cut mid-character by max_new_tokens) is no text: left out, as
    # the stream never sends it and vLLM's final text has none (the ids keep its bytes).
    if full.endswith(_INCOMPLETE) and token_bytes is not None:
        hidden = skipped_ids(tokenizer) if req.sampling.skip_special_tokens else frozenset()
        if ends_inside_a_character(ids, token_bytes, hidden):
            full = full[:-1]
    req.text = full
    return None


def ends_inside_a_character(ids: Sequence[int], token_bytes: Sequence[bytes],
                            hidden: frozenset[int] = frozenset()) -> bool:
    """Whether the bytes ``ids`` spell (less the ``hidden`` ones, which the text leaves out) end part-way through a
    UTF-8 character (which decoding shows as one U+FFFD): the last few tokens' bytes through Python's incremental
    UTF-8 decoder, which holds back exactly such a tail. Stray bytes that no character can continue are not that
    (each is a U+FFFD of its own, for good)."""
    tail, i = b"", len(ids)
    while len(tail) < 4 and i > 0:  # a character is at most 4 bytes
        i -= 1
        if ids[i] not in hidden and 0 <= ids[i] < len(token_bytes):
            tail = token_bytes[ids[i]] + tail
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail, final=False)
    return bool(decoder.getstate()[0])


def _cut_at(req: Req, index: int, stop: str) -> int:
    """Where a text with ``stop`` at ``index`` ends: before the stop string, or after it with ``no_stop_trim``
    (SGLang's trim keeps the matched string then)."""
    return index + len(stop) if req.sampling.no_stop_trim else index


def _cut(req: Req, tokenizer, start: int, text: str, stop: str) -> str:
    """A step found a stop string (``text``: the incremental text cut before it): the request ends
    here, so cut one full decode of the output at its first stop string instead (exact, once per
    request); the incremental cut stands only if the full decode showed none, which a tokenizer whose
    decode extends its prefixes' (as SGLang's scheme assumes) never does."""
    full = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    exact = _first_stop(full, req.sampling.stop, start)
    if exact is not None:
        text, stop = full[:_cut_at(req, exact[0], exact[1])], exact[1]
    elif req.sampling.no_stop_trim:
        text += stop
    req.text = text
    req.detok_stop = stop
    return stop


def _first_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text[start:]``, or None."""
    hits = [(text.find(s, start), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    return min(hits) if hits else None


def _first_new_stop(tail: str, stops: list[str], searched: int) -> tuple[int, str] | None:
    """``_first_stop`` over ``tail`` for the matches that end past ``searched`` (the end of the text searched
    before, an index into ``tail``): each stop string is searched only from where such
    a match of it can begin, so a long one costs its own length a step, not every short one's search too."""
    best = None
    for stop in stops:
        index = tail.find(stop, max(0, searched - len(stop) + 1))
        if index >= 0 and (best is None or (index, stop) < best):
            best = (index, stop)
    return best


def _max_len(stops: list[str]) -> int:
    return max(len(s) for s in stops)


def _append_text(req: Req, piece: str) -> None:
    """``req.text += piece`` without copying the whole text: with the only reference in a local,
    CPython appends in place (amortised O(len(piece))), where the attribute would copy it each time."""
    text = req.text
    req.text = ""
    text += piece
    req.text = text


def _reset(req: Req) -> None:
    req.text = ""
    req.detok_ids = []
    req.detok_surr_len = 0
    req.detok_surr_text = ""
    req.detok_seen = 0


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops wherever they are: special added
    tokens that decode to nothing alone (an id left out of this set merely stays in the window)."""
    try:
        return _skipped_ids[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: no cache, no filtering
        return frozenset()
    candidates = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates.update(i for i, token in added.items() if getattr(token, "special", False))
    ids = frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == "")
    try:
        _skipped_ids[tokenizer] = ids
    except TypeError:
        pass
    return ids


def streamable_len(req: Req) -> int:
    """How much of ``req.text`` a stream may send now: all of it once finished; while running, all
    but what could still turn out to be the start of a stop string (``req.text`` holds final text
    only, an incomplete UTF-8 character stays in the detokenizer's window until it completes)."""
    n = len(req.text)
    if req.finished:
        return n
    if req.sampling.stop:
        n -= _max_len(req.sampling.stop) - 1
    return max(n, req.sent_len)
