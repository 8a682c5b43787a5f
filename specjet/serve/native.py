"""SGLang's native HTTP API beside the OpenAI one, so a client written for an SGLang server (its
``bench_serving --backend sglang``, scripts posting to ``/generate``) runs against specjet as long as it asks for
nothing specjet lacks.

- ``POST /generate``: the Engine's ``generate`` over HTTP, in SGLang's ``GenerateReqInput`` layout: ``text``
  or ``input_ids`` (one or a list), ``sampling_params`` (one dict, or one a prompt: ``json_schema``, ``regex``
  and ``ebnf`` included), ``stream``, ``rid``, ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len``.
  SGLang's ``n`` > 1 (parallel sampling) runs each prompt ``n`` times, prompt-major (choice i of a seeded request
  samples with seed + i, as the OpenAI endpoints' choices do; ``rid`` r becomes r_0, r_1, ...).
  The answer is the Engine's dict (a list for a list of prompts, or for ``n`` > 1). Streamed, each event is one request's
  output *so far* (``text``, ``output_ids`` and the logprob lists whole, as SGLang's server sends them;
  ``incremental=True``, the serve CLI's ``--incremental-streaming-output``: only what is new), then ``[DONE]``.
  As SGLang does, the logprob fields are ignored where ``return_logprob`` is not set, ``stream_options`` is
  ignored, ``return_text_in_logprobs`` fills each logprob triple's text, ``sampling_seed`` is the seed, a null
  ``max_new_tokens`` means up to the context, and a string ``rid`` with a list of prompts names them r_0, r_1, ...
  SGLang's fields and sampling parameters for features specjet lacks (LoRA, images, hidden states, priorities,
  disaggregation, ``stop_regex``, ...) are accepted at the values that ask for nothing (its
  defaults, null among them); other values are a 400 naming them. Routing and logging labels (``model``,
  ``log_metrics``, ``custom_labels``, ...) are ignored.
- ``GET /health_generate``: 200 once the engine shows it computes (a one-token probe request ends, or the compute
  side hands back three batches of other requests, so a busy engine is not made busier), 503 if it does not within
  ``health_timeout_s`` (20 s, SGLang's default) or is not running.
- ``GET /get_load``: SGLang's load report (requests held and waiting, KV tokens and pages in use).
- ``GET /get_model_info``, ``GET /get_server_info`` (with SGLang's ``internal_states``; both also under SGLang's
  later names ``/model_info`` and ``/server_info``), ``GET|POST /flush_cache``, ``POST /abort_request`` (``rid``,
  or ``abort_all``).

Errors are the OpenAI endpoints' (``{"error": {...}}`` with the status that fits). A single non-streamed
request the engine aborts for a cause (a grammar, the KV pool, a failure) is answered by the abort's
``status_code``; one its caller aborted (``/abort_request``), one in a list, or a stream's, is answered as SGLang
does, with the request's ``finish_reason`` (``{"type": "abort", "message", "status_code", "err_type"}``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from specjet.models.weights import default_gguf_path
from specjet.scheduler.finish_reasons import ABORTED
from specjet.serve.errors import ApiError
from specjet.serve.native_request import GenerateRequest, parallel_samples

# How long /health_generate waits for the engine to show it computes (SGLang's HEALTH_CHECK_TIMEOUT).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# How often /health_generate reads the scheduler's count of batches done while its probe waits.
_HEALTH_POLL_S = 0.02
# Batches done (of other requests) that show the compute side works after the probe started: the overlap loop may
# hold two batches computed before it started and not yet handed back; the third was launched after it started.
_HEALTH_BATCHES = 3
# meta_info lists a stream chunk holds for its new tokens only: kept whole when chunks are sent whole.
_TOKEN_LISTS = ("output_token_logprobs", "output_top_logprobs")


def with_token_texts(payload: dict[str, Any], text_of) -> dict[str, Any]:
    """``payload`` (an output or a stream event) with each logprob triple's third element its token's text
    (``return_text_in_logprobs``), in the input and output lists and their top-logprob lists."""
    meta = payload.get("meta_info")
    if not meta:
        return payload
    meta = dict(meta)
    for name in ("input_token_logprobs", "output_token_logprobs"):
        if meta.get(name) is not None:
            meta[name] = [[lp, tid, text_of(tid)] for lp, tid, *_ in meta[name]]
    for name in ("input_top_logprobs", "output_top_logprobs"):
        if meta.get(name) is not None:
            meta[name] = [None if top is None else [[lp, tid, text_of(tid)] for lp, tid, *_ in top]
                          for top in meta[name]]
    return dict(payload, meta_info=meta)


class AbortRequest(BaseModel):
    """SGLang's AbortReq: one request by ``rid``, or every live one with ``abort_all``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str = ""
    abort_all: bool = False


class Accumulator:
    """Turns a stream's increments into SGLang's whole-so-far events, per request (``index``)."""

    def __init__(self) -> None:
        self._so_far: dict[int, dict[str, Any]] = {}

    def whole(self, chunk: dict[str, Any]) -> dict[str, Any]:
        index = chunk.get("index", 0)
        before = self._so_far.get(index)
        if before is None:
            meta = dict(chunk["meta_info"])
            for name in _TOKEN_LISTS:
                if name in meta:
                    meta[name] = list(meta[name])
            merged = dict(chunk, output_ids=list(chunk["output_ids"]), meta_info=meta)
        else:  # the lists grow in place (each event is serialized before the next chunk): no copy an event
            lists = {name: before["meta_info"].get(name, []) for name in _TOKEN_LISTS}
            meta = before["meta_info"]
            meta.update(chunk["meta_info"])
            for name, so_far in lists.items():
                if name in chunk["meta_info"]:
                    so_far.extend(chunk["meta_info"][name])
                    meta[name] = so_far
            before["output_ids"].extend(chunk["output_ids"])
            merged = dict(chunk, text=before["text"] + chunk["text"], output_ids=before["output_ids"], meta_info=meta)
        self._so_far[index] = merged
        return merged


def _json(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, default=str)


def add_native_routes(router: APIRouter, engine, calls, model_path: str | None, incremental: bool = False,
                      health_timeout_s: float = HEALTH_GENERATE_TIMEOUT_S) -> None:
    """SGLang's native endpoints on ``router``; ``calls``: the app's helpers around an engine call (its door's
    errors, a client's disconnect, aborts, a stream's errors and end, the metrics)."""

    @router.get("/health_generate")
    async def health_generate():
        calls.check_alive()
        if await _engine_computes(engine, health_timeout_s):
            return {"status": "ok"}
        calls.check_alive()  # it died while the probe waited: say why
        raise ApiError(503, f"the engine did not finish a step in {health_timeout_s:g} s", "service_unavailable",
                       None, "engine_not_responding")

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateRequest, request: Request):
        calls.check_alive()
        kwargs = body.engine_kwargs()
        tally = calls.tally(parallel_samples(body.sampling_params))  # n samples of a prompt: its tokens once
        first_sp = kwargs["sampling_params"]
        first_sp = (first_sp[0] if isinstance(first_sp, list) and first_sp else first_sp) or {}
        texts = token_text if body.return_text_in_logprobs else None
        if body.stream:
            stream = await calls.door(lambda: engine.async_generate(**kwargs, stream=True), first_sp, "text")
            batch = body._batch()
            choices = (1 if batch is None else len(batch)) * parallel_samples(body.sampling_params)
            return StreamingResponse(_events(stream, tally, texts, choices), media_type="text/event-stream")
        result = await calls.until_disconnected(
            request, lambda: calls.door(lambda: engine.async_generate(**kwargs), first_sp, "text"))
        for index, item in enumerate(result if isinstance(result, list) else [result]):
            calls.record(item, tally, index)
        reason = result["meta_info"]["finish_reason"] if isinstance(result, dict) else None
        aborted = None if reason is None or reason.get("err_type") == ABORTED else calls.abort_error(result, first_sp)
        if aborted is not None:  # a lone request's abort for a cause is its answer, with its status
            aborted.recorded = True
            raise aborted
        if texts is not None:
            result = ([with_token_texts(r, texts) for r in result] if isinstance(result, list)
                      else with_token_texts(result, texts))
        return result

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        """A token's text as SGLang's logprobs give it (the tokenizer's decode of the token alone)."""
        return engine.tokenizer.decode([token_id])

    async def _events(stream, tally, texts, choices: int):
        accumulator, finished, ended = Accumulator(), False, 0
        try:
            async for chunk in stream:
                event = chunk if incremental else accumulator.whole(chunk)
                if chunk["meta_info"].get("finish_reason") is not None:
                    # its completion_tokens are the request's, whole or not
                    calls.record(event, tally, chunk.get("index", 0))
                    ended += 1
                    finished = ended >= choices  # all counted: a client leaving now is no disconnect to count too
                if texts is not None:
                    event = with_token_texts(event, texts)
                yield f"data: {_json(event)}\n\n"
            finished = True
        except Exception as error:  # mid-stream: the chunks sent stay sent; the error is the last event
            yield calls.stream_error(error)
            finished = True
        finally:
            await calls.close(stream, finished)
        yield "data: [DONE]\n\n"

    @router.get("/get_model_info")
    @router.get("/model_info")  # SGLang's later name (its bench_serving reads /server_info)
    async def get_model_info():
        path = model_path if model_path is not None else str(default_gguf_path())  # the embedded default model
        return {"model_path": path, "tokenizer_path": path, "is_generation": True}

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def get_server_info():
        info = await anyio.to_thread.run_sync(engine.get_server_info)
        args = info.pop("args")
        # SGLang's clients (bench_serving, its accept-length helpers) read internal_states[0] without a guard.
        states = [{"avg_spec_accept_length": info["stats"].get("spec_accept_length")}]
        return json.loads(_json({**dataclasses.asdict(args), **info, "internal_states": states}))

    @router.get("/get_load")
    async def get_load():
        """SGLang's load report (what its router's load-aware policies poll), for this one engine."""
        calls.check_alive()
        return [await anyio.to_thread.run_sync(engine.get_load)]

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        calls.check_alive()
        flushed = await anyio.to_thread.run_sync(engine.flush_cache)
        return {"flushed_tokens": flushed}

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if not body.abort_all and not body.rid:
            raise ApiError(400, "give a rid, or abort_all: true", "invalid_request_error", "rid", "invalid_value")
        # A rid that is not live is no error: it may have just finished.
        engine.abort_request(body.rid, abort_all=body.abort_all)
        return {"rid": body.rid, "abort_all": body.abort_all}




async def _engine_computes(engine, timeout_s: float) -> bool:
    """Whether the engine shows within ``timeout_s`` that it computes: a one-token probe request ends (an abort
    is an answer too), or the compute side hands back ``_HEALTH_BATCHES`` batches of other requests; the probe is
    aborted when it is not needed any more. A probe the door refuses (a full queue) leaves the answer to the count;
    an engine that stops is not healthy."""
    stats = engine.scheduler.stats
    before = stats["batches_done"]
    outcome: list[bool] = []
    with anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as group:
            async def probe() -> None:
                try:
                    await engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                                                "temperature": 0.0})
                except Exception:
                    return
                outcome.append(True)
                group.cancel_scope.cancel()

            group.start_soon(probe)
            while stats["batches_done"] < before + _HEALTH_BATCHES and engine.is_alive():
                await anyio.sleep(_HEALTH_POLL_S)
            outcome.append(engine.is_alive())
            group.cancel_scope.cancel()  # the probe, if still waiting: the engine aborts it
    return bool(outcome) and outcome[0]
