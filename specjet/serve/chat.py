"""OpenAI request fields -> specjet sampling parameters, chat messages -> a prompt, and the model's
text -> a reply (content or tool calls).

Tool calls use the Hermes layout most open chat models are trained on: the model writes
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. How each ``tool_choice`` is
enforced by decoding:

- ``required``: one or more ``<tool_call>`` blocks and nothing else (``_calls_grammar``); one block with
  ``parallel_tool_calls=false`` or a named function (whose block's JSON can only name it). The calls are
  written in the layout the prompt asks for and an earlier turn's calls are rendered in, so the next turn's
  prompt repeats the reply's text and the prefix cache holds it. Where the tools' schemas cannot be spliced
  into one grammar, a JSON schema of the calls allowed (one bare JSON call) is the fallback.
- ``auto``: xgrammar's structural tag (free text until the model writes ``<tool_call>``, then the
  call's schema and ``</tool_call>``, then free text again), handed to the engine as EBNF.
- ``none``: no tools in the prompt, no constraint.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from specjet.engine.choices import MAX_CHOICES
from specjet.grammar.compiler_holes import schema_hole
from specjet.serve import logprobs
from specjet.serve.errors import bad_request
from specjet.serve.protocol import (COMPLETION_MAX_TOKENS, AssistantMessage, ChatCompletionRequest, CompletionRequest,
                                    FunctionCall, ToolCall, _SamplingFields)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolPlan:
    """How a chat request's reply is read back: ``mode`` None (plain text), "tagged" (<tool_call> blocks: required,
    named, and auto's text with them) or "json" (one bare JSON call: required / named where the tools' schemas could
    not be spliced into one grammar)."""
    mode: Optional[str] = None
    parallel: bool = True
    names: set[str] = field(default_factory=set)


# ---------------------------------------------------------------- parameters
def _check_schema(schema: Any, param: str) -> None:
    """400 naming the problem for a schema that is not a valid JSON schema (jsonschema's meta-schema)."""
    import jsonschema
    from jsonschema.validators import validator_for

    from specjet.grammar.spec import GrammarError, check_schema_depth

    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"invalid JSON schema in {param}: expected an object, got {type(schema).__name__}", param)
    try:  # before the meta-schema check, which recurses once per level and would run out of stack
        check_schema_depth(schema)
    except GrammarError as error:
        raise bad_request(f"invalid JSON schema in {param}: {error}", param) from None
    try:
        validator_for(schema).check_schema(schema)
    except RecursionError:  # nested within the limit, yet deeper than jsonschema's recursion reaches
        raise bad_request(f"invalid JSON schema in {param}: nested too deeply to check", param) from None
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise bad_request(f"invalid JSON schema in {param} at {where}: {error.message}", param) from None


def choice_count(req: _SamplingFields) -> int:
    """The request's ``n`` (1 when not given); 400 outside [1, MAX_CHOICES]."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    return n


def sampling_params(req: _SamplingFields, max_tokens: Optional[int]) -> dict[str, Any]:
    """The sampling-parameter dict for the engine; 400 for what specjet does not support."""
    sp: dict[str, Any] = {}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "ignore_eos", "stop_token_ids", "no_stop_trim",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"):
        value = getattr(req, name)
        if value is not None:
            sp[name] = value
    if req.min_tokens is not None:
        sp["min_new_tokens"] = req.min_tokens
    if req.stop is not None:
        sp["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    extras = [name for name in ("json_schema", "regex", "ebnf") if getattr(req, name) is not None]
    if len(extras) > 1:
        raise bad_request(f"give at most one of json_schema, regex, ebnf (got {', '.join(extras)})", extras[1])
    if extras:
        name = extras[0]
        value = getattr(req, name)
        if name == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise bad_request(f"invalid JSON schema in json_schema: not JSON: {error}", name) from None
            _check_schema(value, name)
        sp[name] = value
    return sp


def completion_params(req: CompletionRequest) -> dict[str, Any]:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
    if req.best_of not in (None, 1):
        raise bad_request("best_of > 1 is not supported", "best_of", "unsupported_parameter")
    sp = sampling_params(req, req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS)
    sp.update(logprobs.engine_params(req.logprobs is not None, req.logprobs, logprobs.MAX_COMPLETION_TOP, "logprobs"))
    if req.echo and sp.get("return_logprob"):  # the echoed prompt's tokens get theirs too
        sp["logprob_start_len"] = 0
    return sp


def chat_params(req: ChatCompletionRequest) -> tuple[dict[str, Any], ToolPlan]:
    """Sampling parameters and the tool plan of a chat request (one constraint at most)."""
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("give max_tokens or max_completion_tokens, not two different values", "max_tokens")
    sp = sampling_params(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
    sp.update(logprobs.engine_params(bool(req.logprobs), req.top_logprobs, logprobs.MAX_CHAT_TOP, "top_logprobs"))
    if req.prediction is not None and req.prediction.text:
        sp["prediction"] = req.prediction.text
    plan = ToolPlan(parallel=req.parallel_tool_calls is not False)
    constraint: Optional[tuple[str, Any, str]] = None  # (kind, spec, the field it came from)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        constraint = ("json_schema", {"type": "object"}, "response_format")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema field", "response_format")
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        _check_schema(schema, "response_format.json_schema.schema")
        constraint = ("json_schema", schema, "response_format")
    tool_constraint = _tool_constraint(req, plan)
    if tool_constraint is not None and constraint is not None and req.tool_choice in (None, "auto"):
        # An agent's final answer in a format, or its calls (OpenAI's Agents SDK output_type beside tools): the
        # reply is the format's JSON or calls. Where a call must be made the reply is one, which the format does
        # not govern (it shapes the answer), so the calls' constraint alone applies.
        tool_constraint = ("ebnf", _answer_or_calls_grammar(constraint[1], _call_schemas(req), plan.parallel),
                           "tool_choice")
    if tool_constraint is not None:
        constraint = tool_constraint
    if constraint is not None:
        if any(k in sp for k in ("json_schema", "regex", "ebnf")):
            raise bad_request(f"{constraint[2]} cannot be combined with json_schema, regex or ebnf", constraint[2])
        kind, spec, _ = constraint
        sp[kind] = spec
    return sp, plan


def _tools_in_use(req: ChatCompletionRequest) -> list:
    if not req.tools or req.tool_choice == "none":
        return []
    return req.tools


def _call_schemas(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [_call_schema(t.function) for t in req.tools]


def _call_schema(function) -> dict[str, Any]:
    """The JSON of one call of ``function``: its name and its parameters' schema as the arguments. The parameters'
    local references ("#", "#/$defs/...") are made to point where the parameters now sit: inside the call's schema
    they would name its root (a nested pydantic model's tool was refused for a $defs it could not find)."""
    params = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    _check_schema(params, f"tools[{function.name}].function.parameters")
    # Refused as a json_schema is (grammar/compiler_holes.py): the tools' EBNF is spliced from xgrammar's own
    # conversion, which would enforce such a schema as another.
    hole = schema_hole(params)
    if hole is not None:
        raise bad_request(f"tools[{function.name}].function.parameters: {hole}", "tools")
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             "arguments": _rebased_refs(params, "#/properties/arguments")},
            "required": ["name", "arguments"]}


def _rebased_refs(schema: Any, base: str) -> Any:
    """``schema`` with every JSON-pointer ``$ref`` into itself ("#" or "#/...") rebased on ``base``; anchors
    ("#name") and other documents' references are left as they are. A new structure; ``schema`` is not changed."""
    if isinstance(schema, list):
        return [_rebased_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        else:
            out[key] = _rebased_refs(value, base)
    return out


def _tool_constraint(req: ChatCompletionRequest, plan: ToolPlan) -> Optional[tuple[str, Any, str]]:
    choice = req.tool_choice
    if req.tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if choice == "none":
        return None
    if not names:  # no tool to call: "auto" is plain text, a call that must be made cannot be
        if choice in (None, "auto"):
            return None
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'!r} needs at "
                          "least one tool", "tool_choice")
    if choice is None:
        choice = "auto"
    if not isinstance(choice, str):  # a named function
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                              f"({', '.join(names)})", "tool_choice")
        tool = next(t for t in req.tools if t.function.name == choice.function.name)
        plan.names, plan.parallel = {choice.function.name}, False
        return _required_calls(plan, [_call_schema(tool.function)])
    plan.names = set(names)
    schemas = _call_schemas(req)
    if choice == "required":
        return _required_calls(plan, schemas)
    plan.mode = "tagged"  # auto
    return ("ebnf", _auto_grammar(schemas), "tool_choice")


# A token of xgrammar's EBNF: a string, a character class, a name, or any other character.
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.DOTALL)
_CALL_BODY = "tool_call_body"


def _schema_rules(schema: dict[str, Any], prefix: str) -> str:
    """The EBNF rules of one JSON schema, laid out as specjet lays out every JSON schema (compact,
    strict: ``JSON_SCHEMA_OPTIONS``), each rule name prefixed so several schemas share a grammar."""
    import xgrammar as xgr

    from specjet.grammar.backend import JSON_SCHEMA_OPTIONS
    from specjet.grammar.ebnf_text import ebnf_text
    from specjet.grammar.schema_rewrite import reachable_required

    # As the engine's json_schema path does (spec.py): a required name that properties does not list gets a rule,
    # where strict mode would leave the name unwritable and no call could satisfy the schema.
    schema = reachable_required(schema)
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **JSON_SCHEMA_OPTIONS)
    except RuntimeError:  # what strict mode cannot express (the backend falls back the same way)
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **dict(JSON_SCHEMA_OPTIONS, strict_mode=False))
    text = ebnf_text(grammar)
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", text, re.MULTILINE))
    return "".join(prefix + t if t in names else t for t in _EBNF_TOKEN.findall(text))


def _call_rules(schemas: list[dict[str, Any]]) -> str:
    """Rules for the calls' JSON, and ``tool_call_body``: what follows <tool_call> up to </tool_call>."""
    rules = [_schema_rules(schema, f"tool{i}_") for i, schema in enumerate(schemas)]
    close = TOOL_CLOSE.replace('"', '\\"')
    alternatives = " | ".join(f'("\\n" tool{i}_root "\\n{close}")' for i in range(len(schemas)))
    return "\n".join(rules + [f"{_CALL_BODY} ::= ({alternatives})"])


def _auto_grammar(schemas: list[dict[str, Any]]) -> str:
    """EBNF for "free text, or tool calls whose JSON matches one of ``schemas``" (xgrammar's
    structural-tag dispatch: a call's grammar starts when the model writes <tool_call>)."""
    try:
        return "\n".join([_call_rules(schemas),
                          f'tool_dispatch ::= TagDispatch(("{TOOL_OPEN}", {_CALL_BODY}), loop_after_dispatch=true, '
                          "excludes=())", "root ::= ((tool_dispatch))"])
    except RuntimeError:  # xgrammar's own structural tag (its JSON laid out with any whitespace)
        import xgrammar as xgr

        from specjet.grammar.ebnf_text import ebnf_text

        items = [xgr.StructuralTagItem(begin=TOOL_OPEN + "\n", schema=json.dumps(s), end="\n" + TOOL_CLOSE)
                 for s in schemas]
        try:
            return ebnf_text(xgr.Grammar.from_structural_tag(items, [TOOL_OPEN]))
        except RuntimeError as error:  # a parameters schema xgrammar cannot compile (e.g. minimum > maximum)
            from specjet.grammar.backend import xgrammar_message

            raise bad_request(f"the tools' parameters could not be compiled into a grammar: {xgrammar_message(error)}",
                              "tools") from None


def _answer_or_calls_grammar(answer: dict[str, Any], schemas: list[dict[str, Any]], parallel: bool) -> str:
    """EBNF for a reply that is either JSON matching ``answer`` (a response_format's schema) or <tool_call> blocks
    whose JSON matches one of ``schemas`` (one block unless ``parallel``), nothing else."""
    try:
        rules = "\n".join([_call_rules(schemas), _schema_rules(answer, "answer_")])
    except RuntimeError as error:  # a schema xgrammar cannot compile (e.g. minimum > maximum)
        from specjet.grammar.backend import xgrammar_message

        raise bad_request(f"response_format and the tools' parameters could not be compiled into one grammar: "
                          f"{xgrammar_message(error)}", "tools") from None
    return rules + f"\nroot ::= (answer_root | {_calls_expression(parallel)})"


def _calls_expression(parallel: bool) -> str:
    """EBNF of one <tool_call> block (its body the ``_call_rules``' rule), or of one or more if ``parallel``."""
    block = f'("{TOOL_OPEN}" {_CALL_BODY})'
    return f'({block} ("\\n" {block})*)' if parallel else block


def _required_calls(plan: ToolPlan, schemas: list[dict[str, Any]]) -> tuple[str, Any, str]:
    """The constraint of a reply that must be calls (one unless ``plan.parallel``) matching one of ``schemas``."""
    grammar = _calls_grammar(schemas, plan.parallel)
    if grammar is not None:
        plan.mode = "tagged"
        return ("ebnf", grammar, "tool_choice")
    plan.mode, plan.parallel = "json", False
    return ("json_schema", schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, "tool_choice")


def _calls_grammar(schemas: list[dict[str, Any]], parallel: bool) -> Optional[str]:
    """EBNF for <tool_call> blocks (one or more if ``parallel``, else one) and nothing else. A model ends after
    its calls as it was trained to, where a JSON array of calls tempts a small model to add items until the
    token limit. None if the schemas' rules cannot be built (the caller then asks for a bare JSON call)."""
    try:
        rules = _call_rules(schemas)
    except RuntimeError:
        return None
    return rules + f"\nroot ::= {_calls_expression(parallel)}"


# ---------------------------------------------------------------- messages -> prompt
def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # an earlier assistant turn's refusal: its text
            parts.append(part["refusal"])
            continue
        if kind != "text":
            raise bad_request(f"message content of type {kind!r} is not supported (text only)", "messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _call_arguments(call: dict[str, Any]) -> Any:
    """An earlier call's arguments as an object where its JSON string parses (as templates expect them)."""
    args = (call.get("function") or {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def _call_text(call: dict[str, Any]) -> str:
    """An earlier call as the model writes one. Arguments sent back as this server returned them (the model's own
    JSON text) are kept as written, so the turn's prompt spells the reply it generated and the prefix cache holds
    it; re-serialising them would respell numbers and non-ASCII characters."""
    name = (call.get("function") or {}).get("name")
    args = (call.get("function") or {}).get("arguments", "{}")
    parsed = _call_arguments(call)
    if isinstance(args, str) and isinstance(parsed, dict):
        body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args.strip()}}}'
    else:  # (as the grammar writes JSON: characters as they are)
        body = json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{body}\n{TOOL_CLOSE}"


def _template_message(m, structured: bool) -> dict[str, Any]:
    """One message as the chat template takes it. ``structured``: the template reads tool calls itself (Llama 3.1's,
    Qwen's, Hermes'), so an assistant's calls go as ``tool_calls`` (arguments as objects) and a tool result keeps
    its ``tool_call_id`` and ``name``, the layout the model was trained on; else the calls are written into the
    text as this server's instructions ask the model to write them."""
    role = "system" if m.role == "developer" else m.role
    text = _text_of(m.content)
    message: dict[str, Any] = {"role": role, "content": text}
    if m.role == "assistant" and m.tool_calls:
        if not structured:
            return dict(message, content="\n".join([text] * bool(text) + [_call_text(c) for c in m.tool_calls]))
        message["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": (c.get("function") or {}).get("name"), "arguments": _call_arguments(c)}} for c in m.tool_calls]
    if structured and m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if structured and m.name is not None:
        message["name"] = m.name
    return message


def tool_instructions(tools: list) -> str:
    listing = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return ("You can call functions. The available tools, one JSON object a line:\n<tools>\n"
            f"{listing}\n</tools>\nWhen one of these tools can answer the user's request, reply with a call "
            f"and nothing else:\n{TOOL_OPEN}\n"
            '{"name": <function name>, "arguments": <arguments object>}\n' f"{TOOL_CLOSE}\n"
            "Otherwise answer in plain text.")


def chat_prompt(tokenizer, req: ChatCompletionRequest) -> str:
    """The prompt text: ``messages`` through the tokenizer's chat template. Tools go to the template
    when it knows about them, else into the system message as instructions; earlier calls likewise."""
    template = str(getattr(tokenizer, "chat_template", None) or "")  # (a dict of named templates: their texts)
    messages = [_template_message(m, "tool_calls" in template) for m in req.messages]
    tools = _tools_in_use(req)
    kwargs: dict[str, Any] = {}
    if tools and "tools" in template:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    elif tools:
        note = tool_instructions(tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as error:  # a template that refuses these messages (jinja raises its own errors)
        raise bad_request(f"the chat template could not render the messages: {error}", "messages") from None


# ---------------------------------------------------------------- text -> reply
def finish_reason(result: dict[str, Any]) -> Optional[str]:
    reason = result["meta_info"]["finish_reason"]
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), "abort")


REPEATED_CALL = {"type": "stop", "matched": "a repeated tool call"}

_JSON = json.JSONDecoder()


@dataclass
class CallBlock:
    start: int  # where its <tool_call> starts
    end: int  # just after its </tool_call> (the text's end while it is open)
    body: str  # its JSON text, whitespace around it excluded
    complete: bool  # closed by </tool_call>


def call_blocks(text: str) -> list[CallBlock]:
    """The <tool_call> blocks of a reply, in order, the last one possibly still open. A block's JSON is read as
    JSON, so a string in the arguments may hold "</tool_call>" itself; a block that is not JSON ends at the first
    </tool_call> after it."""
    blocks, at = [], 0
    while (start := text.find(TOOL_OPEN, at)) >= 0:
        open_at = start + len(TOOL_OPEN)
        first = len(text) - len(text[open_at:].lstrip())
        close, running, search_from = -1, False, open_at
        try:
            _, search_from = _JSON.raw_decode(text, first)
            after = len(text) - len(text[search_from:].lstrip())
            if text.startswith(TOOL_CLOSE, after):
                close = after
            elif TOOL_CLOSE.startswith(text[after:]):
                running = True  # the closing tag is still being written
        except json.JSONDecodeError as error:
            # Text that ran out inside the JSON is a call still being written; an error inside it is not JSON.
            running = error.pos >= len(text) or error.msg.startswith("Unterminated string")
        if close < 0 and not running:  # not JSON, or JSON and then something else: the next closing tag
            close = text.find(TOOL_CLOSE, search_from)
        if close < 0:
            blocks.append(CallBlock(start, len(text), text[open_at:].strip(), False))
            return blocks
        blocks.append(CallBlock(start, close + len(TOOL_CLOSE), text[open_at:close].strip(), True))
        at = close + len(TOOL_CLOSE)
    return blocks


def repeat_cut(text: str) -> Optional[int]:
    """Where a reply's first exact repeat of an earlier tool call starts, or None. Small models
    given parallel calls tend to cycle through the same calls until the token limit; a call made
    twice in one reply does nothing the first did not, so the reply ends before the repeat."""
    seen = set()
    for block in call_blocks(text):
        if not block.complete:
            break
        try:
            key = json.dumps(json.loads(block.body), sort_keys=True)
        except json.JSONDecodeError:
            continue
        if key in seen:
            return block.start
        seen.add(key)
    return None


def streamable_end(text: str) -> int:
    """How much of a partial "auto" reply can be streamed as content: up to the first <tool_call>,
    less a tail that could still become one."""
    at = text.find(TOOL_OPEN)
    if at >= 0:
        return at
    for keep in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


# The start of a call as the grammars lay it out ("name" first, then "arguments"), any whitespace.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _raw_arguments(region: str) -> Optional[tuple[str, str]]:
    """(name, arguments as the model wrote them) of one complete call's JSON text, or None."""
    head = _CALL_HEAD.match(region)
    if head is None:
        return None
    body = region[head.end():].rstrip()
    if not body.endswith("}"):
        return None
    return json.loads(f'"{head.group(1)}"'), body[:-1].rstrip()


def _as_call(region: str, plan: ToolPlan) -> Optional[ToolCall]:
    """A call from its JSON text, its arguments as written (so a stream's pieces add up to them)."""
    try:
        value = json.loads(region)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names or not isinstance(value.get("arguments"), dict):
        return None
    arguments = json.dumps(value["arguments"])
    raw = _raw_arguments(region)
    if raw is not None and raw[0] == value["name"]:
        try:
            if json.loads(raw[1]) == value["arguments"]:
                arguments = raw[1]
        except json.JSONDecodeError:
            pass
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=value["name"], arguments=arguments))


def finished_reply(text: str, result: dict[str, Any], plan: ToolPlan) -> tuple[str, AssistantMessage, Optional[str]]:
    """``reply`` for a finished choice whose engine result (or last chunk) is ``result`` and text ``text``; also the
    text the reply was read from (a stop string's cut may have closed a whole last call: ``closed_at_stop``), which a
    stream's call deltas are finished from."""
    stopped = isinstance((result["meta_info"]["finish_reason"] or {}).get("matched"), str)  # a caller's stop string
    text = closed_at_stop(text, plan) if stopped else text
    return (text, *reply(text, finish_reason(result), plan, stopped))


def closed_at_stop(text: str, plan: ToolPlan) -> str:
    """A reply a stop string ended, with the closing tag of a last call whose JSON is whole (``stop:
    ["</tool_call>"]``, as ReAct and Hermes agents send: the call was lost and its markup returned as content)."""
    blocks = call_blocks(text) if plan.mode == "tagged" else []
    if blocks and not blocks[-1].complete and _as_call(blocks[-1].body, plan) is not None:
        return text.rstrip() + "\n" + TOOL_CLOSE
    return text


def reply(text: str, reason: Optional[str], plan: ToolPlan,
          stop_string: bool = False) -> tuple[AssistantMessage, Optional[str]]:
    """The assistant message and finish reason for the model's text: tool calls when the text holds
    complete ones (finish reason "tool_calls"), else the text as content. A reply the token limit cut
    ("length") or a stop string ended (``stop_string``; give ``closed_at_stop``'s text) keeps its complete calls and
    the call it had begun as a stream sends it (name, arguments so far; its finish reason its own), and its content
    is only the text around the calls: tool markup is never content. A reply with no call has content, if only ""
    (an assistant message with neither is refused when a client sends it back)."""
    calls: list[ToolCall] = []
    content: Optional[str] = text
    cut = reason == "length" or stop_string
    begun = None
    if plan.mode == "json":
        call = _as_call(text, plan) if reason == "stop" else None
        begun = _begun_call(text, plan) if call is None and cut else None
        calls = [c for c in (call, begun) if c is not None]
        if calls or cut:
            content = None
    elif plan.mode == "tagged":
        blocks = call_blocks(text)
        for block in blocks:
            call = _as_call(block.body, plan) if block.complete else None
            if call is not None:
                calls.append(call)
        begun = _begun_call(text, plan) if cut else None
        calls += [begun] if begun is not None else []
        if calls or cut:  # the content is the text around the calls, and a call the token limit cut short is markup too
            pieces, at = [], 0
            for block in blocks:
                if block.complete or cut:
                    pieces.append(text[at:block.start])
                    at = block.end
            content = "".join(pieces) + text[at:]
            content = content[:streamable_end(content)] if cut else content  # less a <tool_call> cut as it began
            # Beside calls, blank text is no content; with none, the prose is what a stream sent, blank or not.
            content = content if (content.strip() if calls else content) else None
    if calls:
        if not plan.parallel:
            calls = calls[:1]
        # Complete calls of a reply cut by max_tokens are returned, but the reason stays "length"; one a stop string
        # cut short, "stop".
        ended = reason == "stop" and not any(call is begun for call in calls)
        return AssistantMessage(content=content, tool_calls=calls), "tool_calls" if ended else reason
    return AssistantMessage(content=content if content is not None else ""), reason


def _begun_call(text: str, plan: ToolPlan) -> Optional[ToolCall]:
    """The call a cut reply had begun after its complete ones, exactly as a stream sends it: its name and
    the arguments written so far (None where a stream sends none: before the name is complete, or under
    parallel "auto" calls, which go out only whole)."""
    streamer = CallStreamer(plan)
    regions = streamer.regions(text, finished=False)
    if not regions or regions[-1][1]:
        return None
    index = len(regions) - 1
    deltas = [d for d in streamer.feed(text) if d["index"] == index]
    if not deltas:
        return None
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    return ToolCall(id=deltas[0]["id"], function=FunctionCall(name=deltas[0]["function"]["name"], arguments=arguments))


class CallStreamer:
    """A growing tool reply -> the tool-call deltas of an OpenAI stream: each call's id and name once
    the name is written, then its arguments as they are written. What is sent of the arguments is
    always a prefix of what the finished call holds: a tail that could still turn out to be the
    call's closing brace, trailing space or a partial </tool_call> is held back."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent: list[int] = []  # per call started: how much of its arguments went out

    def regions(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        """Each call's JSON text so far, and whether it is complete."""
        if self.plan.mode == "json":
            return [(text, finished)]
        return [(block.body if block.complete else text[block.start + len(TOOL_OPEN):], block.complete)
                for block in call_blocks(text)]

    def feed(self, text: str, finished: bool = False) -> list[dict[str, Any]]:
        deltas = []
        regions = self.regions(text, finished)
        if not self.plan.parallel:
            regions = regions[:1]
        for i, (region, complete) in enumerate(regions):
            if self.plan.mode == "tagged" and self.plan.parallel and not complete:
                break  # each of several calls goes out whole, once it is known not to repeat an earlier one
            head = _CALL_HEAD.match(region)
            if head is None:  # the name is not complete yet
                break
            if i == len(self.sent):
                name = json.loads(f'"{head.group(1)}"')
                deltas.append({"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.sent.append(0)
            body = region[head.end():]
            if complete:
                body = body.rstrip()
                body = body[:-1].rstrip() if body.endswith("}") else body
            else:
                for keep in range(min(len(TOOL_CLOSE), len(body)), 0, -1):  # a partial </tool_call>
                    if TOOL_CLOSE.startswith(body[-keep:]):
                        body = body[:-keep]
                        break
                body = body.rstrip()
                body = body[:-1].rstrip() if body.endswith("}") else body  # maybe the call's own brace
            if len(body) > self.sent[i]:
                deltas.append({"index": i, "function": {"arguments": body[self.sent[i]:]}})
                self.sent[i] = len(body)
        return deltas
