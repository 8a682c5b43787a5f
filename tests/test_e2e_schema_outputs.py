"""JSON-schema outputs on the real default model: required names a schema does not list under
``properties`` stay reachable (defect 13: under strict mode they were unsatisfiable), and every
completed output is checked with jsonschema, so one that breaks a keyword xgrammar does not
enforce says so in ``meta_info`` instead of passing as valid."""
from __future__ import annotations

import json

import jsonschema
import pytest

import specjet

pytestmark = pytest.mark.e2e

CREDENTIALS = {  # a draft-04 schema of the kind found in the wild: required names not in properties
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {"credentials": {"type": "string"}},
    "required": ["username", "password"],
}


@pytest.fixture(scope="module")
def engine():
    with specjet.Engine(max_total_tokens=4096) as eng:
        yield eng


def test_required_names_missing_from_properties_stay_reachable(engine):
    prompt = engine.apply_chat_template("Give login credentials for user alice as JSON.")
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 80, "json_schema": CREDENTIALS})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    obj = json.loads(out["text"])
    assert {"username", "password"} <= set(obj)
    jsonschema.Draft4Validator(CREDENTIALS).validate(obj)
    assert out["meta_info"]["json_schema_valid"] is True
    engine.check_kv_invariant()


def test_an_output_that_breaks_an_unenforced_keyword_says_so(engine):
    # xgrammar ignores minLength beside pattern, so the grammar lets '"a"' through
    schema = {"type": "string", "pattern": "^a$", "minLength": 5}
    out = engine.generate("Say a.", {"temperature": 0, "max_new_tokens": 16, "json_schema": schema})
    assert out["text"] == '"a"'
    info = out["meta_info"]
    assert info["json_schema_valid"] is False
    assert "too short" in info["json_schema_message"]
    assert info["finish_reason"]["type"] == "stop" and "too short" in info["finish_reason"]["message"]
    engine.check_kv_invariant()
