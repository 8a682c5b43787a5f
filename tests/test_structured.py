"""The Python API for agent code: a pydantic model class wherever a JSON schema goes, the parsed and
validated instance back (`specjet.parse_output`), and OpenAI tool definitions from functions
(`specjet.function_tool`)."""
from __future__ import annotations

from typing import Literal

import pydantic
import pytest

import specjet


class Pick(pydantic.BaseModel):
    color: Literal["red", "blue"]
    n: int = pydantic.Field(ge=0, le=9)


def test_a_model_class_is_a_schema_and_the_output_parses_to_it(plain):
    out = plain.generate("Pick one.", {"json_schema": Pick, "temperature": 0, "max_new_tokens": 40})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    pick = specjet.parse_output(out, Pick)
    assert isinstance(pick, Pick) and pick.color in ("red", "blue") and 0 <= pick.n <= 9
    # the same as giving its schema
    same = plain.generate("Pick one.", {"json_schema": Pick.model_json_schema(), "temperature": 0, "max_new_tokens": 40})
    assert same["output_ids"] == out["output_ids"]
    plain.check_kv_invariant()


def test_a_class_that_is_not_a_model_is_refused_by_name(plain):
    class NotAModel:
        pass
    with pytest.raises(TypeError, match="json_schema must be a str, a dict or a pydantic model class"):
        plain.generate("Pick one.", {"json_schema": NotAModel})
    plain.check_kv_invariant()


def test_parse_output_names_the_problem():
    with pytest.raises(ValueError, match="did not complete"):
        specjet.parse_output({"text": '{"color": "re', "meta_info": {"finish_reason": {"type": "length"}}}, Pick)
    with pytest.raises(ValueError, match="does not validate as Pick"):
        specjet.parse_output('{"color": "green", "n": 3}', Pick)
    with pytest.raises(ValueError, match="did not complete"):  # a reason as a bare string (was AttributeError)
        specjet.parse_output({"text": '{"color": "re', "meta_info": {"finish_reason": "length"}}, Pick)
    assert specjet.parse_output('{"color": "red", "n": 3}', Pick) == Pick(color="red", n=3)
    assert specjet.parse_output("[1, 2]", list[int]) == [1, 2]


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None) -> str:
    """Current weather in a city.

    More words that are not the description."""
    return ""


def test_function_tool_from_a_signature():
    tool = specjet.function_tool(get_weather)
    assert tool["type"] == "function"
    fn = tool["function"]
    assert fn["name"] == "get_weather" and fn["description"] == "Current weather in a city."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["city"]
    assert params["properties"]["city"]["type"] == "string"
    assert params["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert params["properties"]["unit"]["default"] == "celsius"
    # the schema accepts what the function takes and refuses what it does not
    import jsonschema
    jsonschema.validate({"city": "Oslo", "unit": "fahrenheit", "days": 3}, params)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "unit": "kelvin"}, params)

    def splat(*args):
        pass
    with pytest.raises(TypeError, match="args"):
        specjet.function_tool(splat)


def test_function_tool_keeps_every_parameter_name():
    """Names pydantic reserves for itself (a leading "_": a private attribute; "model_config": the model's
    configuration; "json", "schema", "copy": its methods) are ordinary parameters of a tool."""
    def lookup(_id: int, model_config: dict, json: str = "", schema: str = "s", copy: bool = False):
        """Look a record up."""

    params = specjet.function_tool(lookup)["function"]["parameters"]
    assert list(params["properties"]) == ["_id", "model_config", "json", "schema", "copy"]
    assert params["required"] == ["_id", "model_config"]
    assert params["properties"]["_id"]["type"] == "integer" and params["properties"]["schema"]["default"] == "s"

    def search(query: str = pydantic.Field(description="the query"), limit: int = pydantic.Field(5, ge=1),
               _page: int = pydantic.Field(1, ge=1, description="which page")):
        """Search."""

    params = specjet.function_tool(search)["function"]["parameters"]  # a Field default keeps what it says
    assert params["required"] == ["query"] and params["properties"]["query"]["description"] == "the query"
    assert params["properties"]["limit"] == {"default": 5, "minimum": 1, "title": "Limit", "type": "integer"}
    assert params["properties"]["_page"]["minimum"] == 1 and params["properties"]["_page"]["description"] == "which page"
