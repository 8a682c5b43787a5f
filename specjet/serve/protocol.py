"""Request and response bodies of the OpenAI-compatible endpoints, as pydantic models.

Requests forbid fields they do not know, so a misspelt or unsupported parameter is a 400 that names
it rather than something silently ignored; the OpenAI fields that change nothing here (``user``,
``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``reasoning_effort``,
``verbosity``, ``modalities`` ["text"], ``stream_options.include_obfuscation``, a zero penalty, nulls) are accepted. SGLang's extra fields
``json_schema``, ``regex`` and ``ebnf`` are accepted on both generation endpoints.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# Request bodies are validated strictly, as OpenAI's API does: a JSON true is not the number 1 (max_tokens,
# temperature, a token id of a prompt), a string is not a number ("4"), and 1 is not true. Pydantic's lax
# default converted each of those into a valid-looking value and served a request nobody asked for.


def _integral(value: Any) -> Any:
    """A number without a fractional part as an int (JSON Schema's integer: 4.0 is 4); anything else as it
    came, for the strict check to accept or refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# ---------------------------------------------------------------- shared request parts
class StreamOptions(_Request):
    include_usage: Optional[bool] = None
    # OpenAI's random padding of stream events (against length side channels): accepted, nothing is padded.
    include_obfuscation: Optional[bool] = None


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: Optional[str] = None
    # "schema" would shadow BaseModel.schema; the alias keeps OpenAI's spelling on the wire.
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDefinition(_Request):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class _SamplingFields(_Request):
    """What both generation endpoints share."""
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    # The engine's range, checked here: the choices' seeds (seed + i) wrap around modulo 2**64 (engine/choices.py).
    seed: Optional[Annotated[Int, Field(ge=0, lt=2**64)]] = None
    n: Optional[Int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (a decimal string) -> bias in [-100, 100]
    user: Optional[str] = None
    # SGLang's extras
    top_k: Optional[Int] = None
    min_tokens: Optional[Annotated[Int, Field(ge=0)]] = None  # the engine's min_new_tokens (SGLang's, vLLM's name)
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    no_stop_trim: Optional[bool] = None  # keep the stop token that ended the reply in its text
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, options, info):
        """OpenAI's and vLLM's rule: options for a stream that is not asked for are a mistake, not a no-op."""
        if options is not None and "stream" in info.data and not info.data["stream"]:  # (a bad stream: its error)
            raise ValueError("stream_options is only allowed when stream is true")
        return options


# ---------------------------------------------------------------- chat
class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class Prediction(_Request):
    """OpenAI's predicted output: text the reply is expected to repeat for the most part."""
    type: Literal["content"] = "content"
    content: Union[str, list[TextPart]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        """A content part's text is a string (the prompt is their concatenation); a part of another type is
        refused where the prompt is built, naming the type."""
        for i, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}] of type text needs a string text, got "
                                 f"{type(part.get('text')).__name__}")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, calls):
        """Each earlier call as OpenAI writes it: a function object with a string name and its arguments as a
        JSON string (or an object)."""
        for i, call in enumerate(calls or []):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tool_calls[{i}].function must be an object with a string name")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string")
        return calls

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        """OpenAI's rule: every message has content, except an assistant's that carries tool calls instead (a
        message without either would reach the template as an empty turn nobody wrote)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            needs = "an assistant message needs content or tool_calls" if self.role == "assistant" else \
                f"a {self.role} message needs content"
            raise ValueError(needs)
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Annotated[Int, Field(ge=0)]] = None
    max_completion_tokens: Optional[Annotated[Int, Field(ge=0)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    # OpenAI fields that change nothing a local model answers (billing tier, cache routing, abuse tracking; a
    # reasoning effort and verbosity for a model that does not reason): accepted and ignored.
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    modalities: Optional[list[Literal["text"]]] = None  # text is what it writes
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int] = None
    prediction: Optional[Prediction] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of the completion tokens; specjet fills in the predicted-output counts."""
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the prefix cache, not computed again (OpenAI's and vLLM's field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # As OpenAI's: always there; the predicted-output counts are zero without a prediction (chat ``prediction``).
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Optional[str]
    logprobs: Optional[dict[str, Any]] = None


def _now() -> int:
    return int(time.time())


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChoiceDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChoiceDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


# ---------------------------------------------------------------- completions
# OpenAI's default for a completion's max_tokens (given or null); a chat's is "until the context is full".
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[Annotated[Int, Field(ge=0)]] = COMPLETION_MAX_TOKENS
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[Int] = None
    logprobs: Optional[Int] = None  # the legacy layout: this many alternatives a token (0-5)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[dict[str, Any]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ---------------------------------------------------------------- models and errors
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specjet"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
