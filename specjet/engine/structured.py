"""Structured output for agent code in Python: pydantic models as schemas, functions as tools.

    class Pet(pydantic.BaseModel):
        name: str
        age: int

    out = engine.generate(prompt, {"json_schema": Pet, "max_new_tokens": 64})
    pet = specjet.parse_output(out, Pet)  # a validated Pet (ValueError naming the problem if not)

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        '''Current weather in a city.'''
    tools = [specjet.function_tool(get_weather)]  # OpenAI's tool shape, for `specjet serve` clients
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, TypeVar

import pydantic

M = TypeVar("M")


def parse_output(output: dict, model: type[M]) -> M:
    """The model instance an engine result's text holds (``output["text"]``, or a text itself).
    Raises ValueError naming the problem when the request did not finish with ``stop`` or the
    text does not validate (pydantic's message)."""
    if isinstance(output, dict):
        reason = (output.get("meta_info") or {}).get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason  # the engine's dict, or a bare "length"
        if kind not in (None, "stop"):
            raise ValueError(f"the request did not complete its object (finish_reason {reason})")
        text = output.get("text", "")
    else:
        text = output
    try:
        return pydantic.TypeAdapter(model).validate_json(text)
    except pydantic.ValidationError as exc:
        raise ValueError(f"the output does not validate as {getattr(model, '__name__', model)}: {exc}") from None


def function_tool(fn: Callable) -> dict:
    """An OpenAI tool definition (``{"type": "function", "function": {name, description,
    parameters}}``) from a Python function's signature: each parameter's annotation (any type
    pydantic knows) and default, the docstring's first paragraph as the description."""
    fields = {}
    hints = typing.get_type_hints(fn)  # resolves string annotations (``from __future__ import annotations``)
    for i, (name, param) in enumerate(inspect.signature(fn).parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{fn.__name__}: *args/**kwargs cannot be a tool's parameters")
        annotation = hints.get(name, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        if not name.startswith("_") and not hasattr(pydantic.BaseModel, name):
            fields[name] = (annotation, default)  # a pydantic Field(...) default keeps its description and bounds
            continue
        # A name pydantic keeps for itself (a leading "_": a private attribute, dropped from the schema;
        # "model_config", "json", "copy", ...: the model's own) goes under a neutral one, the parameter's as its alias.
        info = (pydantic.fields.FieldInfo.merge_field_infos(default, pydantic.Field(alias=name))
                if isinstance(default, pydantic.fields.FieldInfo) else pydantic.Field(default, alias=name))
        fields[f"p{i}"] = (annotation, info)
    params_model = pydantic.create_model(f"{fn.__name__}_parameters", **fields)
    schema = params_model.model_json_schema()
    schema.pop("title", None)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {"name": fn.__name__, "description": doc.split("\n\n")[0],
                                             "parameters": schema}}
