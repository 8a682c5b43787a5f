"""specjet serve: a real server in a subprocess on a free loopback port, the tiny random model, the
official openai client. Oracles: jsonschema for structured outputs and tool arguments, the
non-streaming greedy text for streams, sequential answers for concurrent ones, the KV invariant."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
                                  "required": ["a", "b"]}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_args: list[str], timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "specjet.serve", "--port", str(self.port),
                                      "--debug-endpoints", *model_args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.proc.stdout.read().decode(errors="replace"))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not come up")
            time.sleep(0.3)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"])
    yield srv
    try:
        kv_ok(srv)  # the module's workloads, whatever their order, leave no slot behind
    finally:
        srv.stop()


def kv_ok(server: Server) -> dict:
    r = httpx.get(server.url + "/debug/kv", timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] and body["kv_free"] + body["kv_cached"] == body["kv_pool_size"], body
    return body


def parse_prometheus(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)', line)
        assert m, f"not Prometheus text: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def chat(client, content: str, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


# ---------------------------------------------------------------- endpoints
def test_health_models_and_metrics_parse(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data]
    chat(server.client(), "hello", max_tokens=4, temperature=0)
    samples = parse_prometheus(httpx.get(server.url + "/metrics").text)
    assert samples["specjet_kv_pool_size"] >= 4096
    assert samples["specjet_engine_alive"] == 1
    assert samples["specjet_generation_tokens_total"] >= 4
    assert any(k.startswith("specjet_requests_total{finish_reason=") for k in samples)
    assert samples["specjet_batch_failures_total"] == samples["specjet_requests_isolated_total"] == 0
    assert samples["specjet_num_queued_not_started"] == 0


def test_chat_response_format_json_schema_validates(server):
    out = chat(server.client(), "Describe a person as JSON.", max_tokens=64, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 0
    samples = parse_prometheus(httpx.get(server.url + "/metrics").text)  # the schema was compiled
    assert samples["specjet_grammar_compiles_total"] >= 1 and samples["specjet_grammar_compile_seconds_total"] > 0
    # SGLang's extra field, and json_object
    out = chat(server.client(), "JSON please", max_tokens=64, temperature=0, extra_body={"json_schema": json.dumps(PERSON)})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = chat(server.client(), "JSON please", max_tokens=64, temperature=0, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def check_calls(choice, names):
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert call.id and call.type == "function"


def test_a_strict_schema_the_grammar_cannot_keep_is_an_error_not_a_200(server):
    """uniqueItems is a keyword the grammar compiler does not enforce: three items of two values always repeat one.
    Under strict (a promise of a reply that validates) the engine's check of the finished reply makes it an error,
    whole or streamed; without strict the reply is served as written."""
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}

    def body(strict, **extra):
        return dict({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                "strict": strict}}}, **extra)

    r = httpx.post(server.url + "/v1/chat/completions", json=body(True), timeout=120)
    assert r.status_code == 500 and r.json()["error"]["code"] == "strict_schema_not_kept", r.text
    assert r.headers["x-should-retry"] == "false"  # greedy: OpenAI's client would only get the same reply again
    assert "non-unique" in r.json()["error"]["message"] or "unique" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json=body(True, stream=True), timeout=120)
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "strict_schema_not_kept"
    assert not any(c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"])
    served = httpx.post(server.url + "/v1/chat/completions", json=body(False), timeout=120).json()
    assert len(json.loads(served["choices"][0]["message"]["content"])) == 3
    kv_ok(server)


def test_tool_choice_required_and_named(server):
    client = server.client()
    out = chat(client, "What is the weather in Paris?", tools=[WEATHER, ADD], tool_choice="required",
               parallel_tool_calls=False, max_tokens=64, temperature=0)
    check_calls(out.choices[0], {"get_weather", "add"})
    assert len(out.choices[0].message.tool_calls) == 1
    for seed in range(3):  # sampled, so different calls
        out = chat(client, "Add 2 and 3.", tools=[WEATHER, ADD], max_tokens=64, temperature=1.0, seed=seed,
                   tool_choice={"type": "function", "function": {"name": "add"}})
        check_calls(out.choices[0], {"add"})
    # Earlier turns with tool calls and tool results go through the template.
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
    check_calls(out.choices[0], {"add"})
    # Penalties reach the engine: negative ones (rewarding tokens already written) change the greedy
    # text of a random model, which never repeats itself unprompted.
    plain = chat(client, "Repeat after me", max_tokens=24, temperature=0).choices[0].message.content
    penalised = chat(client, "Repeat after me", max_tokens=24, temperature=0, frequency_penalty=-2.0,
                     presence_penalty=-2.0).choices[0].message.content
    assert penalised != plain
    chat(client, "hi", max_tokens=4, extra_body={"repetition_penalty": 1.2})  # SGLang's, accepted
    # tool_choice none: no tools, plain text
    out = chat(client, "hi", tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


# A tool whose parameters refer to their own definitions (what specjet.function_tool makes of a nested pydantic
# model), and one whose required name its properties do not list.
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x", "y"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"]}}}
UNLISTED = {"type": "function", "function": {"name": "report", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city", "unit"],
    "patternProperties": {"^unit$": {"enum": [1, 2]}}, "additionalProperties": False}}}


@pytest.mark.parametrize("tool", [MOVE, UNLISTED], ids=["refs", "unlisted-required"])
def test_tool_parameters_with_refs_and_unlisted_required_names(server, tool):
    """Every tool_choice mode writes calls whose arguments validate against the tool's own parameters: refs into
    the parameters' $defs were refused (the call's schema nests them, and "#" named its root), and the tagged
    grammars (required with parallel calls, auto) could not write a required name properties does not list."""
    client, name = server.client(), tool["function"]["name"]
    params = tool["function"]["parameters"]
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": name}}, None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        out = chat(client, "Go.", tools=[tool], tool_choice=choice, max_tokens=96, temperature=0, **extra).choices[0]
        assert out.finish_reason == "tool_calls", (choice, parallel, out)
        for call in out.message.tool_calls:
            assert call.function.name == name
            jsonschema.validate(json.loads(call.function.arguments), params)
    out = chat(client, "Go.", tools=[tool], max_tokens=96, temperature=0)  # auto: compiles and answers
    assert out.choices[0].finish_reason in ("tool_calls", "stop", "length")
    kv_ok(server)


def test_tool_choice_auto_is_text_or_valid_calls(server):
    for seed in range(2):
        out = chat(server.client(), "Weather in Oslo?", tools=[WEATHER], max_tokens=48, temperature=1.0, seed=seed)
        choice = out.choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(choice, {"get_weather"})
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_response_format_beside_tools_gives_the_formats_json_or_calls(server):
    """An agent's structured final answer beside its tools (it was a 400): every reply is the format's JSON or valid
    calls, whole and streamed alike (seeded)."""
    answer = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    kinds = set()
    for seed in range(4):
        kwargs = dict(tools=[WEATHER], response_format=fmt, max_tokens=64, temperature=1.0, seed=seed)
        choice = chat(server.client(), "Weather in Oslo?", **kwargs).choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(choice, {"get_weather"})
            kinds.add("calls")
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), answer)
            kinds.add("answer")
        streamed = list(chat(server.client(), "Weather in Oslo?", stream=True, **kwargs))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (choice.message.content or "")
    assert kinds, "every reply was cut by max_tokens"
    kv_ok(server)


def test_streaming_assembles_to_the_greedy_text(server):
    client = server.client()
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            full = chat(client, "Tell me a story.", max_tokens=24, temperature=0)
            expected = full.choices[0].message.content
            stream = chat(client, "Tell me a story.", max_tokens=24, temperature=0, stream=True,
                          stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0)
            expected = full.choices[0].text
            chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert text == expected and text
        assert finish == [full.choices[0].finish_reason]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_usage_counts_the_prompt_tokens_found_cached(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens (an agent loop resends its conversation each turn): 0 for a
    prompt the cache has never seen, most of it when the same prompt comes again."""
    client = server.client()
    prompt = f"{uuid.uuid4().hex} is a prompt never sent before, which the cache cannot hold: count to three."
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).usage
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert first.prompt_tokens // 2 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    kv_ok(server)


def test_streamed_tool_replies_match_the_whole_ones(server):
    client = server.client()
    cases = [dict(tools=[WEATHER], tool_choice="auto", temperature=0),
             dict(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, temperature=0)]
    for kwargs in cases:
        full = chat(client, "Weather in Oslo?", max_tokens=48, **kwargs).choices[0]
        chunks = list(chat(client, "Weather in Oslo?", max_tokens=48, stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls: dict[int, list[str]] = {}  # assembled as clients do: by index, the pieces joined
        for c in chunks:
            for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                call = calls.setdefault(t.index, ["", ""])
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [full.finish_reason]
        assert content == (full.message.content or "")
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (t.function.name, t.function.arguments) for t in (full.message.tool_calls or [])]
        if kwargs["tool_choice"] == "required":  # the arguments came in pieces, not whole at the end
            pieces = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
            assert len(pieces) > 2


def streamed_choices(chunks, field: str = "content"):
    """A stream of several choices assembled as clients do, by index: {index: (text, [finish reasons])}."""
    out: dict[int, list] = {}
    for c in chunks:
        for choice in c.choices:
            entry = out.setdefault(choice.index, ["", []])
            entry[0] += (getattr(choice.delta, field) or "") if field == "content" else choice.text
            if choice.finish_reason:
                entry[1].append(choice.finish_reason)
    return {i: (text, reasons) for i, (text, reasons) in out.items()}


def test_n_choices_are_the_seeded_single_requests(server):
    """n=3 with a seed: choice i is what one request with seed + i gives (the engine's output of a request does
    not depend on what shares its batches), whole or streamed, and the usage counts the prompt once and every
    choice's completion."""
    client = server.client()
    kwargs = dict(max_tokens=12, temperature=1.0, seed=7)
    singles = [chat(client, "Tell me a story.", **dict(kwargs, seed=7 + i)) for i in range(3)]
    expected = [s.choices[0].message.content for s in singles]
    assert len(set(expected)) > 1, expected  # sampled with different seeds: the choices differ
    full = chat(client, "Tell me a story.", n=3, **kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.message.content for c in full.choices] == expected
    assert [c.finish_reason for c in full.choices] == [s.choices[0].finish_reason for s in singles]
    assert full.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert full.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert [c.message.content for c in chat(client, "Tell me a story.", n=3, **kwargs).choices] == expected

    chunks = list(chat(client, "Tell me a story.", n=3, stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = streamed_choices(chunks)
    assert {i: text for i, (text, _) in streamed.items()} == dict(enumerate(expected))
    assert all(len(reasons) == 1 for _, reasons in streamed.values())
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    done = client.completions.create(model="tiny", prompt="Once upon a time", n=2, **kwargs)
    one = [client.completions.create(model="tiny", prompt="Once upon a time", **dict(kwargs, seed=7 + i))
           for i in range(2)]
    assert [c.text for c in done.choices] == [o.choices[0].text for o in one]
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", n=2, stream=True, **kwargs))
    assert {i: text for i, (text, _) in streamed_choices(chunks, "text").items()} == {
        i: o.choices[0].text for i, o in enumerate(one)}
    kv_ok(server)


def test_completions_of_a_batch_of_prompts(server):
    """OpenAI's batched completions: a list of prompts (strings, or token id lists), each with its n choices,
    prompt-major (index = prompt * n + choice); each equals its single request, whole or streamed; the usage
    counts each prompt once."""
    client = server.client()
    prompts = ["Once upon a time", "The weather today", "1, 2, 3,"]
    kwargs = dict(max_tokens=10, temperature=1.0, seed=21)
    singles = [[client.completions.create(model="tiny", prompt=p, **dict(kwargs, seed=21 + j)) for j in range(2)]
               for p in prompts]
    expected = [singles[i][j].choices[0].text for i in range(3) for j in range(2)]
    before = parse_prometheus(httpx.get(server.url + "/metrics").text)
    out = client.completions.create(model="tiny", prompt=prompts, n=2, **kwargs)
    after = parse_prometheus(httpx.get(server.url + "/metrics").text)
    assert [c.index for c in out.choices] == list(range(6)) and [c.text for c in out.choices] == expected
    for name, counted in (("prompt_tokens_total", out.usage.prompt_tokens),
                          ("generation_tokens_total", out.usage.completion_tokens)):
        assert after[f"specjet_{name}"] - before[f"specjet_{name}"] == counted, name
    assert out.usage.prompt_tokens == sum(s[0].usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == sum(x.usage.completion_tokens for s in singles for x in s)
    ids = [[1, 2, 3 + i] for i in range(3)]
    by_ids = client.completions.create(model="tiny", prompt=ids, **kwargs)
    assert [c.text for c in by_ids.choices] == [
        client.completions.create(model="tiny", prompt=x, **kwargs).choices[0].text for x in ids]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    streamed = streamed_choices(chunks, "text")
    assert {i: text for i, (text, _) in streamed.items()} == dict(enumerate(expected))
    assert all(len(reasons) == 1 for _, reasons in streamed.values())
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    for bad in ([], [[]]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=bad)
        assert error_of(e)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=["a"] * 65, n=2)
    assert error_of(e)["param"] == "prompt" and "at most 128" in error_of(e)["message"]
    kv_ok(server)


def test_logprobs_in_both_layouts_whole_and_streamed(server):
    """Chat's logprobs.content and the legacy completions layout: one entry per completion token, their bytes
    making up the reply, the greedy token its own best alternative, the same numbers whole and streamed and on
    both endpoints (the engine's are checked against transformers in tests/test_logprobs.py)."""
    client = server.client()
    kwargs = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = chat(client, "Tell me a story.", logprobs=True, top_logprobs=3, **kwargs)
    content = full.choices[0].logprobs.content  # an entry a token, but those the text leaves out (special ones)
    assert 0 < len(content) <= full.usage.completion_tokens == 12
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == full.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert chat(client, "Tell me a story.", **kwargs).choices[0].logprobs is None
    chunks = list(chat(client, "Tell me a story.", logprobs=True, top_logprobs=3, stream=True, **kwargs))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # With a stop string the engine holds text back, not the tokens' logprobs: an entry still comes with the chunk
    # that completes its token's text, never before (so far, the entries spell a prefix of the content sent).
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 4]
    so_far, spelled = "", ""
    for c in chat(client, "Tell me a story.", logprobs=True, stream=True, stop=[stop], **kwargs):
        for ch in c.choices:
            so_far += ch.delta.content or ""
            spelled += "".join(e.token for e in (ch.logprobs.content if ch.logprobs else []))
            if ch.finish_reason is None:
                assert so_far.startswith(spelled), (so_far, spelled)
    assert so_far == text[:text.find(stop)] and spelled.startswith(so_far)
    # A tool reply with parallel calls (assembled from the engine's stream): every chunk's entries, whole or streamed.
    tools = dict(tools=[WEATHER], max_tokens=48, temperature=0, logprobs=True)
    whole = chat(client, "Weather in Oslo?", **tools).choices[0].logprobs.content
    pieces = [e for c in chat(client, "Weather in Oslo?", stream=True, **tools) for ch in c.choices if ch.logprobs
              for e in ch.logprobs.content]
    assert whole and [(e.token, e.logprob) for e in pieces] == [(e.token, e.logprob) for e in whole]

    done = client.completions.create(model="tiny", prompt="Once upon a time", logprobs=2, **kwargs)
    lp = done.choices[0].logprobs
    count = len(lp.tokens)
    assert 0 < count == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) <= 12
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(count)]
    assert all(len(top) == 2 and max(top.values()) == logprob for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", logprobs=2, stream=True, **kwargs))
    assert [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs] == lp.token_logprobs
    assert [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.text_offset] == lp.text_offset
    for bad, param in ((dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(top_logprobs=2), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", **bad)
        assert error_of(e)["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", logprobs=6)
    assert error_of(e)["param"] == "logprobs"
    kv_ok(server)


def test_echo_with_logprobs_scores_a_prompt(server, tiny_model_dir):
    """The legacy completions' echo with logprobs and max_tokens 0 (how evaluation harnesses score a text): the
    prompt comes back with its tokens' logprobs, the first None; with a completion after it, its tokens follow
    with the numbers the same request without echo reports, whole and streamed."""
    client = server.client()
    prompt = "Once upon a time there was"
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert len(lp.tokens) == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0
    kwargs = dict(max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt=prompt, **kwargs).choices[0]
    echoed = client.completions.create(model="tiny", prompt=prompt, echo=True, **kwargs).choices[0]
    assert echoed.text == prompt + plain.text
    count = len(lp.tokens)
    assert echoed.logprobs.token_logprobs == lp.token_logprobs + plain.logprobs.token_logprobs
    assert echoed.logprobs.tokens[count:] == plain.logprobs.tokens
    assert echoed.logprobs.text_offset[count:] == [len(prompt) + o for o in plain.logprobs.text_offset]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, echo=True, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text
    assert [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs] == \
        echoed.logprobs.token_logprobs
    assert client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=2).choices[0].text.startswith(
        prompt)
    # lm-evaluation-harness's request (token ids, echo, logprobs 1, one token) reads token_logprobs[ctxlen:-1] as
    # the continuation's and the last as the generated token's: a generated EOS has its entry (its text empty).
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids, eos = tokenizer(prompt)["input_ids"], tokenizer.eos_token_id
    ended = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                      logit_bias={str(eos): 100}).choices[0]
    assert ended.finish_reason == "stop" and ended.text == prompt
    assert len(ended.logprobs.token_logprobs) == len(ids) + 1 and ended.logprobs.tokens[-1] == ""
    assert ended.logprobs.token_logprobs[:-1] == lp.token_logprobs and ended.logprobs.token_logprobs[-1] < 0
    assert ended.logprobs.text_offset[-1] == len(prompt)
    kv_ok(server)


def test_n_choices_under_a_schema_and_with_tools(server):
    """Every choice of a json_schema request validates; with tool_choice auto (parallel calls, read back
    per choice with the repeated-call cut) each choice is text or valid calls, and equals its seeded single."""
    client = server.client()
    out = chat(client, "A person, please.", n=4, max_tokens=40, temperature=1.0, seed=3,
               response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    kwargs = dict(tools=[WEATHER], max_tokens=48, temperature=1.0)
    both = chat(client, "Weather in Oslo?", n=2, seed=11, **kwargs).choices
    for i, choice in enumerate(both):
        single = chat(client, "Weather in Oslo?", seed=11 + i, **kwargs).choices[0]
        assert (choice.message.content, choice.finish_reason) == (single.message.content, single.finish_reason)
        assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []] == [
            (t.function.name, t.function.arguments) for t in single.message.tool_calls or []]
        if choice.finish_reason == "tool_calls":
            check_calls(choice, {"get_weather"})
    kv_ok(server)


def test_logit_bias_forces_and_bans_tokens_whole_and_streamed(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = server.client()
    cat = tok(" cat", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(model="tiny", prompt="A dog", max_tokens=3, temperature=0,
                                       logit_bias={str(cat): 100})
    assert forced.choices[0].text == tok.decode([cat] * 3)
    streamed = chat(client, "hi", max_tokens=3, temperature=0, logit_bias={str(cat): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == tok.decode([cat] * 3)
    base = client.completions.create(model="tiny", prompt="A dog", max_tokens=4, temperature=0)
    ids = tok(base.choices[0].text, add_special_tokens=False)["input_ids"]
    banned = client.completions.create(model="tiny", prompt="A dog", max_tokens=4, temperature=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != base.choices[0].text
    assert tok(banned.choices[0].text, add_special_tokens=False)["input_ids"][0] != ids[0]
    for bias, param in (({"abc": 1}, "logit_bias"), ({str(cat): 101}, "logit_bias"), ({"99999999": 1}, "logit_bias"),
                        ({str(cat): "strong"}, f"logit_bias.{cat}")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", max_tokens=2, logit_bias=bias)
        assert error_of(e)["param"] == param, error_of(e)
    kv_ok(server)


def test_a_model_card_by_name_and_a_body_that_is_not_json(server):
    client = server.client()
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert error_of(e)["code"] == "model_not_found" and name in error_of(e)["message"]
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert "not valid JSON" in r.json()["error"]["message"] and r.json()["error"]["param"] is None


def test_sixteen_concurrent_async_requests(server):
    prompts = [f"Count to {i}." for i in range(16)]
    client = server.client()
    expected = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in prompts]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with aclient:
            outs = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
                                          for p in prompts])
            schema_outs = await asyncio.gather(*[
                aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=64,
                                                temperature=0, response_format={"type": "json_schema", "json_schema": {
                                                    "name": "p", "schema": PERSON}}) for p in prompts[:8]])
        return outs, schema_outs

    outs, schema_outs = asyncio.run(main())
    assert [o.choices[0].text for o in outs] == expected
    for o in schema_outs:
        assert o.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.choices[0].message.content), PERSON)
    kv_ok(server)


def test_client_disconnecting_mid_stream_aborts(server):
    body = {"model": "tiny", "prompt": "Go on and on:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) >= 3:
                    break
    # The request would hold KV for 1500 tokens for a while; the disconnect must abort it and free it.
    assert httpx.get(server.url + "/health").status_code == 200
    kv_ok(server)
    samples = parse_prometheus(httpx.get(server.url + "/metrics").text)
    assert samples["specjet_kv_free_slots"] + samples["specjet_kv_cached_slots"] == samples["specjet_kv_pool_size"]
    assert samples["specjet_num_running_reqs"] == 0
    gone = samples.get('specjet_requests_total{finish_reason="client_disconnected"}', 0)
    assert gone >= 1
    # A non-streaming request whose client gives up is aborted too. The client leaves an eighth of the way through
    # the same request timed whole first, so it leaves mid-generation however fast this machine decodes (and the
    # request cannot end before the server notices, unless the machine's load changes eightfold in between).
    long_request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900,
                    "ignore_eos": True}
    start = time.monotonic()
    assert httpx.post(server.url + "/v1/chat/completions", timeout=120, json=long_request).status_code == 200
    whole = time.monotonic() - start
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=whole / 8, json=long_request)
    deadline = time.monotonic() + 30
    while True:
        samples = parse_prometheus(httpx.get(server.url + "/metrics").text)
        if samples.get('specjet_requests_total{finish_reason="client_disconnected"}', 0) == gone + 1:
            break
        assert time.monotonic() < deadline, "the server did not notice the client leave"
        time.sleep(0.2)
    kv_ok(server)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_speculative_server_answers_the_same_and_reports_its_accept_length(server, tiny_model_dir):
    prompts = ["Once upon a time", "The list: a, b, a, b, a, b,"]
    expected = [server.client().completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
                for p in prompts]
    reply = chat(server.client(), "Tell me a story", max_tokens=32, temperature=0).choices[0].message.content
    spec = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096",
                   "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"])
    try:
        got = [spec.client().completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
               for p in prompts]
        assert got == expected
        # A predicted output, whole or in text parts, exact or edited, changes no token.
        for content in (reply, [{"type": "text", "text": reply[:10]}, {"type": "text", "text": reply[10:]}],
                        reply.replace("e", "a")):
            out = chat(spec.client(), "Tell me a story", max_tokens=32, temperature=0,
                       prediction={"type": "content", "content": content})
            assert out.choices[0].message.content == reply
        # usage.completion_tokens_details: the prediction's tokens the reply took, and the others.
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

        def spec_tokenizer(text):
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        n_reply = len(spec_tokenizer(reply))
        exact = chat(spec.client(), "Tell me a story", max_tokens=32, temperature=0,
                     prediction={"type": "content", "content": reply}).usage.completion_tokens_details
        assert (exact.accepted_prediction_tokens, exact.rejected_prediction_tokens) == (n_reply, 0)
        longer = reply + " and then the end of a story nobody told"
        extra = len(spec_tokenizer(longer)) - n_reply
        chunks = list(chat(spec.client(), "Tell me a story", max_tokens=32, temperature=0, stream=True,
                           stream_options={"include_usage": True}, prediction={"type": "content", "content": longer}))
        streamed = chunks[-1].usage.completion_tokens_details
        assert streamed.accepted_prediction_tokens >= n_reply - 2 and streamed.rejected_prediction_tokens >= extra
        none = chat(spec.client(), "Tell me a story", max_tokens=4).usage.completion_tokens_details
        assert (none.accepted_prediction_tokens, none.rejected_prediction_tokens) == (0, 0)
        for bad, param in (({"type": "text", "content": "x"}, "prediction.type"), ({"type": "content"},
                                                                                  "prediction.content")):
            with pytest.raises(openai.BadRequestError) as e:
                chat(spec.client(), "hi", max_tokens=2, prediction=bad)
            assert error_of(e)["param"] == param, error_of(e)
        samples = parse_prometheus(httpx.get(spec.url + "/metrics").text)
        assert samples["specjet_spec_accept_length"] >= 1 and samples["specjet_spec_verify_total"] >= 1
        kv_ok(spec)
    finally:
        spec.stop()


# ---------------------------------------------------------------- errors
def error_of(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_errors_are_openai_shaped_400s(server):
    client = server.client()
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", n=n)
        assert error_of(e)["param"] == "n" and "n must be in [1, 128]" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}})
    err = error_of(e)
    assert "invalid JSON schema" in err["message"] and "properties/a/type" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", extra_body={"json_schema": "{not json"})
    assert error_of(e)["param"] == "json_schema"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", extra_body={"ebnf": "root ::= ("})  # refused at the door, with the compiler's reason
    assert error_of(e)["param"] == "ebnf" and "could not be parsed" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", temperature=-1)
    assert error_of(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", frequency_penalty=3.0)
    assert error_of(e)["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", extra_body={"no_such_field": 1})
    assert error_of(e)["param"] == "no_such_field" and error_of(e)["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=4)
    assert error_of(e)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # a reply that cannot fit beside its prompt: not cut short
        chat(client, "hi", max_tokens=100_000)
    assert error_of(e)["code"] == "context_length_exceeded" and "and max_tokens 100000 exceed the context length" in error_of(e)["message"], error_of(e)
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's and vLLM's rule
        chat(client, "hi", stream_options={"include_usage": True})
    assert error_of(e)["param"] == "stream_options", error_of(e)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in error_of(e)["message"]
    for wrong in ({"max_tokens": True}, {"temperature": "0.5"}, {"max_tokens": -1}, {"max_completion_tokens": -2},
                  {"min_tokens": -1}):  # strict types and ranges, named as the client named them
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", extra_body=wrong)
        assert error_of(e)["param"] == next(iter(wrong)), error_of(e)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[True, False], max_tokens=2)  # not token ids 1 and 0
    assert error_of(e)["param"].startswith("prompt")
    with pytest.raises(openai.BadRequestError) as e:  # a token id the vocabulary lacks: the engine's door
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)
    assert error_of(e)["param"] == "prompt" and "input_ids must be ints" in error_of(e)["message"], error_of(e)
    with pytest.raises(openai.BadRequestError) as e:  # compiles, then allows no token: refused, not a 200
        chat(client, "hi", extra_body={"regex": "[^\\x00-\\U0010FFFF]"})
    assert error_of(e)["param"] == "regex" and "allows no token" in error_of(e)["message"], error_of(e)
    with pytest.raises(openai.BadRequestError) as e:  # a stream refused before its first byte
        chat(client, "hi", stream=True, extra_body={"regex": "(unclosed"})
    assert error_of(e)["param"] == "regex"
    assert httpx.get(server.url + "/health").status_code == 200
    kv_ok(server)


def test_openai_fields_that_change_nothing_and_nulls_are_accepted(server):
    """What OpenAI documents and clients send without asking for anything specjet lacks: nulls where the spec
    allows them, billing and routing fields, a non-reasoning model's reasoning_effort and verbosity, modalities
    ["text"], stream_options.include_obfuscation, an earlier assistant turn's refusal part. The same greedy reply as
    without them; audio output is still a 400 naming the field."""
    def post(body):
        return httpx.post(server.url + "/v1/chat/completions", timeout=120, json=dict(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}, **body))

    plain = post({}).json()["choices"][0]["message"]["content"]
    for body in ({"stream": None, "n": None, "stop": None, "seed": None},
                 {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1",
                  "reasoning_effort": "low", "verbosity": "low", "modalities": ["text"]},
                 {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                     {"type": "refusal", "refusal": "I cannot."}]}, {"role": "user", "content": "hi"}]}):
        r = post(body)
        assert r.status_code == 200, (body, r.text)
        if "messages" not in body:
            assert r.json()["choices"][0]["message"]["content"] == plain, body
    streamed = post({"stream": True, "stream_options": {"include_usage": None, "include_obfuscation": True}})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert all('"usage":{' not in line for line in streamed.text.splitlines())  # include_usage null: no usage chunk
    r = post({"modalities": ["text", "audio"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("modalities")
    for max_tokens in ({}, {"max_tokens": None}):  # a completion's null is OpenAI's default, 16 (it was 128)
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json=dict({"prompt": "hi", "ignore_eos": True}, **max_tokens))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, (max_tokens, r.text)
    kv_ok(server)


def test_refused_requests_are_counted_by_status_and_code(server):
    """A request refused at the door has no finish reason: /metrics counted nothing for it, so an operator could not
    see a client's stream of 400s or a full queue's 503s."""
    def refused() -> dict:
        samples = parse_prometheus(httpx.get(server.url + "/metrics").text)
        return {k: v for k, v in samples.items() if k.startswith("specjet_requests_refused_total")}

    before = refused()
    hi = [{"role": "user", "content": "hi"}]
    for body in ({"messages": hi, "seed": -1}, {"messages": hi, "nonsense": 1}, {"messages": hi, "max_tokens": 10**9}):
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 400
    assert httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=60,
                      headers={"content-type": "application/json"}).status_code == 400
    after = refused()
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {'specjet_requests_refused_total{status="400",code="invalid_value"}': 1,
                    'specjet_requests_refused_total{status="400",code="unknown_parameter"}': 1,
                    'specjet_requests_refused_total{status="400",code="context_length_exceeded"}': 1,
                    'specjet_requests_refused_total{status="400",code="invalid_json"}': 1}, grew
    kv_ok(server)


def test_bad_requests_fail_alone_beside_a_running_stream(server):
    """Each body that session 106 turned from a 500 (or a silent wrong answer) into a 400, sent while another
    request streams: each is refused naming its problem, and the stream beside them runs to its end."""
    client = server.client()
    stream = chat(client, "Tell me a story.", max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(stream)
    deep = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    hi = [{"role": "user", "content": "hi"}]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}}}}
    bodies = {
        "messages.0.content": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.1.tool_calls": {"messages": hi + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": "f"}]}]},
        "response_format.json_schema.schema": {"messages": hi, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}},
        "tools": {"messages": hi, "tools": [bad_tool]},
        # a schema xgrammar would enforce as another (a pattern matching a quote), on the named call's grammar
        "tools ": {"messages": hi, "tools": [{"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": '^a"b$'}}}}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice": {"messages": hi, "tools": [], "tool_choice": "required"},
        "seed": {"messages": hi, "seed": -1},
    }
    for param, body in bodies.items():
        r = httpx.post(server.url + "/v1/chat/completions", json=dict(body, max_tokens=4), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param.strip(), (param, r.text)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"content-type": "application/json"},
                   content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}')
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text
    chunks = [first] + list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) > 0
    kv_ok(server)


@pytest.mark.e2e
def test_default_model_tools_and_schema_e2e():
    srv = Server(["--max-total-tokens", "8192"])
    try:
        client = srv.client()
        out = chat(client, "What is the weather in Paris, in celsius?", tools=[WEATHER, ADD], tool_choice="required",
                   max_tokens=96, temperature=0)
        check_calls(out.choices[0], {"get_weather", "add"})
        # Parallel calls: the model cycles through them; the reply ends at the first repeat.
        for stream in (False, True):
            request = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}],
                           tools=[WEATHER], tool_choice="required", max_tokens=300, temperature=0)
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **request))
                calls = {}
                for c in chunks:
                    for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                        call = calls.setdefault(t.index, ["", ""])
                        call[0] += t.function.name or ""
                        call[1] += t.function.arguments or ""
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert finish == ["tool_calls"] and [tuple(calls[i]) for i in sorted(calls)] == whole
            else:
                out = client.chat.completions.create(**request)
                check_calls(out.choices[0], {"get_weather"})
                whole = [(t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls]
                assert len(set(whole)) == len(whole) and out.usage.completion_tokens < 300
        # auto: a 135M model opens a call on its own only after an example turn (the client's history);
        # then a request that needs the tool gets a call, and one that does not gets text.
        history = [{"role": "system", "content": "You are a helpful assistant with tool calling capabilities."},
                   {"role": "user", "content": "What's the weather in Rome?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                   {"role": "tool", "tool_call_id": "1", "content": "sunny, 20 C"},
                   {"role": "assistant", "content": "It is sunny in Rome, 20 C."}]
        needs = client.chat.completions.create(model="m", messages=history + [
            {"role": "user", "content": "What's the weather like in Paris right now?"}], tools=[WEATHER],
            tool_choice="auto", max_tokens=60, temperature=0)
        check_calls(needs.choices[0], {"get_weather"})
        plain = client.chat.completions.create(model="m", messages=history + [
            {"role": "user", "content": "What is 2+2? Answer briefly."}], tools=[WEATHER], tool_choice="auto",
            max_tokens=60, temperature=0)
        assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
        assert "4" in plain.choices[0].message.content
        out = chat(client, "Describe Ada Lovelace as JSON.", max_tokens=96, temperature=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        # Three sampled choices under the schema, each valid, with logprobs whose bytes make up its reply.
        out = chat(client, "Describe Ada Lovelace as JSON.", max_tokens=96, temperature=0.8, seed=1, n=3,
                   logprobs=True, top_logprobs=2,
                   response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert len(out.choices) == 3 and len({c.message.content for c in out.choices}) > 1
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            text = b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode()
            assert text == choice.message.content and all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        kv_ok(srv)
    finally:
        srv.stop()


def test_a_request_body_over_the_servers_limit_is_a_413(server):
    """The CLI puts BodyLimit around the app: a 33 MB body is refused before FastAPI parses it, and the server
    goes on serving."""
    body = json.dumps({"model": "tiny", "prompt": "x" * (33 << 20), "max_tokens": 1})
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert chat(server.client(), "hi", max_tokens=2).choices[0].finish_reason == "length"


def test_shutdown_is_bounded_by_a_client_that_stopped_reading(tiny_model_dir):
    """SIGTERM while a client holds a long stream it no longer reads: uvicorn waited for its response without limit
    (the process lived as long as the client's socket). --graceful-shutdown-s bounds the wait; the response is then
    cancelled, its request aborted, and the process exits."""
    import signal

    srv = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096", "--graceful-shutdown-s", "2"])
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps({"text": "a", "stream": True, "sampling_params": {
            "max_new_tokens": None, "temperature": 0, "ignore_eos": True}}).encode()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # streaming, then never read again
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        srv.proc.wait(timeout=60)
        assert time.monotonic() - start < 30  # the 2 s grace, the engine's shutdown, the interpreter's exit
    finally:
        sock.close()
        srv.stop()
    from specjet.serve.cli import build_parser

    assert build_parser().parse_args([]).graceful_shutdown_s == 30


def test_a_graceful_shutdown_answers_the_requests_it_ends():
    """SIGTERM while a long stream and a long whole reply run (the default model, 7,000 tokens each: far past the
    grace period): the server stops listening at once, and before its 4 s grace runs out it ends both requests and
    answers each, the stream with an error event and the whole reply with a 503 engine_not_alive saying the server
    is shutting down. Before, uvicorn cut both connections at the deadline without a word. Then the process exits."""
    import signal
    import threading

    srv = Server(["--max-total-tokens", "16384", "--graceful-shutdown-s", "4"])
    client = srv.client()
    long = dict(model="m", max_tokens=7000, temperature=0, extra_body={"ignore_eos": True})
    outcome: dict = {}
    first_chunk = threading.Event()

    def stream():
        chunks = 0
        try:
            for _ in client.chat.completions.create(
                    messages=[{"role": "user", "content": "Tell me a very long story."}], stream=True, **long):
                chunks += 1
                first_chunk.set()
        except Exception as exc:  # what the client is told is the test's subject
            outcome["stream"] = exc
        outcome["chunks"] = chunks
        first_chunk.set()

    def whole():
        try:
            outcome["whole"] = client.completions.create(prompt="Once upon a time", **long)
        except Exception as exc:
            outcome["whole"] = exc

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        assert first_chunk.wait(120)
        time.sleep(0.5)  # the whole reply's request is running too
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer listening
            httpx.get(srv.url + "/health", timeout=5)
        for t in threads:
            t.join(60)
        # uvicorn raises the signal it caught again once it has shut down: the exit a SIGTERM'd process has
        assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 30
    finally:
        srv.stop()
    error = outcome.get("stream")
    assert isinstance(error, openai.APIError) and not isinstance(error, openai.APIConnectionError), repr(error)
    assert "shutting down" in str(error) and outcome["chunks"] > 1
    error = outcome["whole"]
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, repr(error)
    assert error.body["code"] == "engine_not_alive" and "shutting down" in error.body["message"], error.body


def test_a_full_queue_is_a_503_with_retry_after(tiny_model_dir):
    """`--max-queued-requests 1 --max-running-requests 1`: one streamed completion runs, a second waits; a third is
    refused with a 503 (the official client's InternalServerError) naming the bound, with Retry-After, and is served
    once the queue has room; a call larger than the bound is a 400 (no wait lets it in)."""
    import threading

    srv = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096", "--max-queued-requests", "1",
                  "--max-running-requests", "1"])
    try:
        client = srv.client()
        running = client.completions.create(model="tiny", prompt="hold", max_tokens=2000, temperature=0, stream=True)
        next(iter(running))  # it has started
        waiting = {}
        waiter = threading.Thread(target=lambda: waiting.setdefault(
            "out", srv.client().completions.create(model="tiny", prompt="wait", max_tokens=2, temperature=0)))
        waiter.start()
        deadline = time.monotonic() + 60
        while parse_prometheus(httpx.get(srv.url + "/metrics").text).get("specjet_num_queued_not_started", 0) < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert error_of(e)["code"] == "queue_full" and "max_queued_requests=1" in error_of(e)["message"]
        running.close()  # the first ends (aborted); the second starts and finishes
        waiter.join(timeout=60)
        assert waiting["out"].choices[0].finish_reason == "length"
        assert client.completions.create(model="tiny", prompt="fits", max_tokens=2).choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
        assert "can never fit max_queued_requests=1" in error_of(e)["message"]
        # A streamed request whose client leaves while it waits to start (before its first byte) leaves the queue
        # then and is never started: it held the queue's one place, turning others away with 503s, until the
        # engine reached it, prefilled it and found its client gone.
        def stats():
            return httpx.get(srv.url + "/get_server_info", timeout=60).json()["stats"]

        for path, payload in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "wait"}]}),
                              ("/v1/completions", {"prompt": "wait"})):
            holder = client.completions.create(model="tiny", prompt="hold", max_tokens=2000, temperature=0,
                                               stream=True)
            next(iter(holder))
            prefills = stats()["prefill_batches"]
            body = json.dumps(dict(payload, model="tiny", max_tokens=2, stream=True)).encode()
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                deadline = time.monotonic() + 60
                while parse_prometheus(httpx.get(srv.url + "/metrics").text).get(
                        "specjet_num_queued_not_started", 0) < 1:
                    assert time.monotonic() < deadline, "the streamed request never queued"
                    time.sleep(0.02)
            deadline = time.monotonic() + 60
            while parse_prometheus(httpx.get(srv.url + "/metrics").text).get("specjet_num_queued_not_started", 0):
                assert time.monotonic() < deadline, f"{path}: a client that left still holds its place in the queue"
                time.sleep(0.05)
            holder.close()
            while parse_prometheus(httpx.get(srv.url + "/metrics").text).get("specjet_num_running_reqs", 0):
                assert time.monotonic() < deadline, "the holder never ended"
                time.sleep(0.05)
            assert stats()["prefill_batches"] == prefills, f"{path}: the request of a client that left was started"
        assert httpx.get(srv.url + "/debug/kv", timeout=60).json()["ok"]
    finally:
        srv.stop()


def test_a_reply_the_kv_pool_cannot_hold_is_a_503_not_half_a_reply(tiny_model_dir):
    """A server whose KV pool is smaller than the context: a reply left to run to the context's end outgrows the
    pool after some tokens, and the engine ends it. Non-streamed, the answer is a 503 naming the pool (was a 200
    with finish_reason "abort" and half a reply); streamed, the chunks sent, then that error as an event, while a
    request beside it is served whole. The pool is whole after, and the server serves the next request."""
    srv = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "256"])
    try:
        client = srv.client()
        with pytest.raises(openai.InternalServerError) as e:
            chat(client, "hi", temperature=0, extra_body={"ignore_eos": True})
        assert e.value.status_code == 503 and error_of(e)["code"] == "kv_pool_exhausted"
        assert "KV pool exhausted" in error_of(e)["message"]
        lines = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 8:  # streaming: a short request beside it gets its whole reply
                    assert chat(client, "hi", max_tokens=3).choices[0].finish_reason == "length"
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "kv_pool_exhausted"
        chunks = [json.loads(e) for e in events[:-2]]
        assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 10  # it had replied for a while
        assert not any(c["choices"][0]["finish_reason"] for c in chunks)
        assert chat(client, "hi", max_tokens=3).choices[0].finish_reason == "length"
        kv_ok(srv)
    finally:
        srv.stop()
