"""Incremental detokenization (scheduler/detokenizer.py) on the default model's tokenizer.

Fed one token at a time, a request's text is at every step a prefix of the full decode (all of it
whenever the full decode does not end in an incomplete character) and ends equal to it, less an incomplete
character at its end (a reply cut inside a character has none of it); stop strings
are found at the same token and the same place as re-decoding everything finds them; streamed chunks
concatenate to the final text and never hold a stop string; and the ids decoded per token are O(1).
"""
from __future__ import annotations

import random

import pytest

from specjet.scheduler.detokenizer import skipped_ids, streamable_len, update_text
from specjet.scheduler.output import final_output, stream_chunk
from specjet.scheduler.request import Req
from specjet.scheduler.sampling_params import SamplingParams
from text_helpers import finished_text

PIECES = ["hello", " world", ",", ".", " the", " naïve", " café", "中文", "日本語の", " 한국어", "😀", "🎉👍",
          " 👨‍👩‍👧", "é", "ß", "  ", "   ", "\n", "\n\n", "\t", " ", "{\"a\": 1}", " x", "123", "∑∫", "<|im_end|>",
          "<|im_start|>", "<|endoftext|>", "Ω≈ç", " ñ", "🙂🙃", "…"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def partial_ids(tokenizer):
    """Ids whose decode alone ends in an incomplete UTF-8 character (a byte of a multi-byte one)."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]).endswith("\ufffd")]


def make_req(stop=None, skip=True, stream=False) -> Req:
    return Req(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(stop=stop or [], skip_special_tokens=skip),
               stream=stream)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def random_ids(rng: random.Random, tokenizer, partial_ids, kind: str, n: int) -> list[int]:
    if kind == "text":  # natural text with multi-byte characters, spaces and special tokens
        return tokenizer.encode(random_text(rng, n), add_special_tokens=False)[:n]
    if kind == "vocab":  # any ids at all
        return [rng.randrange(len(tokenizer)) for _ in range(n)]
    # lone bytes of multi-byte characters mixed with text and special tokens: split and broken characters
    pool = tokenizer.encode(random_text(rng, n), add_special_tokens=False)
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice(partial_ids) if r < 0.4 else rng.randrange(17) if r < 0.5 else rng.choice(pool))
    return out


def finish(req: Req, tokenizer, token_bytes=None) -> str | None:
    req.finished_reason = {"type": "length", "length": len(req.output_ids)}
    return update_text(req, tokenizer, token_bytes)


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each id spells, as the engine's grammar backend has them (xgrammar's decoded vocabulary)."""
    import xgrammar as xgr

    return [bytes(b) for b in xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab]


def finished(tokenizer, token_bytes, ids, skip: bool) -> str:
    """A finished request's text from its ids, computed apart from the detokenizer (tests/text_helpers.py)."""
    shown = [t for t in ids if t not in skipped_ids(tokenizer)] if skip else ids
    return finished_text(tokenizer.decode(ids, skip_special_tokens=skip), b"".join(token_bytes[t] for t in shown))


CASES = [(kind, skip, seed) for kind in ("text", "vocab", "broken") for skip in (True, False) for seed in range(12)]


@pytest.mark.parametrize("kind,skip,seed", CASES)
def test_text_is_always_a_prefix_and_ends_exact(tokenizer, token_bytes, partial_ids, kind, skip, seed):
    rng = random.Random(f"{kind}-{skip}-{seed}")
    ids = random_ids(rng, tokenizer, partial_ids, kind, rng.randrange(1, 120))
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    req = make_req(skip=skip, stream=True)
    streamed = []
    for k, token in enumerate(ids, 1):
        req.output_ids.append(token)
        assert update_text(req, tokenizer) is None
        now = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        assert full.startswith(req.text) and now.startswith(req.text)
        if not now.endswith("\ufffd"):  # nothing incomplete: the text is all of it
            assert req.text == now
        chunk = stream_chunk(req)
        if chunk is not None:
            streamed.append(chunk["text"])
    assert finish(req, tokenizer, token_bytes) is None
    expected = finished(tokenizer, token_bytes, ids, skip)
    assert req.text == expected
    streamed.append(stream_chunk(req)["text"])
    assert "".join(streamed) == expected
    assert final_output(req)["text"] == expected


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("step", [2, 3, 7])
def test_several_tokens_between_updates(tokenizer, token_bytes, partial_ids, skip, step):
    """A caller that appends several ids before updating (a speculative run) gets the same texts."""
    rng = random.Random(step)
    for kind in ("text", "broken"):
        ids = random_ids(rng, tokenizer, partial_ids, kind, 150)
        req = make_req(skip=skip)
        for k in range(0, len(ids), step):
            req.output_ids.extend(ids[k:k + step])
            update_text(req, tokenizer)
            assert tokenizer.decode(req.output_ids, skip_special_tokens=skip).startswith(req.text)
        finish(req, tokenizer, token_bytes)
        assert req.text == finished(tokenizer, token_bytes, ids, skip)


def reference_stop(tokenizer, ids, stops, skip):
    """Today's rule, re-decoding everything each token: (token count, stop, text) of the first token
    after which a stop string shows in the decode, cut at its earliest occurrence; or None."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits)
            return k, stop, text[:index]
    return None


@pytest.mark.parametrize("skip", [True, False])
def test_stop_strings_spanning_tokens(tokenizer, skip):
    spans = 0
    for seed in range(20):
        rng = random.Random(f"stop-{seed}")
        ids = tokenizer.encode(random_text(rng, 60), add_special_tokens=False)[:100]
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        for _ in range(6):
            a = rng.randrange(len(full))
            stops = [full[a:a + rng.randrange(2, 9)], "never here"]
            if rng.random() < 0.3:
                stops.append(full[a + 1:a + 3])  # a second one that may match first
            if rng.random() < 0.4:  # a long one: each stop string is searched in its own window
                b = rng.randrange(len(full))
                stops.insert(rng.randrange(len(stops) + 1), full[b:b + rng.randrange(20, 60)])
            stops = [s for s in stops if s and "\ufffd" not in s]
            expected = reference_stop(tokenizer, ids, stops, skip)
            if expected is None:
                continue
            k_ref, stop_ref, text_ref = expected
            req = make_req(stop=stops, skip=skip, stream=True)
            streamed, got = [], None
            for k, token in enumerate(ids, 1):
                req.output_ids.append(token)
                got = update_text(req, tokenizer)
                if got is not None:
                    break
                chunk = stream_chunk(req)
                if chunk is not None:
                    streamed.append(chunk["text"])
            assert (k, got, req.text) == (k_ref, stop_ref, text_ref)
            # the finished request's text: the full decode cut at the stop string's first occurrence
            whole = tokenizer.decode(req.output_ids, skip_special_tokens=skip)
            assert req.text == whole[:whole.find(got)]
            before = tokenizer.decode(ids[:k - 1], skip_special_tokens=skip).rstrip("\ufffd")
            spans += len(text_ref) < len(before)  # the stop string began before its last token
            req.finished_reason = {"type": "stop", "matched": got}
            assert update_text(req, tokenizer) == got and req.text == text_ref  # idempotent once cut
            streamed.append(stream_chunk(req)["text"])
            assert "".join(streamed) == text_ref
            assert not any(s in "".join(streamed) for s in stops)
    assert spans >= 30, spans


def test_stop_split_inside_a_multibyte_character(tokenizer):
    """A stop string ending in a character that the last token completes from its bytes."""
    text = "abc 中文 def 😀 ghi"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ["中", "文 d", "😀", " 😀 g", "c 中"]:
        req = make_req(stop=[stop], stream=True)
        for token in ids:
            req.output_ids.append(token)
            if update_text(req, tokenizer) is not None:
                break
            assert stop not in req.text[:streamable_len(req)]
        assert req.detok_stop == stop and req.text == text[:text.find(stop)]


def test_streaming_holds_back_a_possible_stop_string(tokenizer):
    req = make_req(stop=["STOP"], stream=True)
    sent = ""
    for token in tokenizer.encode("one two STOP three", add_special_tokens=False):
        req.output_ids.append(token)
        if update_text(req, tokenizer) is not None:
            break
        chunk = stream_chunk(req)
        sent += chunk["text"] if chunk else ""
        assert "S" not in sent
    assert req.text == "one two "
    req.finished_reason = {"type": "stop", "matched": "STOP"}
    assert sent + stream_chunk(req)["text"] == "one two "


def test_finish_path_finds_a_stop_and_empty_output(tokenizer):
    req = make_req(stop=["xyz"])
    assert finish(req, tokenizer) is None and req.text == ""
    # text never updated per token (no stream, no per-token calls): the finish path searches it all
    req = make_req(stop=["lo wo"])
    req.output_ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert finish(req, tokenizer) == "lo wo" and req.text == "hel"


class CountingTokenizer:
    """The real tokenizer, counting the ids passed to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_ids = 0
        self.calls = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("stop", [[], ["<never to be seen>", "zq"]])
@pytest.mark.parametrize("source", ["text", "eos_run", "broken"])
def test_decode_work_per_token_is_bounded(tokenizer, token_bytes, partial_ids, stop, source):
    n = 2000
    rng = random.Random(7)
    if source == "text":
        ids = []
        while len(ids) < n:
            ids += tokenizer.encode(random_text(rng, 400), add_special_tokens=False)
    elif source == "eos_run":  # an ignore_eos request repeating its (skipped) EOS after some text
        ids = tokenizer.encode("The answer is 42. ", add_special_tokens=False) + [tokenizer.eos_token_id] * n
    else:  # split characters now and then
        ids = []
        while len(ids) < n:
            ids += tokenizer.encode(random_text(rng, 3), add_special_tokens=False)
            ids += [rng.choice(partial_ids)] if rng.random() < 0.3 else []
    ids = ids[:n]
    counting = CountingTokenizer(tokenizer)
    req = make_req(stop=stop, stream=True)
    for token in ids:
        req.output_ids.append(token)
        assert update_text(req, counting) is None
        stream_chunk(req)
    per_token = counting.decoded_ids
    assert finish(req, counting, token_bytes) is None
    assert req.text == finished(tokenizer, token_bytes, ids, True)
    assert per_token < 10 * n, per_token  # re-decoding everything: n * (n + 1) / 2 = 2,001,000
    assert counting.decoded_ids - per_token == n  # the finish: one full decode


def test_a_whole_replacement_character_at_the_end_stays(tokenizer, token_bytes):
    """U+FFFD written whole (its three bytes) ends a reply as text; a character cut after its first byte does not;
    without the token bytes the text is the decode as it is."""
    whole = tokenizer.encode("ok \ufffd", add_special_tokens=False)
    cut = tokenizer.encode("ok ", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("\u00e4")]
    for ids, text, bytes_known in ((whole, "ok \ufffd", True), (cut, "ok ", True), (cut, "ok \ufffd", False)):
        req = make_req()
        req.output_ids.extend(ids)
        finish(req, tokenizer, token_bytes if bytes_known else None)
        assert req.text == text, (ids, bytes_known)


def test_output_ids_shrinking_starts_over(tokenizer):
    ids = tokenizer.encode("hello 中文 world", add_special_tokens=False)
    req = make_req()
    for token in ids:
        req.output_ids.append(token)
        update_text(req, tokenizer)
    req.output_ids = ids[:2]
    update_text(req, tokenizer)
    assert req.text == tokenizer.decode(ids[:2])
