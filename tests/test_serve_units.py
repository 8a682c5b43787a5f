"""specjet serve without a model: the CLI's engine flags, the tool grammar of tool_choice="auto",
reading tool calls back, API keys and a dead engine (a stand-in engine behind the real app)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Optional

import anyio
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from xgrammar.testing import _is_grammar_accept_string
import xgrammar as xgr

from specjet.scheduler.finish_reasons import (ENGINE_NOT_ALIVE, GRAMMAR_COMPILER_BUSY, GRAMMAR_REFUSED, INTERNAL_ERROR,
                                              INVALID_GRAMMAR, KV_POOL_EXHAUSTED, abort_reason)
from specjet.serve import chat
from specjet.serve.app import create_app
from specjet.serve.body_limit import BodyLimit
from specjet.serve.cli import build_parser, engine_kwargs
from specjet.serve.errors import ApiError
from specjet.serve.protocol import ChatCompletionRequest

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_cli_engine_flags_use_sglang_spellings():
    ns = build_parser().parse_args(["--model-path", "m", "--speculative-algorithm", "EAGLE",
                                    "--disable-overlap-schedule", "--speculative-num-steps", "3",
                                    "--mem-fraction-static", "0.2", "--no-enable-deterministic-inference"])
    assert engine_kwargs(ns) == {"model_path": "m", "speculative_algorithm": "EAGLE", "disable_overlap_schedule": True,
                                 "speculative_num_steps": 3, "mem_fraction_static": 0.2,
                                 "enable_deterministic_inference": False}
    ns = build_parser().parse_args([])
    assert (ns.host, ns.port, engine_kwargs(ns)) == ("127.0.0.1", 30000, {})
    # A bool flag whose default is None (the engine decides per device) turns both ways, and is absent unless given.
    for flag, value in (("--speculative-measured-payoff", True), ("--no-speculative-measured-payoff", False)):
        assert engine_kwargs(build_parser().parse_args([flag])) == {"speculative_measured_payoff": value}


def test_cli_says_none_and_checks_the_port():
    """An argument whose None means something (float weights, no grammar time limit) can be given as "none" (it
    could not be typed: "None" was taken for a method name); a path named "none" stays a path; a port outside
    [0, 65535] is refused before the engine loads (was uvicorn's OverflowError after it)."""
    ns = build_parser().parse_args(["--quantization", "none", "--grammar-token-timeout", "None",
                                    "--speculative-draft-model-quantization", "NONE", "--max-total-tokens", "none",
                                    "--speculative-draft-model-path", "none"])
    assert engine_kwargs(ns) == {"quantization": None, "grammar_token_timeout": None,
                                 "speculative_draft_model_quantization": None, "max_total_tokens": None,
                                 "speculative_draft_model_path": "none"}
    assert build_parser().parse_args(["--grammar-token-timeout", "0.5"]).grammar_token_timeout == 0.5
    from specjet.engine.args import EngineArgs

    EngineArgs.from_kwargs(**{k: v for k, v in engine_kwargs(ns).items()  # the Nones are what the engine takes
                              if not k.startswith("speculative")}, speculative_algorithm="DFLASH",
                           speculative_draft_model_quantization=None)
    assert build_parser().parse_args(["--port", "0"]).port == 0
    from specjet.serve.cli import main

    assert main(["--host", "no-such-host.invalid", "--model-path", "/nonexistent"]) == 2  # before any engine loads
    for port in ("70000", "-5", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--port", port])


def test_the_console_script_answers_help_with_success(monkeypatch, capsys):
    """``specjet --help`` is a question, not a mistake: the usage on stdout and exit 0; a bare or unknown command
    stays a usage error (2, on stderr)."""
    from specjet.serve.cli import console_main

    for argv, code in ((["--help"], 0), (["-h"], 0), ([], 2), (["server"], 2)):
        monkeypatch.setattr("sys.argv", ["specjet", *argv])
        assert console_main() == code, argv
        out, err = capsys.readouterr()
        assert "usage: specjet serve" in (out if code == 0 else err) and not (err if code == 0 else out), argv


def request(messages=None, **kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages or [{"role": "user", "content": "hi"}], **kwargs)


def test_auto_grammar_allows_text_or_a_valid_call():
    sp, plan = chat.chat_params(request(tools=[ADD], tool_choice="auto"))
    assert plan.mode == "tagged"
    grammar = xgr.Grammar.from_ebnf(sp["ebnf"])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert _is_grammar_accept_string(grammar, "Sure, let me add them. " + call)
    assert _is_grammar_accept_string(grammar, "no tool needed")
    assert not _is_grammar_accept_string(grammar, '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>')
    assert not _is_grammar_accept_string(grammar, '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    # the call's JSON is laid out as every specjet JSON schema output (one line, ", " and ": ")
    assert not _is_grammar_accept_string(grammar, '<tool_call>\n{ "name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_grammars_keep_latin1_letters_before_hex_digits(choice):
    """xgrammar prints "ñ" as \\xf1 and reads "\\xf1a" back as one character (specjet/grammar/ebnf_text.py): the
    EBNF the server splices from each tool's schema must still spell the enum as written."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"country": {"enum": ["España", "Größe"]}}, "required": ["country"]}}}
    sp, _ = chat.chat_params(request(tools=[tool], tool_choice=choice))
    grammar = xgr.Grammar.from_ebnf(sp["ebnf"])
    for country in ("España", "Größe"):
        call = '<tool_call>\n{"name": "f", "arguments": {"country": "%s"}}\n</tool_call>' % country
        assert _is_grammar_accept_string(grammar, call), country


def test_required_and_named_schemas():
    sp, plan = chat.chat_params(request(tools=[ADD], tool_choice="required"))  # parallel calls by default
    assert plan.mode == "tagged" and plan.parallel
    grammar = xgr.Grammar.from_ebnf(sp["ebnf"])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert _is_grammar_accept_string(grammar, call) and _is_grammar_accept_string(grammar, call + "\n" + call)
    for text in ("", "text " + call, call + " text", call.replace('"b": 2', '"b": "2"')):
        assert not _is_grammar_accept_string(grammar, text), text
    # One call: written in the same layout (the prompt's, and how the call is rendered in the next turn), one block.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    weather_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for choice, names in (("required", {"add", "get_weather"}), ({"type": "function", "function": {"name": "add"}},
                                                                   {"add"})):
        sp, plan = chat.chat_params(request(tools=[ADD, weather], tool_choice=choice, parallel_tool_calls=False))
        assert plan.mode == "tagged" and not plan.parallel and plan.names == names and set(sp) == {"ebnf"}
        grammar = xgr.Grammar.from_ebnf(sp["ebnf"])
        assert _is_grammar_accept_string(grammar, call)
        assert _is_grammar_accept_string(grammar, weather_call) == ("get_weather" in names), choice
        for text in (call + "\n" + call, '{"name": "add", "arguments": {"a": 1, "b": 2}}', "text " + call):
            assert not _is_grammar_accept_string(grammar, text), (choice, text)
    named = {"type": "function", "function": {"name": "add"}}
    sp, plan = chat.chat_params(request(tools=[ADD], tool_choice=named, parallel_tool_calls=True))
    assert not plan.parallel and not _is_grammar_accept_string(xgr.Grammar.from_ebnf(sp["ebnf"]), call + "\n" + call)


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_the_grammar_would_enforce_as_another_is_refused(choice):
    """As a json_schema is (grammar/compiler_holes.py): the tools' grammar is spliced from xgrammar's conversion, which
    would enforce a pattern matching a quote, or an integer const beyond 2**53, as something else."""
    for params in ({"type": "object", "properties": {"s": {"type": "string", "pattern": '^a"b$'}}},
                   {"type": "object", "properties": {"n": {"const": 9007199254740993}}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(ApiError) as refused:
            chat.chat_params(request(tools=[tool], tool_choice=choice))
        assert refused.value.param == "tools" and "tools[f].function.parameters" in str(refused.value), refused.value


def test_a_response_format_beside_tools_shapes_the_answer_and_leaves_the_calls():
    """OpenAI accepts response_format with tools (an agent's structured final answer, the Agents SDK's output_type);
    it was a 400. Under auto the reply is the format's JSON or calls, nothing else; where a call must be made the
    calls' constraint alone applies (the format shapes an answer, and the reply is a call)."""
    answer = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    for parallel in (True, False):
        sp, plan = chat.chat_params(request(tools=[ADD], response_format=fmt, parallel_tool_calls=parallel))
        assert plan.mode == "tagged" and set(sp) == {"ebnf"}
        grammar = xgr.Grammar.from_ebnf(sp["ebnf"])
        for text, ok in (('{"total": 3}', True), (call, True), (call + "\n" + call, parallel), ("free text", False),
                         ('{"total": "3"}', False), ('{"total": 3}' + call, False)):
            assert _is_grammar_accept_string(grammar, text) == ok, (parallel, text)
    sp, plan = chat.chat_params(request(tools=[ADD], response_format={"type": "json_object"}, tool_choice="required"))
    assert plan.mode == "tagged" and _is_grammar_accept_string(xgr.Grammar.from_ebnf(sp["ebnf"]), call)
    sp, _ = chat.chat_params(request(tools=[ADD], response_format=fmt, tool_choice="none"))
    assert sp["json_schema"] == answer


def test_reply_reads_calls_back():
    plan = chat.ToolPlan(mode="tagged", names={"add"})
    message, reason = chat.reply('Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                                 "stop", plan)
    assert reason == "tool_calls" and message.content == "Adding."
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    message, reason = chat.reply("just text", "stop", plan)
    assert reason == "stop" and message.content == "just text" and message.tool_calls is None
    plan = chat.ToolPlan(mode="json", names={"add"})
    message, reason = chat.reply('{"name": "add", "arguments": {"a": 3, "b": 4}}', "stop", plan)
    assert reason == "tool_calls" and message.tool_calls[0].function.arguments == '{"a": 3, "b": 4}'
    message, reason = chat.reply('{"name": "add", "argu', "length", plan)  # cut: text, not a call
    assert reason == "length" and message.tool_calls is None


def test_a_reply_without_parallel_calls_keeps_its_first_call_alone():
    """parallel_tool_calls=false (or a named function): a reply holding two complete calls answers with the first
    alone (the grammar allows one block; a reply read back never gives more); with parallel calls, both."""
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    message, reason = chat.reply(text, "stop", chat.ToolPlan(mode="tagged", names={"add"}, parallel=False))
    assert reason == "tool_calls" and [c.function.arguments for c in message.tool_calls] == ['{"a": 1, "b": 2}']
    message, reason = chat.reply(text, "stop", chat.ToolPlan(mode="tagged", names={"add"}))
    assert reason == "tool_calls" and [c.function.arguments for c in message.tool_calls] == [
        '{"a": 1, "b": 2}', '{"a": 3, "b": 4}']


def test_usage_counts_each_prompt_and_its_cached_tokens_once_and_every_completion():
    """OpenAI's usage of n choices a prompt (prompt-major): each prompt's tokens and its cached tokens once (its
    choices share one prompt), every choice's completion tokens."""
    from specjet.serve.app import _usage

    metas = [{"prompt_tokens": 10, "cached_tokens": 8, "completion_tokens": c} for c in (3, 4, 5)]
    metas += [{"prompt_tokens": 6, "cached_tokens": 0, "completion_tokens": c} for c in (1, 2, 7)]
    usage = _usage(metas, 3)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (16, 22, 38)
    assert usage.prompt_tokens_details.cached_tokens == 8


def test_logprob_alternatives_up_to_each_endpoints_limit_are_taken():
    """OpenAI's limits are inclusive: chat's top_logprobs 20 and the completions' logprobs 5 are taken, one more is a
    400 naming the parameter; alternatives without logprobs are refused."""
    from specjet.serve.logprobs import MAX_CHAT_TOP, MAX_COMPLETION_TOP, engine_params

    assert (MAX_CHAT_TOP, MAX_COMPLETION_TOP) == (20, 5)
    for limit, param in ((MAX_CHAT_TOP, "top_logprobs"), (MAX_COMPLETION_TOP, "logprobs")):
        for top in (0, 1, limit):
            assert engine_params(True, top, limit, param) == {"return_logprob": True, "top_logprobs_num": top}
        for bad in (-1, limit + 1):
            with pytest.raises(ApiError) as error:
                engine_params(True, bad, limit, param)
            assert (error.value.status, error.value.param) == (400, param)
    assert engine_params(True, None, 20, "top_logprobs") == {"return_logprob": True, "top_logprobs_num": 0}
    assert engine_params(False, None, 20, "top_logprobs") == {} and engine_params(False, 0, 20, "top_logprobs") == {}
    with pytest.raises(ApiError):
        engine_params(False, 2, 20, "top_logprobs")


# A chat template that reads tool calls itself (as Llama 3.1's, Qwen's and Hermes' do), in a layout a test can read.
CALLS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}"
                  "{% if m.name %} name={{ m.name }}{% endif %}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                  "[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\n"
                  "{% endfor %}{% if tools %}tools={{ tools | length }}{% endif %}")


@pytest.mark.parametrize("tool_choice, parallel, text, stop, expected", [
    # A ReAct/Hermes agent's stop at the closing tag: the call's JSON is whole, so it is a call (it was lost, and
    # its markup returned as content).
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n', "</tool_call>",
     ([("add", '{"a": 1}')], None, "tool_calls")),
    # A stop string inside the arguments cuts the call as the token limit does: the begun call as streamed.
    ({"type": "function", "function": {"name": "add"}}, False,
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": 2',
     "}", ([("add", '{"a": 1, "b": {"c": 2')], None, "stop")),
    ("auto", False, 'Let me see.<tool_call>\n{"name": "add", "arguments": {"a": ', "Paris",
     ([("add", '{"a":')], "Let me see.", "stop")),
])
def test_a_stop_string_that_cuts_a_call_never_returns_its_markup(tool_choice, parallel, text, stop, expected):
    """A caller's stop string ending a reply inside or at the end of a call: whole and streamed alike, the call (or
    as much of it as a stream sends) and never the markup as content (it was content, and the call dropped)."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": _CUT_TOOLS["add"]}}]
    body = {"messages": [{"role": "user", "content": "add"}], "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": parallel, "stop": [stop], "max_tokens": 40}
    meta = {"prompt_tokens": 3, "completion_tokens": 9}
    done = dict(meta, finish_reason={"type": "stop", "matched": stop})

    async def async_generate(stream=False, **kwargs):
        if stream:
            return _ScriptedStream([{"text": text[k:k + 4], "output_ids": [1], "meta_info": dict(
                meta, finish_reason=None) if k + 4 < len(text) else done} for k in range(0, len(text), 4)])
        return {"text": text, "output_ids": [1] * 9, "meta_info": done}

    calls, content, reason = expected
    with TestClient(create_app(_fake_engine(async_generate), "m")) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        streamed = client.post("/v1/chat/completions", json=dict(body, stream=True))
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"] or []]
    assert (got, whole["message"]["content"], whole["finish_reason"]) == expected, whole
    assert _assembled(streamed.text) == (content or "", calls, reason)


def test_a_template_that_reads_tool_calls_gets_them_whole(default_model_dir):
    """An agent loop's second turn: the earlier call and its result reach a template that reads tool calls as
    structured fields (they were flattened into this server's text and tool_call_id and name dropped, so such a
    model saw a layout it was not trained on); a template that does not read them (the default model's) still gets
    the calls written into the assistant's text."""
    from transformers import AutoTokenizer

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = ChatCompletionRequest(tools=[weather], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}])
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    flat = chat.chat_prompt(tokenizer, body)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in flat
    assert "call_1" not in flat
    tokenizer.chat_template = CALLS_TEMPLATE
    structured = chat.chat_prompt(tokenizer, body)
    assert '<assistant>[call call_1 get_weather {"city": "Paris"}]' in structured, structured
    assert "<tool id=call_1 name=get_weather>sunny" in structured and "tools=1" in structured
    assert "<tool_call>" not in structured


def test_the_next_turns_prompt_spells_the_reply_the_model_wrote(default_model_dir):
    """An agent loop sends each reply back in the next turn. The call's text the model wrote (tagged, its arguments
    as written: "1.50", "é") is the text the next prompt renders, so the prefix cache can hold the reply; a named
    call was written as bare JSON and rendered tagged, and the arguments were re-serialised ("1.5", "\\u00e9")."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    note = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "text": {"type": "string"}}, "required": ["amount", "text"]}}}
    written = '<tool_call>\n{"name": "note", "arguments": {"amount": 1.50, "text": "café"}}\n</tool_call>'
    for choice in ({"type": "function", "function": {"name": "note"}}, "required", "auto"):
        turn = [{"role": "user", "content": "Note a coffee."}]
        first = request(messages=turn, tools=[note], tool_choice=choice)
        sp, plan = chat.chat_params(first)
        assert _is_grammar_accept_string(xgr.Grammar.from_ebnf(sp["ebnf"]), written), choice
        message, reason = chat.reply(written, "stop", plan)
        assert reason == "tool_calls" and message.tool_calls[0].function.arguments == '{"amount": 1.50, "text": "café"}'
        sent_back = turn + [message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "noted"}]
        second = chat.chat_prompt(tokenizer, request(messages=sent_back, tools=[note], tool_choice=choice))
        assert second.startswith(chat.chat_prompt(tokenizer, first) + written), choice
    # Arguments that are not a JSON object's text are written as before (an object's JSON, re-serialised).
    odd = request(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "note", "arguments": "not json"}}]}])
    assert '{"name": "note", "arguments": "not json"}' in chat.chat_prompt(tokenizer, odd)


def stand_in_engine(alive: bool):
    return SimpleNamespace(is_alive=lambda: alive, scheduler=SimpleNamespace(closed_reason=None if alive else "boom"))


def test_dead_engine_is_503_and_api_key_is_checked():
    with TestClient(create_app(stand_in_engine(False), "m")) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_alive"
    with TestClient(create_app(stand_in_engine(True), "m", api_key="sekrit")) as client:
        assert client.get("/health").status_code == 200  # health needs no key
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
        assert client.get("/v1/models/m").status_code == 401
        r = client.get("/v1/models/m", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["id"] == "m"
        r = client.get("/v1/nowhere", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 404 and "error" in r.json()


def test_cors_lets_a_browser_call_the_server_and_keeps_the_key():
    """With allowed origins (the CLI's default, as SGLang's and vLLM's servers): a browser's preflight is answered
    (before any key is asked for), answers carry the origin header, and the API key still guards /v1. Without
    them no CORS header is sent. The CLI's flag: "*" by default, none when given without origins."""
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with TestClient(create_app(stand_in_engine(True), "m", api_key="sekrit", allowed_origins=["*"])) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = client.get("/v1/models", headers={"Origin": "http://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = client.get("/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with TestClient(create_app(stand_in_engine(True), "m", allowed_origins=["http://ok.example"])) as client:
        assert client.options("/health", headers=dict(preflight, Origin="http://evil.example")).status_code == 400
        r = client.get("/health", headers={"Origin": "http://ok.example"})
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
    with TestClient(create_app(stand_in_engine(True), "m")) as client:
        assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "http://a.b"}).headers
    assert build_parser().parse_args([]).allowed_origins == ["*"]
    assert build_parser().parse_args(["--allowed-origins"]).allowed_origins == []


HI = [{"role": "user", "content": "hi"}]
# An object nested 100 levels deep: deeper than the meta-schema check's recursion reached.
DEEP_SCHEMA = {"type": "integer"}
for _ in range(100):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}, "required": ["a"]}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}}, "response_format.type"),
    # Strict types: pydantic's lax default read each of these as a valid value.
    ("/v1/chat/completions", {"messages": HI, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4.5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "temperature": True}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "content": None}]}, "messages.1"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2.0]}, "stop_token_ids.0"),
    # Each of these was a 500 (bench/RESULTS.md, session 106).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": "get_weather"}]}]}, "messages.1.tool_calls"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": DEEP_SCHEMA}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "json_schema": DEEP_SCHEMA}, "json_schema"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5,
                                                                            "maximum": 1}}}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": HI, "tools": [], "tool_choice": "required"}, "tool_choice"),
    # Served as other seeds, wrapped modulo 2**64 before the engine's range check.
    ("/v1/chat/completions", {"messages": HI, "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
])
def test_malformed_bodies_are_400s(path, body, param):
    with TestClient(create_app(stand_in_engine(True), "m")) as client:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.json()


def test_an_integer_field_takes_a_whole_number_written_as_a_float():
    """JSON Schema's integer: 4.0 is the number 4 (a client that computed it as a float is not refused)."""
    from specjet.serve.protocol import ChatCompletionRequest, CompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": HI, "max_tokens": 4.0, "n": 2.0, "seed": 7.0})
    assert (req.max_tokens, req.n, req.seed) == (4, 2, 7) and all(type(v) is int for v in (req.max_tokens, req.n, req.seed))
    assert ChatCompletionRequest.model_validate({"messages": HI, "temperature": 1}).temperature == 1.0
    assert CompletionRequest.model_validate({"prompt": [1, 2], "logprobs": 2.0}).logprobs == 2


def test_a_real_engine_in_process_then_shut_down(tiny_model_dir):
    """The app over a real Engine (no subprocess): max_completion_tokens, stop, then 503 once the
    engine is shut down."""
    import specjet

    engine = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048)
    try:
        with TestClient(create_app(engine, "tiny")) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "ignore_eos": True,
                    "temperature": 0}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            r = client.post("/v1/chat/completions", json=dict(body, max_tokens=4))
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            engine.shutdown()
            assert client.get("/health").status_code == 503
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status_code == 503
    finally:
        engine.shutdown()


def test_auto_replies_stream_their_text_up_to_a_call():
    assert chat.streamable_end("Hello there") == len("Hello there")
    assert chat.streamable_end("Hello <tool") == len("Hello ")
    assert chat.streamable_end("Hello <") == len("Hello ")
    assert chat.streamable_end('Hi <tool_call>\n{"na') == len("Hi ")
    assert chat.streamable_end("a < b") == len("a < b")


def _fake_engine(async_generate):
    """What the app reads of an engine, with ``async_generate`` scripted by the test (the app's own logic under
    test: what it does with the chunks it is given)."""
    tokenizer = SimpleNamespace(chat_template="", apply_chat_template=lambda messages, **kw: "prompt")
    return SimpleNamespace(is_alive=lambda: True, scheduler=SimpleNamespace(closed_reason=None, config=SimpleNamespace(
        context_len=100)), tokenizer=tokenizer, async_generate=async_generate)


class _FailingStream:
    """An engine stream that yields one chunk, then fails."""

    def __init__(self):
        self.closed = False
        self.n = 0

    async def __anext__(self):
        self.n += 1
        if self.n == 1:
            return {"text": "Hel", "output_ids": [1], "meta_info": {"finish_reason": None, "prompt_tokens": 3,
                                                                    "completion_tokens": 1}}
        raise RuntimeError("boom")

    async def aclose(self):
        self.closed = True


def test_an_error_mid_stream_is_an_error_event_and_the_request_is_closed():
    stream = _FailingStream()

    async def async_generate(**kwargs):
        return stream

    engine = _fake_engine(async_generate)
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "internal_error"
        assert "Traceback" not in r.text and json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"
    assert stream.closed


@pytest.mark.parametrize("reason,status,code", [
    (abort_reason(INVALID_GRAMMAR, "json_schema could not be compiled: bad"), 400, "invalid_grammar"),
    (abort_reason(INTERNAL_ERROR, "internal error while detokenizing: KeyError()"), 500, None),
    (abort_reason(KV_POOL_EXHAUSTED, "KV pool exhausted: the request needs more"), 503, "kv_pool_exhausted"),
    (abort_reason(GRAMMAR_COMPILER_BUSY, "json_schema not compiled: 2 compiles that timed out are still running"),
     503, "grammar_compiler_busy"),
    # The status and kind come from the reason's fields, whatever its message says.
    (abort_reason(INVALID_GRAMMAR, "internal error: KV pool exhausted"), 400, "invalid_grammar"),
    ({"type": "abort", "message": "internal error, says a reason with no status"}, 400, "request_refused")])
def test_an_abort_before_any_token_is_answered_by_its_cause(reason, status, code):
    async def async_generate(**kwargs):
        return {"text": "", "output_ids": [], "meta_info": {
            "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": 0}}

    engine = _fake_engine(async_generate)
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status and r.json()["error"]["message"] == reason["message"]
        assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("err_type,message,status,code", [
    (KV_POOL_EXHAUSTED, "KV pool exhausted: the request needs more than the pool's 64 slots", 503, "kv_pool_exhausted"),
    (INTERNAL_ERROR, "internal error in the decode batch: RuntimeError('x')", 500, None),
    (GRAMMAR_REFUSED, "the grammar allows no token after the text so far (it matches no text from here)", 400,
     "request_refused"),
    (ENGINE_NOT_ALIVE, "the engine has been shut down", 503, "engine_not_alive")])
def test_an_abort_after_some_tokens_is_answered_by_its_cause(endpoint, err_type, message, status, code):
    """A request the engine ends after writing part of its reply: the cause, not a 200 whose finish reason is
    "abort" (no OpenAI reason) with half a reply; streamed, the chunks already sent, then the cause as an error
    event, with no finish reason sent."""
    def items():
        return [{"text": "Hel", "output_ids": [1], "meta_info": {"finish_reason": None, "prompt_tokens": 3,
                                                                "completion_tokens": 1}},
                {"text": "lo", "output_ids": [1, 2], "meta_info": {
                    "finish_reason": abort_reason(err_type, message), "prompt_tokens": 3, "completion_tokens": 2}}]
    streams = []

    async def async_generate(stream=False, **kwargs):
        if stream:
            streams.append(_ScriptedStream(items()))
            return streams[-1]
        return dict(items()[-1], text="Hello")

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    app = create_app(_fake_engine(async_generate), "m")
    metrics = app.state.metrics
    with TestClient(app) as client:
        r = client.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"] == message and r.json()["error"]["code"] == code
        counted = (dict(metrics.requests), metrics.prompt_tokens, metrics.completion_tokens)
        assert counted == ({"error": 1}, 3, 2)  # once, with the tokens the engine took and wrote for it
        r = client.post(path, json=dict(body, stream=True))
    assert r.status_code == 200 and streams[0].closed
    # Streamed, the same abort is counted the same way.
    assert (dict(metrics.requests), metrics.prompt_tokens, metrics.completion_tokens) == ({"error": 2}, 6, 4)
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == message
    choices = [c for e in events[:-2] for c in json.loads(e)["choices"]]
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices)
    assert text == "Hel" and not any(c["finish_reason"] for c in choices)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_aborted_after_another_ended_counts_its_prompt_once(endpoint, stream):
    """n=2: one choice ends, then the engine aborts the other; the metrics count the one prompt's tokens once
    (with the first choice to end), each choice's completion tokens, one request finished and one error."""
    def meta(reason, completion):
        return {"finish_reason": reason, "prompt_tokens": 3, "completion_tokens": completion}

    def items():
        return [{"index": 0, "text": "Hi", "output_ids": [1], "meta_info": meta({"type": "length", "length": 1}, 1)},
                {"index": 1, "text": "Ho", "output_ids": [1, 2], "meta_info": meta(
                    abort_reason(KV_POOL_EXHAUSTED, "KV pool exhausted: the request needs more"), 2)}]

    async def async_generate(stream=False, **kwargs):
        if stream:
            return _ScriptedStream(items())
        return [dict(item, index=None) for item in items()]

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    app = create_app(_fake_engine(async_generate), "m")
    with TestClient(app) as client:
        r = client.post(path, json=dict(body, n=2, max_tokens=5, stream=stream))
    if stream:
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and json.loads(events[-2])["error"]["code"] == "kv_pool_exhausted"
        counted = ({"length": 1, "error": 1}, 3, 3)
    else:  # the abort answers the whole request before any choice is counted as finished
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_pool_exhausted"
        counted = ({"error": 1}, 3, 2)
    metrics = app.state.metrics
    assert (dict(metrics.requests), metrics.prompt_tokens, metrics.completion_tokens) == counted


class _ProbedEngine:
    """What /health_generate reads of an engine: its step counter, liveness and ``async_generate``, which answers
    after ``answer_s`` (None: never; cancelled, it records the abort) while the counter moves ``steps_while_waiting``
    times (other requests' steps), or fails."""

    def __init__(self, answer_s=None, steps_while_waiting=0, fails=False, dies=False):
        self.scheduler = SimpleNamespace(stats={"batches_done": 5}, closed_reason=None)
        self.answer_s, self.steps, self.fails, self.dies = answer_s, steps_while_waiting, fails, dies
        self.alive, self.probes, self.cancelled = True, [], 0

    def is_alive(self):
        return self.alive

    async def async_generate(self, **kwargs):
        self.probes.append(kwargs)
        if self.fails:
            raise ValueError("the queue is full")
        try:
            for _ in range(self.steps):
                await anyio.sleep(0.01)
                self.scheduler.stats["batches_done"] += 1
            if self.dies:
                self.alive, self.scheduler.closed_reason = False, "RuntimeError('scheduler died')"
            await anyio.sleep(1e9 if self.answer_s is None else self.answer_s)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        return {"text": "x", "meta_info": {"finish_reason": {"type": "length", "length": 1}}}


@pytest.mark.parametrize("case,status", [("answers", 200), ("busy", 200), ("stuck", 503), ("refused_and_stuck", 503),
                                         ("refused_but_busy", 200), ("dies", 503), ("two_batches_then_stuck", 503)])
def test_health_generate(case, status):
    """/health_generate: 200 when its one-token probe is answered or the compute side hands back three batches
    meanwhile (a busy engine; the probe is then aborted), 503 when neither happens in its time or the engine stops
    (with its cause); two batches are not enough (the overlap loop may have computed both before the probe)."""
    engine = {"answers": _ProbedEngine(answer_s=0.01), "busy": _ProbedEngine(steps_while_waiting=3),
              "stuck": _ProbedEngine(), "refused_and_stuck": _ProbedEngine(fails=True),
              "refused_but_busy": _ProbedEngine(fails=True), "dies": _ProbedEngine(dies=True),
              "two_batches_then_stuck": _ProbedEngine(steps_while_waiting=2)}[case]
    if case == "refused_but_busy":
        async def steps_elsewhere(**kwargs):  # the door refuses the probe while other requests' steps go on
            engine.scheduler.stats["batches_done"] += 3
            raise ValueError("the queue is full")
        engine.async_generate = steps_elsewhere
    app = create_app(engine, "m", health_generate_timeout_s=0.5)
    with TestClient(app) as client:
        start = time.monotonic()
        r = client.get("/health_generate")
        took = time.monotonic() - start
    assert r.status_code == status, r.text
    assert took < 10  # bounded by the timeout, never a hang
    if case not in ("refused_but_busy",):
        assert engine.probes == [{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}]
    if case == "busy":
        assert engine.cancelled == 1  # the probe was aborted once the steps showed the engine computes
    if case == "dies":
        assert "scheduler died" in r.json()["error"]["message"]
    elif status == 503:
        assert r.json()["error"]["code"] == "engine_not_responding"


_CUT_TOOLS = {"add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object"}}}}


@pytest.mark.parametrize("tool_choice,parallel,text,expected", [
    # required/named without parallel calls: one <tool_call> block. Cut before the name is whole: no call, content ""
    # (never neither: a client sends the message back, and one with neither is refused).
    ("required", False, '<tool_call>\n{"name": "ad', ([], "")),
    # ... after it: the begun call, its arguments so far (less a brace that may be the call's own), as streamed.
    ("required", False, '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": {"c": 1}',
     ([("add", '{"a": 12, "b": {"c": 1')], None)),
    ({"type": "function", "function": {"name": "add"}}, False, '<tool_call>\n{"name": "add", "arguments": {"a',
     ([("add", '{"a')], None)),
    # required with parallel calls: <tool_call> blocks only. A block cut before its first call is complete.
    ("required", True, '<tool_call>\n{"name": "add", "argu', ([], "")),
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_ca',
     ([("add", '{"a": 1}')], None)),
    # auto: the prose before a cut call is the content; a parallel call goes out only whole.
    ("auto", True, 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1', ([], "Let me add.\n")),
    # auto without parallel calls: the begun call streams, so it is returned.
    ("auto", False, 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1', ([("add", '{"a": 1')], "Sure.")),
])
def test_a_reply_cut_by_the_token_limit_returns_what_its_stream_sent(tool_choice, parallel, text, expected):
    """finish_reason "length" with tools: the non-streamed reply holds exactly what the streamed one sent (calls
    by name and arguments, content), and tool markup is never content (it was, whole, for a cut first call)."""
    tools = [{"type": "function", "function": {"name": name, "parameters": params}}
             for name, params in _CUT_TOOLS.items()]
    body = {"messages": [{"role": "user", "content": "add"}], "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": parallel, "max_tokens": 9}
    pieces = [text[:k] for k in range(0, len(text), 5)][1:] + [text]
    meta = {"prompt_tokens": 3, "completion_tokens": 9}

    def chunks():
        return [{"text": b[len(a):], "output_ids": [1], "meta_info": dict(meta, finish_reason=None)}
                for a, b in zip([""] + pieces, pieces[:-1])] + [
            {"text": text[len(pieces[-2]):], "output_ids": [1], "meta_info": dict(meta, finish_reason={
                "type": "length", "length": 9})}]

    async def async_generate(stream=False, **kwargs):
        if stream:
            return _ScriptedStream(chunks())
        return {"text": text, "output_ids": [1] * 9, "meta_info": dict(meta, finish_reason={"type": "length",
                                                                                          "length": 9})}

    with TestClient(create_app(_fake_engine(async_generate), "m")) as client:
        whole = client.post("/v1/chat/completions", json=body)
        streamed = client.post("/v1/chat/completions", json=dict(body, stream=True))
    assert whole.status_code == 200 and streamed.status_code == 200, (whole.text, streamed.text)
    choice = whole.json()["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"] or []]
    assert choice["finish_reason"] == "length" and (calls, choice["message"]["content"]) == expected
    assert _assembled(streamed.text) == (expected[1] or "", calls, "length")


def _assembled(sse: str) -> tuple[str, list[tuple[str, str]], Optional[str]]:
    """A streamed chat reply's content, (name, arguments) calls and finish reason, as a client adds them up."""
    content, names, arguments, finish = "", [], {}, None
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[len("data: "):])["choices"]:
                content += c["delta"].get("content") or ""
                for t in c["delta"].get("tool_calls") or []:
                    names += [t["function"]["name"]] if t["function"].get("name") else []
                    arguments[t["index"]] = arguments.get(t["index"], "") + t["function"].get("arguments", "")
                finish = c["finish_reason"] or finish
    return content, list(zip(names, arguments.values())), finish


@pytest.mark.parametrize("text, content", [
    ('\n <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n', None),
    ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "Sure.\n"),
])
def test_blank_text_beside_calls_is_no_content_streamed_or_not(text, content):
    """Whitespace before a call under tool_choice auto: the whole reply's content is null, and the stream sent it as
    content (a client adding up the stream got "\\n "); prose before a call stays content in both."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": _CUT_TOOLS["add"]}}]
    body = {"messages": [{"role": "user", "content": "add"}], "tools": tools, "max_tokens": 40}
    meta = {"prompt_tokens": 3, "completion_tokens": 9}
    done = dict(meta, finish_reason={"type": "stop", "matched": 0})

    async def async_generate(stream=False, **kwargs):
        if stream:
            return _ScriptedStream([{"text": text[k:k + 3], "output_ids": [1], "meta_info": dict(
                meta, finish_reason=None) if k + 3 < len(text) else done} for k in range(0, len(text), 3)])
        return {"text": text, "output_ids": [1] * 9, "meta_info": done}

    with TestClient(create_app(_fake_engine(async_generate), "m")) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        streamed = client.post("/v1/chat/completions", json=dict(body, stream=True))
    assert whole["message"]["content"] == content and whole["finish_reason"] == "tool_calls"
    assert _assembled(streamed.text) == (content or "", [("add", '{"a": 1}')], "tool_calls")


@pytest.mark.parametrize("mode,text", [
    ("tagged", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": "x} <y"}}}\n</tool_call>'
               '\n<tool_call>\n{ "name" : "add" ,"arguments":{"a": 2}  }\n</tool_call>'),
    ("json", '{"name": "add", "arguments": {"a": 12, "b": [1, {"z": "}"}]}}'),
    # An argument holding the closing tag itself (was read as the block's end: no call, the markup as content).
    ("tagged", '<tool_call>\n{"name": "add", "arguments": {"a": "</tool_call>", "b": "<tool_call>x"}}\n</tool_call>'
               'and then<tool_call>\n{"name": "add", "arguments": {"a": "\\"</tool_call>"}}\n</tool_call>'),
])
def test_streamed_call_pieces_add_up_to_the_whole_calls(mode, text):
    plan = chat.ToolPlan(mode=mode, names={"add"})
    streamer = chat.CallStreamer(plan)
    pieces: dict[int, dict] = {}
    for end in range(1, len(text) + 1):  # one character at a time
        for d in streamer.feed(text[:end], finished=mode == "json" and end == len(text)):
            call = pieces.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
    message, reason = chat.reply(text, "stop", plan)
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in pieces.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    for c in message.tool_calls:
        json.loads(c.function.arguments)
    if "and then" in text:
        assert [json.loads(c.function.arguments)["a"] for c in message.tool_calls] == ["</tool_call>", '"</tool_call>']
        assert message.content == "and then"
        assert chat.repeat_cut(text + "\n" + text[:text.index("and then")]) == len(text) + 1


def test_a_call_cut_short_by_the_token_limit_is_not_content():
    plan = chat.ToolPlan(mode="tagged", names={"add"})
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    for cut in ("\n<tool", "\n<tool_call>\n{\"", "\n" + call[:-3]):
        message, reason = chat.reply("Sure." + call + cut, "length", plan)
        assert reason == "length" and len(message.tool_calls) == 1 and message.content.strip() == "Sure.", cut
    message, _ = chat.reply("Sure." + call[:30], "length", plan)  # no call complete: the prose, not the markup
    assert message.tool_calls is None and message.content == "Sure."
    # A reply that ended by itself keeps its text after the calls, a "<tool_call>" written as prose included.
    tail = "\nDone: I wrapped it in <tool_call> tags, as in a <"
    message, reason = chat.reply(call + tail, "stop", plan)
    assert reason == "tool_calls" and len(message.tool_calls) == 1 and message.content == tail
    # JSON and then something else: the block runs to the next closing tag after the JSON, not one inside it.
    odd = '<tool_call>\n{"name": "add", "arguments": {"a": "</tool_call>"}} x\n</tool_call>' + call
    assert [b.body for b in chat.call_blocks(odd)] == ['{"name": "add", "arguments": {"a": "</tool_call>"}} x',
                                                      call[len("<tool_call>\n"):-len("\n</tool_call>")]]


def test_a_reply_ends_before_a_repeated_call():
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    two = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert chat.repeat_cut(one + "\n" + two) is None
    text = one + "\n" + two + "\n" + one + "\n" + two
    cut = chat.repeat_cut(text)
    assert text[:cut] == one + "\n" + two + "\n"
    message, reason = chat.reply(text[:cut], "stop", chat.ToolPlan(mode="tagged", names={"add"}))
    assert reason == "tool_calls" and len(message.tool_calls) == 2 and message.content is None
    message, reason = chat.reply(one + "\n<tool_call>\n{", "length", chat.ToolPlan(mode="tagged", names={"add"}))
    assert reason == "length" and len(message.tool_calls) == 1


class _ScriptedStream:
    """An engine stream of two choices' chunks (each with its ``index``), recording per-choice aborts."""

    def __init__(self, items):
        self.items, self.aborted, self.closed = list(items), [], False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def abort(self, index):
        self.aborted.append(index)

    async def aclose(self):
        self.closed = True


@pytest.mark.parametrize("stream", [False, True])
def test_one_choice_ends_at_its_repeated_call_and_the_others_go_on(stream):
    """n=2, tool_choice auto with parallel calls: choice 0 starts a call it already made, so it ends before it
    (its request alone aborted, its later chunks dropped); choice 1's reply is whole."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'

    def item(index, text, reason=None, tokens=1):
        return {"index": index, "text": text, "output_ids": [1] * tokens, "meta_info": {
            "finish_reason": reason, "prompt_tokens": 5, "completion_tokens": tokens}}

    scripted = _ScriptedStream([item(0, call), item(1, "Sure"), item(0, call, tokens=2), item(1, " thing.", tokens=2),
                                item(0, "dropped", {"type": "abort"}, tokens=3),
                                item(1, "", {"type": "stop"}, tokens=3)])
    calls = []

    async def async_generate(**kwargs):
        calls.append(kwargs)
        return scripted

    engine = _fake_engine(async_generate)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    body = {"messages": [{"role": "user", "content": "add"}], "tools": [tool], "n": 2, "seed": 5, "stream": stream}
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert [sp["seed"] for sp in calls[0]["sampling_params"]] == [5, 6] and calls[0]["prompt"] == ["prompt"] * 2
    assert scripted.aborted == [0] and scripted.closed
    if stream:
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        content, finish, names = {0: "", 1: ""}, {}, {0: [], 1: []}
        for event in events:
            for choice in event["choices"]:
                content[choice["index"]] += choice["delta"].get("content") or ""
                names[choice["index"]] += [t["function"]["name"] for t in choice["delta"].get("tool_calls") or []
                                           if t["function"].get("name")]
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
        assert finish == {0: "tool_calls", 1: "stop"}
        assert names[0] == ["add"] and content[1] == "Sure thing." and "dropped" not in r.text
    else:
        choices = r.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["tool_calls", "stop"]
        assert len(choices[0]["message"]["tool_calls"]) == 1 and choices[1]["message"]["content"] == "Sure thing."
        assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 2 + 3, "total_tokens": 10,
                                         "prompt_tokens_details": {"cached_tokens": 0},
                                         "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                                                       "rejected_prediction_tokens": 0}}


def test_a_refused_choice_answers_a_streamed_request_and_closes_the_others():
    """n=2, streamed: the first chunk is one choice refused before any token (a KV pool too small for it): the
    answer is that refusal, and the stream is closed, which aborts the other choice."""
    scripted = _ScriptedStream([{"index": 1, "text": "", "output_ids": [], "meta_info": {
        "finish_reason": abort_reason(KV_POOL_EXHAUSTED, "KV pool exhausted: the request needs more"),
        "prompt_tokens": 5, "completion_tokens": 0}}])

    async def async_generate(**kwargs):
        return scripted

    engine = _fake_engine(async_generate)
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                      "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_pool_exhausted"
    assert scripted.closed


def test_prediction_details_count_the_predictions_tokens_found_in_order():
    """Accepted: the prediction's tokens that appear in the completion, in order; rejected: the rest; summed over
    the choices. A whitespace tokenizer makes the counts checkable by hand."""
    from specjet.serve.prediction_usage import prediction_details

    def words(text, add_special_tokens=False):
        return {"input_ids": [hash(w) for w in text.split()]}

    details = prediction_details(words, "a b c d e", ["a b x d e", "e d c b a", "a b c d e f"])
    # "a b x d e": a b d e (4); "e d c b a": one token in order (1); "a b c d e f": all five
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (4 + 1 + 5, 1 + 4 + 0)


def test_a_body_over_the_limit_is_refused_413_before_the_app_reads_it():
    """FastAPI parses a JSON body whole before any handler runs, so a body of hundreds of megabytes could have the
    host kill the server. BodyLimit answers 413 (OpenAI's error shape) for a body over its limit, declared by
    Content-Length or sent in chunks, and hands any other body on whole."""
    inner = FastAPI()
    reads = []

    @inner.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        reads.append(len(body))
        return {"bytes": len(body), "head": body[:3].decode()}

    with TestClient(BodyLimit(inner, max_bytes=1000)) as client:
        assert client.post("/echo", content=b"abc" + b"x" * 997).json() == {"bytes": 1000, "head": "abc"}
        chunked = client.post("/echo", content=iter([b"abc", b"x" * 500, b"y" * 497]))
        assert chunked.json() == {"bytes": 1000, "head": "abc"}
        for content in (b"x" * 1001, iter([b"x" * 600, b"y" * 600])):
            refused = client.post("/echo", content=content)
            assert refused.status_code == 413
            error = refused.json()["error"]
            assert error["code"] == "request_too_large" and "max_request_bytes" in error["message"]
    assert reads == [1000, 1000]  # the refused bodies never reached the app
    with pytest.raises(ValueError, match="max_request_bytes"):
        BodyLimit(inner, max_bytes=0)

    # A chunked body that also declares a small Content-Length: uvicorn's parser reads the chunks, so the declared
    # length is no bound; its bytes are counted (a 50 MB body got through a 10,000-byte limit and was served).
    async def lying_client():
        chunks = [{"type": "http.request", "body": b"x" * 600, "more_body": True}] * 3 + [
            {"type": "http.request", "body": b"", "more_body": False}]
        sent, reached = [], []

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            reached.append(scope)

        scope = {"type": "http", "method": "POST", "path": "/echo",
                 "headers": [(b"content-length", b"1"), (b"transfer-encoding", b"chunked")]}
        await BodyLimit(app, max_bytes=1000)(scope, receive, send)
        return sent, reached

    sent, reached = anyio.run(lying_client)
    assert sent[0]["status"] == 413 and not reached
    assert build_parser().parse_args([]).max_request_bytes == 32 << 20


def _native_items():
    """An engine stream of two requests' increments: request 1 ends with an abort after its first token."""
    def meta(reason=None, completion=1, logprobs=()):
        return {"finish_reason": reason, "prompt_tokens": 3, "completion_tokens": completion,
                "output_token_logprobs": list(logprobs)}
    return [{"index": 0, "text": "He", "output_ids": [5], "meta_info": meta(logprobs=[(-0.5, 5, None)])},
            {"index": 1, "text": "Bo", "output_ids": [7], "meta_info": meta(logprobs=[(-0.1, 7, None)])},
            {"index": 0, "text": "llo", "output_ids": [6], "meta_info": meta({"type": "length", "length": 2}, 2,
                                                                             [(-0.25, 6, None)])},
            {"index": 1, "text": "", "output_ids": [], "meta_info": meta(
                abort_reason(KV_POOL_EXHAUSTED, "KV pool exhausted: the request needs more"), 1)}]


@pytest.mark.parametrize("incremental", [False, True])
def test_native_generate_streams_whole_outputs_or_increments(incremental):
    """SGLang's /generate: by default each event is a request's output so far (text, ids and token logprobs whole),
    with --incremental-streaming-output the engine's increments as they are; an abort is the request's
    finish_reason, counted in the metrics as an error with its tokens."""
    streams = []

    async def async_generate(stream=False, **kwargs):
        streams.append(_ScriptedStream(_native_items()))
        return streams[-1]

    app = create_app(_fake_engine(async_generate), "m", incremental_streaming_output=incremental)
    with TestClient(app) as client:
        r = client.post("/generate", json={"text": ["a", "b"], "stream": True})
    assert r.status_code == 200 and streams[0].closed
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    got = [json.loads(line) for line in lines[:-1]]
    sent = [json.loads(json.dumps(item)) for item in _native_items()]
    if incremental:
        assert got == sent
    else:
        assert [(e["index"], e["text"], e["output_ids"]) for e in got] == [
            (0, "He", [5]), (1, "Bo", [7]), (0, "Hello", [5, 6]), (1, "Bo", [7])]
        assert got[2]["meta_info"]["output_token_logprobs"] == [[-0.5, 5, None], [-0.25, 6, None]]
        assert got[2]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert got[3]["meta_info"]["finish_reason"]["err_type"] == "kv_pool_exhausted"
    metrics = app.state.metrics
    assert (dict(metrics.requests), metrics.prompt_tokens, metrics.completion_tokens) == (
        {"length": 1, "error": 1}, 6, 3)


def test_native_generate_answers_a_lone_abort_with_its_status_and_a_list_with_its_finish_reasons():
    aborted = {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": abort_reason(GRAMMAR_COMPILER_BUSY, "regex not compiled: try again later"),
        "prompt_tokens": 3, "completion_tokens": 0}}
    served = {"text": "ok", "output_ids": [1], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 1}}

    async def async_generate(prompt=None, **kwargs):
        return [served, aborted] if isinstance(prompt, list) else aborted

    app = create_app(_fake_engine(async_generate), "m")
    with TestClient(app) as client:
        r = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "(yes|no)"}})
        assert r.status_code == 503 and r.json()["error"]["code"] == "grammar_compiler_busy"
        r = client.post("/generate", json={"text": ["a", "b"]})
        assert r.status_code == 200 and r.json() == [served, aborted]
        info = client.get("/get_model_info").json()  # an engine without a model path runs the embedded model
        assert info["model_path"].endswith(".gguf") and info["is_generation"] is True
    assert dict(app.state.metrics.requests) == {"error": 2, "stop": 1}


def test_native_generate_passes_a_null_max_new_tokens_to_the_engine():
    """SGLang reads max_new_tokens null as "as many as the context leaves", as the engine reads None (its door
    makes it that number: test_engine): the null reaches the engine, for one prompt and for each of a list's."""
    seen = []

    async def async_generate(stream=False, **kwargs):
        seen.append(kwargs["sampling_params"])
        return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0},
                                                            "prompt_tokens": 1, "completion_tokens": 0}}

    app = create_app(_fake_engine(async_generate), "m")
    with TestClient(app) as client:
        assert client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": None}}).status_code == 200
        client.post("/generate", json={"text": ["a", "b"], "sampling_params": [{"max_new_tokens": None},
                                                                              {"max_new_tokens": 3}]})
        client.post("/generate", json={"text": "a", "sampling_params": {"temperature": 0}})
    assert seen == [{"max_new_tokens": None}, [{"max_new_tokens": None}, {"max_new_tokens": 3}], {"temperature": 0}]


def test_the_served_model_name_is_the_model_paths_last_part_as_it_resolves(tmp_path, monkeypatch):
    """``specjet serve --model-path .`` answered as model "." (the path's text, not the folder it names)."""
    from specjet.serve.cli import served_model_name

    model = tmp_path / "my-llama"
    model.mkdir()
    monkeypatch.chdir(model)
    assert served_model_name(None, ".") == "my-llama"
    assert served_model_name(None, str(model) + "/") == "my-llama"
    assert served_model_name(None, str(tmp_path / "tiny.Q4_1.gguf")) == "tiny.Q4_1.gguf"
    assert served_model_name("mine", ".") == "mine" and served_model_name(None, None) == "SmolLM2-135M-Instruct"
