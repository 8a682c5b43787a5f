"""The FastAPI app: OpenAI's endpoints over one ``Engine``, driven through ``async_generate``.

``create_app(engine, model_name)`` builds it; ``specjet.serve.cli`` runs it with uvicorn. Every
error leaves as OpenAI's ``{"error": {...}}`` JSON: what the engine refuses at the door
(``ValueError``, ``TypeError``, ``GrammarError``) is a 400, a dead engine a 503, and anything
unexpected a 500 that names the exception type (no traceback). A client that goes away aborts its
request: closing the engine's stream (or cancelling the wait) aborts it and frees its KV.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjet.engine import QueueFullError
from specjet.engine.choices import MAX_CHOICES, choice_params
from specjet.grammar.spec import GrammarError
from specjet.scheduler.sampling_params import GREEDY_TEMPERATURE
from specjet.serve import chat
from specjet.serve.logprobs import TokenTexts, chat_entries, completion_logprobs
from specjet.serve.errors import ApiError, bad_request, queue_full, unavailable
from specjet.serve.metrics import ChoiceTally, Metrics
from specjet.serve.native import HEALTH_GENERATE_TIMEOUT_S, add_native_routes
from specjet.serve.prediction_usage import prediction_details
from specjet.serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                    ChatCompletionChunk, ChatCompletionRequest, ChoiceDelta, Completion,
                                    CompletionChoice, CompletionRequest, CompletionTokensDetails, ModelCard,
                                    ModelList, PromptTokensDetails, Usage)

logger = logging.getLogger("specjet.serve")

# How often a non-streaming request checks that its client is still there.
_DISCONNECT_POLL_S = 0.5


def _usage(metas: list[dict[str, Any]], n: int, details: Optional[CompletionTokensDetails] = None) -> Usage:
    """A response's usage from its choices' (``n`` a prompt, prompt-major): each prompt once, every completion;
    ``details``: the predicted-output counts, where the request brought a prediction."""
    prompt = sum(m["prompt_tokens"] for m in metas[::n])
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas[::n])  # the prompt's tokens its prefill found cached
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=details or CompletionTokensDetails())


def _sse(payload: Any) -> str:
    if isinstance(payload, ChatCompletionChunk):
        body = payload.model_dump(mode="json")
        for choice in body["choices"]:  # a delta carries only what it has, as OpenAI's do
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    elif hasattr(payload, "model_dump"):
        body = payload.model_dump(mode="json")
    else:
        body = payload
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def create_app(engine, model_name: str, api_key: Optional[str] = None, debug_endpoints: bool = False,
               model_path: Optional[str] = None, incremental_streaming_output: bool = False,
               health_generate_timeout_s: float = HEALTH_GENERATE_TIMEOUT_S,
               allowed_origins: Optional[list[str]] = None) -> FastAPI:
    """The app over ``engine``: the OpenAI endpoints, and SGLang's native ones (``native.py``: ``model_path`` is
    what /get_model_info reports; ``incremental_streaming_output``: /generate streams increments, not whole
    outputs so far); ``allowed_origins``: the origins browsers may call it from (CORS; None or empty: none)."""
    app = FastAPI(title="specjet", version="0.1.0")
    if allowed_origins:  # a browser's preflight is answered here, before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    metrics = Metrics()
    app.state.engine, app.state.metrics = engine, metrics
    token_texts: list[TokenTexts] = []  # made at the first request that asks for logprobs

    def texts() -> TokenTexts:
        if not token_texts:
            token_texts.append(TokenTexts(engine.tokenizer, exact_token_bytes(engine)))
        return token_texts[0]

    def chat_logprobs(sp: dict, meta: dict) -> Optional[dict]:
        return {"content": chat_entries(texts(), meta), "refusal": None} if sp.get("return_logprob") else None

    # ------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError):
        if not error.recorded:  # (an engine abort's error was counted with its finish reason)
            metrics.record_refused(error.status, error.code or error.type)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # its loc is the character where parsing failed
            where = first.get("loc", ())[-1]
            message = f"the body is not valid JSON ({first.get('msg')} at character {where})"
            metrics.record_refused(400, "invalid_json")
            return JSONResponse(bad_request(message, None, "invalid_json").body(), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in problems[:5])
        code = "unknown_parameter" if first.get("type") == "extra_forbidden" else "invalid_value"
        metrics.record_refused(400, code)
        return JSONResponse(bad_request(message, param, code).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception):
        logger.exception("unexpected error in a request")
        return JSONResponse(ApiError(500, f"internal error ({type(error).__name__})", "internal_error").body(),
                            status_code=500)

    # A dependency rather than an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`,
    # and the handlers need the real one to see a client disconnect.
    async def check_api_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           "authentication_error", None, "invalid_api_key")

    v1 = APIRouter(dependencies=[Depends(check_api_key)])

    # ------------------------------------------------------------ engine calls
    def check_alive() -> None:
        if not engine.is_alive():
            raise unavailable("the engine is not running: " + str(engine.scheduler.closed_reason or "stopped"))

    async def start(sps: list[dict], stream: bool, prompts: list, prompt_param: str = "messages"):
        """``engine.async_generate`` of one request per prompt and choice (``prompts``: strings or token id
        lists; ``sps``: each choice's sampling parameters), prompt-major, its door errors as 400s: the results
        in that order, or one stream whose chunks carry their request's ``index`` (with several). The engine
        checks every request before it admits any."""
        check_alive()
        requests = [(p, choice) for p in prompts for choice in sps]
        strings = None if not isinstance(prompts[0], str) else [p for p, _ in requests]
        ids = None if strings is not None else [list(p) for p, _ in requests]
        params = [choice for _, choice in requests]
        single = len(requests) == 1
        try:
            result = await door(lambda: engine.async_generate(prompt=strings[0] if single and strings else strings,
                                                              input_ids=ids[0] if single and ids else ids,
                                                              sampling_params=params[0] if single else params,
                                                              stream=stream), sps[0], prompt_param)
        except ApiError as error:  # named as the client named it
            error.param = _OPENAI_NAMES.get(error.param, error.param)
            for engine_name, client_name in _OPENAI_NAMES.items():
                error.message = re.sub(rf"\b{engine_name}\b", client_name, error.message)
            raise
        return result if stream or not single else [result]

    async def door(call: Callable[[], Awaitable[Any]], sp: dict, prompt_param: str) -> Any:
        """``await call()`` (an engine call), what its door refuses answered as the error that fits: a 400 naming
        the parameter, a 503 for a full queue or an engine that is not alive."""
        try:
            return await call()
        except GrammarError as error:
            raise bad_request(str(error), _constraint_param(sp), "invalid_grammar") from None
        except QueueFullError as error:
            raise queue_full(str(error)) from None
        except (ValueError, TypeError) as error:
            message = str(error)
            context = "context length" in message or "KV slots" in message
            about_prompt = context or message.startswith(("input_ids", "empty prompt", "prompt"))
            counted = _COUNT_MISMATCH.match(message)  # "1 rids for 2 prompts": the list the count names
            param = prompt_param if about_prompt else counted.group(1) if counted else _param_in(message, sp)
            raise bad_request(message, param,
                              "context_length_exceeded" if context else "invalid_value") from None
        except RuntimeError as error:
            if not engine.is_alive():
                raise unavailable(str(error)) from None
            raise

    def abort_error(result: dict, sp: dict) -> Optional[ApiError]:
        """The error that answers a choice the engine aborted (None for one that finished), whether
        before its first token (a grammar it could not compile, say) or after some (the KV pool ran out,
        an internal error): OpenAI has no "abort" finish reason, and a cut reply is no answer."""
        reason = result["meta_info"]["finish_reason"] or {}
        if reason.get("type") != "abort":
            return None
        message = reason.get("message") or "the request was aborted"
        status, err_type = reason.get("status_code"), reason.get("err_type")  # the engine's (finish_reasons.py)
        if not isinstance(status, int) or not 400 <= status <= 599:
            status, err_type = 400, err_type or "request_refused"
        if status >= 500:
            if err_type == "internal_error":  # the engine failed it (README: errors): not the client's fault
                return ApiError(status, message, "internal_error")
            return ApiError(status, message, "service_unavailable", None, err_type)
        grammar_fault = err_type in ("invalid_grammar", "request_refused")
        return bad_request(message, _constraint_param(sp) if grammar_fault else None, err_type)

    def refused(result: dict, sp: dict, tally: ChoiceTally, index: int = 0) -> None:
        """Raises the error of a choice the engine aborted (a whole result, or a stream's chunk), counted once
        in the metrics as an error with the tokens the engine had taken and written for it, streamed or not
        (its prompt's only where no choice of that prompt was counted before)."""
        error = abort_error(result, sp)
        if error is not None:
            tally.record("error", result["meta_info"], index)
            error.recorded = True
            raise error

    def unkept(body: ChatCompletionRequest, result: dict, tally: ChoiceTally, index: int) -> None:
        """Raises, for a reply under ``response_format`` json_schema with ``strict``, that does not validate against
        its schema (a keyword the grammar compiler does not enforce, such as uniqueItems: the engine checks every
        finished reply, meta_info's json_schema_valid): strict promises a reply that does, so the caller gets an
        error naming the failure, not a 200 it would take for valid. Counted once as an error."""
        fmt = body.response_format
        strict = fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.strict
        meta = result["meta_info"]
        if not strict or meta.get("json_schema_valid") is not False:
            return
        tally.record("error", meta, index)
        # OpenAI's clients retry a 500; a greedy request would only write the same reply again.
        greedy = body.temperature is not None and body.temperature < GREEDY_TEMPERATURE
        error = ApiError(500, f"the reply does not validate against response_format's schema, as strict asks: "
                              f"{meta.get('json_schema_message') or 'invalid'} (the grammar enforces the schema's "
                              f"structure; this keyword it does not)", "server_error", "response_format",
                         "strict_schema_not_kept", headers={"x-should-retry": "false"} if greedy else None)
        error.recorded = True
        raise error

    async def first_chunk(stream, sp: dict, tally: ChoiceTally) -> dict:
        """A stream's first chunk, before any byte of the response goes out: a choice the engine refused
        answers the whole request, and the stream is closed (aborting the other choices)."""
        first = await _first_chunk(stream)
        try:
            refused(first, sp, tally, first.get("index", 0))
        except BaseException:
            await stream.aclose()
            raise
        return first

    async def until_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
        """``await work()``, cancelled (which aborts the engine request) if the client goes away."""
        result: list[Any] = []
        raised: list[BaseException] = []
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while not await request.is_disconnected():
                    await anyio.sleep(_DISCONNECT_POLL_S)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                result.append(await work())
            except Exception as error:  # re-raised below, not wrapped in the group's ExceptionGroup
                raised.append(error)
            group.cancel_scope.cancel()
        if raised:
            raise raised[0]
        if not result:
            metrics.record("client_disconnected")
            raise ApiError(499, "client closed the request", "client_closed")
        return result[0]

    def stream_error(error: Exception) -> str:
        if not (isinstance(error, ApiError) and error.recorded):
            metrics.record("error")
        if isinstance(error, ApiError):
            return _sse(error.body())
        logger.exception("error in a streamed response")
        if not engine.is_alive():
            return _sse(unavailable(str(error)).body())
        return _sse(ApiError(500, f"internal error ({type(error).__name__})", "internal_error").body())

    async def close(stream, finished: bool) -> None:
        """The end of a streamed response; before the request finished, a client that went away:
        closing the engine's stream aborts the request and frees its KV."""
        if not finished:
            metrics.record("client_disconnected")
        await stream.aclose()

    # ------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return JSONResponse({"status": "dead", "error": engine.scheduler.closed_reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        text = await anyio.to_thread.run_sync(metrics.render, engine)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @v1.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name)])

    @v1.get("/v1/models/{model:path}")
    async def model_card(model: str):
        if model != model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")
        return ModelCard(id=model_name)

    if debug_endpoints:
        @v1.get("/debug/kv")
        async def debug_kv():
            """Waits until the engine is idle, then checks the KV invariant (free + owned by requests +
            held by the prefix cache == pool; idle, nothing is owned by requests)."""
            await anyio.to_thread.run_sync(engine.wait_idle)
            await anyio.to_thread.run_sync(engine.check_kv_invariant)
            info = await anyio.to_thread.run_sync(engine.get_server_info)
            return {"kv_pool_size": info["kv_pool_size"], "kv_free": info["kv_free"],
                    "kv_cached": info["radix_cache"].get("cached_tokens", 0), "ok": True}

    def prepare_chat(body: ChatCompletionRequest):
        sp, plan = chat.chat_params(body)
        # OpenAI's default is "until the context is full": the engine's None.
        sp.setdefault("max_new_tokens", None)
        return sp, plan, choice_params(sp, chat.choice_count(body)), chat.chat_prompt(engine.tokenizer, body)

    @v1.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_alive()
        # Off the event loop: tool grammars are built from their schemas, and a chat template over many messages
        # takes seconds (300,000 of them, the most a body can hold: ~2.3 s), while the loop serves every stream.
        sp, plan, sps, prompt = await anyio.to_thread.run_sync(prepare_chat, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _stream_chat(body, request, sps, plan, prompt, rid)
        if plan.mode == "tagged" and plan.parallel:
            results = await until_disconnected(request, lambda: collect_calls(sps, prompt))
        else:
            results = await until_disconnected(request, lambda: start(sps, False, [prompt]))
        tally = metrics.tally(len(sps))
        for i, result in enumerate(results):
            refused(result, sp, tally, i)
        for i, result in enumerate(results):
            unkept(body, result, tally, i)
        choices = []
        for i, result in enumerate(results):
            _, message, reason = chat.finished_reply(result["text"], result, plan)
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                      logprobs=chat_logprobs(sp, result["meta_info"])))
            tally.record(reason, result["meta_info"], i)
        details = await predicted(body, [r["text"] for r in results])
        return ChatCompletion(id=rid, model=model_name,
                              usage=_usage([r["meta_info"] for r in results], len(sps), details), choices=choices)

    async def predicted(body: ChatCompletionRequest, texts: list[str]) -> Optional[CompletionTokensDetails]:
        """The prediction's accepted / rejected token counts over the choices' texts (None without one); off the
        event loop: matching is quadratic in the worst case."""
        if body.prediction is None or not body.prediction.text:
            return None
        return await anyio.to_thread.run_sync(prediction_details, engine.tokenizer, body.prediction.text, texts)

    async def collect_calls(sps: list[dict], prompt: str) -> list[dict]:
        """Whole replies that may hold several tool calls, read as a stream so that each can end at
        its first repeated call (``chat.repeat_cut``)."""
        stream = await start(sps, True, [prompt])
        cuts = RepeatCuts(stream, len(sps), whole=True)
        results: list[Optional[dict]] = [None] * len(sps)
        try:
            async for item in stream:
                i, item = cuts.take(item)
                if item is not None and item["meta_info"]["finish_reason"] is not None:
                    results[i] = {"text": cuts.texts[i], "meta_info": cuts.whole_meta(i, item["meta_info"])}
                if all(r is not None for r in results):
                    break
            return results
        finally:
            await stream.aclose()  # aborts what is left after a repeated call

    async def _stream_chat(body: ChatCompletionRequest, request: Request, sps: list[dict], plan, prompt,
                           rid) -> Response:
        sp, n = sps[0], len(sps)
        stream = await start(sps, True, [prompt])
        tally = metrics.tally(n)
        # A client that leaves while its request waits for its first token aborts it (queued, it held a place).
        first = await until_disconnected(request, lambda: first_chunk(stream, sp, tally))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created = int(time.time())

        # Each choice's token logprobs not sent yet. Plain text: an entry goes with the chunk whose content reaches
        # the end of its token's text (the engine holds text back for a stop string, not the tokens' logprobs), the
        # rest with the finish; tool calls: with the choice's next chunk.
        pending: list[list[dict]] = [[] for _ in range(n)]
        covered = [0] * n  # characters of the choice's text its sent entries' tokens spell
        sent = [0] * n  # characters of the choice's text sent as content

        def chunk(index: int, delta: ChoiceDelta, reason: Optional[str] = None) -> str:
            take = len(pending[index])
            if plan.mode is None and reason is None:
                reach, take = sent[index] + len(delta.content or ""), 0
                while take < len(pending[index]) and covered[index] + len(pending[index][take]["token"]) <= reach:
                    covered[index] += len(pending[index][take]["token"])
                    take += 1
            logprobs = None
            if take:
                logprobs, pending[index] = {"content": pending[index][:take], "refusal": None}, pending[index][take:]
            return _sse(ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[
                ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)]))

        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                for i in range(n):
                    yield chunk(i, ChoiceDelta(role="assistant", content=""))
                cuts = RepeatCuts(stream, n, active=plan.mode == "tagged" and plan.parallel)
                calls = [chat.CallStreamer(plan) for _ in range(n)]
                metas: list[Optional[dict]] = [None] * n
                item = first
                while True:
                    i, item = cuts.take(item)
                    if item is not None:
                        refused(item, sp, tally, i)
                        text = cuts.texts[i]
                        if sp.get("return_logprob"):
                            pending[i] += chat_entries(texts(), item["meta_info"])
                        # Plain text streams as it comes; "auto" tool replies stream their text up to a
                        # <tool_call>; tool calls stream their name, then their arguments as written.
                        end = {None: len(text), "tagged": chat.streamable_end(text)}.get(plan.mode, 0)
                        if plan.mode == "tagged" and not text[:end].strip():
                            end = 0  # blank so far: no content if a call follows (chat.reply), else sent at the end
                        if end > sent[i]:
                            yield chunk(i, ChoiceDelta(content=text[sent[i]:end]))
                            sent[i] = end
                        if plan.mode is not None and item["text"]:
                            deltas = calls[i].feed(text)
                            if deltas:
                                yield chunk(i, ChoiceDelta(tool_calls=deltas))
                        if item["meta_info"]["finish_reason"] is not None:
                            metas[i] = item["meta_info"]
                            unkept(body, item, tally, i)  # an error event in place of its finish
                            pieces = finish_choice(i, text, sent[i], calls[i], item)
                            # Every choice is counted: a client leaving from here on is no disconnect to count too.
                            finished = all(m is not None for m in metas)
                            for piece in pieces:
                                yield piece
                            if finished:
                                break
                    item = await stream.__anext__()
                finished = True
                if include_usage:
                    details = await predicted(body, list(cuts.texts))
                    yield _sse(ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[],
                                                   usage=_usage(metas, n, details)))
                yield "data: [DONE]\n\n"
            except Exception as error:  # after the 200 went out: an error event, not a torn stream
                yield stream_error(error)
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                await close(stream, finished)

        def finish_choice(i: int, text: str, sent: int, calls: "chat.CallStreamer", item: dict) -> list[str]:
            """A finished choice's last chunks: what its reply holds beyond what went out, then its finish reason."""
            pieces = []
            reason = chat.finish_reason(item)
            if plan.mode is not None:
                text, message, reason = chat.finished_reply(text, item, plan)
                if message.tool_calls:
                    rest = (message.content or "")[sent:]
                    # A reply cut by the token limit ends its begun call where chat.reply does.
                    deltas = calls.feed(text, finished=reason == "tool_calls")
                    # Calls the streamer could not follow (laid out unlike the grammar's) go whole.
                    deltas += [dict(call.model_dump(), index=k) for k, call in enumerate(message.tool_calls)
                               if k >= len(calls.sent)]
                else:  # no call: the reply's content (unless a call had begun)
                    rest, deltas = ("" if calls.sent else (message.content or "")[sent:]), []
                if rest:
                    pieces.append(chunk(i, ChoiceDelta(content=rest)))
                if deltas:
                    pieces.append(chunk(i, ChoiceDelta(tool_calls=deltas)))
            pieces.append(chunk(i, ChoiceDelta(), reason))
            tally.record(reason, item["meta_info"], i)
            return pieces

        return StreamingResponse(events(), media_type="text/event-stream")

    @v1.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_alive()
        sp = chat.completion_params(body)
        sps = choice_params(sp, chat.choice_count(body))
        prompts = _prompts(body.prompt)
        n, count = len(sps), len(prompts) * len(sps)
        if count > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={n} is {count} choices; at most {MAX_CHOICES} a request",
                              "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        # echo: each choice's text starts with its prompt's (a token id prompt decoded).
        echoes = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts] if body.echo else None
        if body.stream:
            stream = await start(sps, True, prompts, prompt_param="prompt")
            tally = metrics.tally(n)
            first = await until_disconnected(request, lambda: first_chunk(stream, sp, tally))
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            created = int(time.time())

            async def events() -> AsyncIterator[str]:
                finished = False
                try:
                    item, metas, offsets, started = first, [None] * count, [0] * count, [False] * count
                    while True:
                        i, reason = item.get("index", 0), chat.finish_reason(item)
                        refused(item, sp, tally, i)
                        echo = echoes is not None and not started[i]  # a choice's first chunk starts with its prompt
                        started[i] = True
                        text = (echoes[i // n] if echo else "") + item["text"]
                        logprobs = None
                        if sp.get("return_logprob"):
                            logprobs = completion_logprobs(texts(), item["meta_info"], offsets[i], prompt=echo)
                            offsets[i] += sum(len(t) for t in logprobs["tokens"])
                        if text or reason is not None or (logprobs and logprobs["tokens"]):
                            yield _sse(Completion(id=rid, created=created, model=model_name, choices=[
                                CompletionChoice(index=i, text=text, finish_reason=reason, logprobs=logprobs)]))
                        if reason is not None:
                            metas[i] = item["meta_info"]
                            tally.record(reason, item["meta_info"], i)
                            if all(m is not None for m in metas):
                                finished = True
                                break
                        item = await stream.__anext__()
                    usage = _usage(metas, n)
                    if include_usage:
                        yield _sse(Completion(id=rid, created=created, model=model_name, choices=[], usage=usage))
                    yield "data: [DONE]\n\n"
                except Exception as error:
                    yield stream_error(error)
                    yield "data: [DONE]\n\n"
                    finished = True
                finally:
                    await close(stream, finished)

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await until_disconnected(request, lambda: start(sps, False, prompts, prompt_param="prompt"))
        tally = metrics.tally(n)
        for i, result in enumerate(results):
            refused(result, sp, tally, i)
        choices = []
        for i, result in enumerate(results):
            reason = chat.finish_reason(result)
            logprobs = (completion_logprobs(texts(), result["meta_info"], prompt=echoes is not None)
                        if sp.get("return_logprob") else None)
            text = (echoes[i // n] if echoes is not None else "") + result["text"]
            choices.append(CompletionChoice(index=i, text=text, finish_reason=reason, logprobs=logprobs))
            tally.record(reason, result["meta_info"], i)
        return Completion(id=rid, model=model_name, usage=_usage([r["meta_info"] for r in results], n),
                          choices=choices)

    def record_native(item: dict, tally: ChoiceTally, index: int) -> None:
        """A native /generate request's end in the metrics, with its tokens (``index``: its place in the call, for
        the tally of the call's prompts): an abort its caller asked for (/abort_request) as "aborted", any other
        abort as an error."""
        reason = item["meta_info"].get("finish_reason") or {}
        kind = reason.get("type")
        if kind == "abort":
            kind = "aborted" if reason.get("err_type") == "request_aborted" else "error"
        tally.record(kind, item["meta_info"], index)

    add_native_routes(v1, engine, SimpleNamespace(
        check_alive=check_alive, door=door, until_disconnected=until_disconnected, abort_error=abort_error,
        stream_error=stream_error, close=close, record=record_native, tally=metrics.tally),
        model_path or getattr(getattr(engine, "args", None), "model_path", None), incremental_streaming_output,
        health_generate_timeout_s)
    app.include_router(v1)
    return app


class RepeatCuts:
    """The choices' texts of a tool reply streamed by the engine (chunks with an ``index`` where there are
    several choices), each ended at its first repeated tool call (``chat.repeat_cut``) when ``active``:
    that choice's request is aborted there and the stream's later chunks of it are dropped."""

    def __init__(self, stream, n: int, active: bool = True, whole: bool = False):
        self.stream, self.active, self.whole = stream, active, whole
        self.texts = [""] * n
        self.cut: set[int] = set()
        # ``whole``: the choices' logprobs so far, for a reply assembled from the stream (a streamed response
        # sends each chunk's own).
        self.logprobs: list[dict[str, list]] = [{} for _ in range(n)]

    def whole_meta(self, i: int, meta: dict) -> dict:
        """Choice ``i``'s last chunk's meta_info with the logprobs of all its tokens (a chunk holds its own)."""
        return dict(meta, **self.logprobs[i])

    def take(self, item: dict) -> tuple[int, Optional[dict]]:
        """(the chunk's choice, the chunk with its choice's finish where a repeat ends it; None: dropped)."""
        i = item.get("index", 0)
        if i in self.cut:
            return i, None
        self.texts[i] += item["text"]
        for key in ("output_token_logprobs", "output_top_logprobs") if self.whole else ():
            if key in item["meta_info"]:
                self.logprobs[i].setdefault(key, []).extend(item["meta_info"][key])
        cut = chat.repeat_cut(self.texts[i]) if self.active else None
        if cut is not None:
            self.texts[i] = self.texts[i][:cut]
            self.cut.add(i)
            if item["meta_info"]["finish_reason"] is None:
                self.stream.abort(i)
            item = dict(item, meta_info=dict(item["meta_info"], finish_reason=chat.REPEATED_CALL))
        return i, item


async def _first_chunk(stream) -> dict:
    try:
        return await stream.__anext__()
    except BaseException:
        await stream.aclose()
        raise


def _prompts(prompt) -> list:
    """A completion request's prompts: strings, or token id lists (OpenAI's four forms; a batch gives each
    prompt its n choices, prompt-major)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and p for p in prompt)):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such lists "
                      "(none of them empty)", "prompt")


# The engine's names of the OpenAI endpoints' parameters that it calls otherwise.
# The engine's refusal of a list whose length is not the prompts' count.
_COUNT_MISMATCH = re.compile(r"\d+ (rid|sampling_params|return_logprob|top_logprobs_num)s? (?:values )?for \d+ prompts")
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _constraint_param(sp: dict) -> Optional[str]:
    for name in ("json_schema", "regex", "ebnf"):
        if name in sp:
            return name
    return None


def _param_in(message: str, sp: dict) -> Optional[str]:
    """The sampling parameter a door error names, if any (the engine's messages start with it; the list of known
    parameters that follows an unknown one's is not searched)."""
    head = message.split("; known:")[0]
    for name in sorted(sp, key=len, reverse=True):
        if head.startswith(name) or f" {name}" in head:
            return name
    return None


def exact_token_bytes(engine) -> Optional[list[bytes]]:
    """Each token id's bytes where the engine's tokenizer is not byte-level BPE (GrammarBackend.exact_token_bytes);
    None where it is, or for an engine without a grammar backend."""
    backend = getattr(getattr(engine, "scheduler", None), "grammar_backend", None)
    return None if backend is None else backend.exact_token_bytes()
