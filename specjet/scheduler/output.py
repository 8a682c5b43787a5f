"""The dicts a caller receives: ``text``, ``output_ids``, ``meta_info`` (SGLang's names)."""
from __future__ import annotations

import time
from typing import Any

from specjet.scheduler.detokenizer import streamable_len
from specjet.scheduler.request import Req


def meta_info(req: Req) -> dict[str, Any]:
    now = req.finished_at or time.perf_counter()
    info = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finished_reason,
        "e2e_latency": now - req.created_at,
        "ttft": None if req.first_token_at is None else req.first_token_at - req.created_at,
        "retractions": req.retract_count,
        "cached_tokens": req.cached_tokens,
    }
    if req.output_check is not None:
        info["json_schema_valid"] = req.output_check.valid  # None: jsonschema could not check it
        if req.output_check.message:
            info["json_schema_message"] = req.output_check.message
    if req.spec_verify_ct:
        info["spec_verify_ct"] = req.spec_verify_ct
        # Tokens the verifies committed, per verify (as the engine's stats): the output also holds the prefill's
        # first token and any plain steps (a default engine's request that paused drafting or got company).
        info["spec_accept_length"] = sum(n * c for n, c in req.spec_accept_hist.items()) / req.spec_verify_ct
        info["spec_accept_histogram"] = dict(sorted(req.spec_accept_hist.items()))
    return info


def _logprobs(req: Req, info: dict[str, Any], start: int) -> dict[str, Any]:
    """``info`` with the logprobs of output tokens ``start``.. (SGLang's layout: (logprob, id, text) per token,
    the text None, and per token its top alternatives as such triples), where the request asked for them."""
    if req.sampling.return_logprob:
        ids = req.output_ids[start:]
        info["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(req.output_logprobs[start:], ids)]
        if req.sampling.top_logprobs_num:
            info["output_top_logprobs"] = [[(lp, t, None) for lp, t in top]
                                           for top in req.output_top_logprobs[start:]]
        if req.sampling.logprob_start_len >= 0 and start == 0:  # the prompt's, with the first output
            _prompt_logprobs(req, info)
    return info


def _prompt_logprobs(req: Req, info: dict[str, Any]) -> None:
    """SGLang's input_token_logprobs (and input_top_logprobs): the prompt's tokens from logprob_start_len on, the
    first token's logprob None (nothing comes before it)."""
    first = min(req.sampling.logprob_start_len, len(req.input_ids))
    entries = [req.input_logprobs.get(p) for p in range(first, len(req.input_ids))]
    ids = req.input_ids[first:]
    info["input_token_logprobs"] = [(None if e is None else e[0], t, None) for e, t in zip(entries, ids)]
    if req.sampling.top_logprobs_num:
        info["input_top_logprobs"] = [None if e is None else [(lp, t, None) for lp, t in e[1]] for e in entries]


def final_output(req: Req) -> dict[str, Any]:
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": _logprobs(req, meta_info(req), 0)}


def stream_chunk(req: Req) -> dict[str, Any] | None:
    """The increment since the last chunk (text and ids), or None when there is nothing new to send.
    The final chunk always goes out, carrying ``finish_reason``."""
    end = streamable_len(req)
    new_ids = req.output_ids[req.num_sent_ids:]
    if not req.finished and end <= req.sent_len:
        return None
    chunk = {"text": req.text[req.sent_len:end], "output_ids": new_ids,
             "meta_info": _logprobs(req, meta_info(req), req.num_sent_ids)}
    req.sent_len = end
    req.num_sent_ids = len(req.output_ids)
    return chunk
