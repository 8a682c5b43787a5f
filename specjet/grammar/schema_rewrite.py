"""Keep every `required` property of a JSON schema reachable before xgrammar compiles it.

Under strict mode (see `JSON_SCHEMA_OPTIONS`) xgrammar generates only the properties that
`properties` lists, so a name that `required` asks for but `properties` does not list can never be
written, and the output cannot validate. Real schemas do this often (a draft-04 credentials schema
with `required: ["username", "password"]` and only `credentials` under `properties`), relying on
`additionalProperties` to allow the rest. `reachable_required` lists each such name under
`properties`, with the schema that JSON Schema would apply to it anyway, so the grammar can write it
and what validates does not change.
"""

from __future__ import annotations

import re
from typing import Any

# Keywords whose value is a map from names to subschemas, a list of subschemas, or one subschema.
# Only these are walked: `enum`, `const`, `default` and `examples` hold data that may look like a
# schema but is not one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "contains",
    "not", "if", "then", "else", "propertyNames", "contentSchema",
)


def reachable_required(schema: Any) -> Any:
    """`schema` with every `required` name listed under `properties`, in every object subschema.

    A missing name is appended at the end of `properties` (xgrammar writes properties in schema
    order, so the listed ones keep their places) with the schema JSON Schema applies to it:
    - the schema of each `patternProperties` pattern it matches (`allOf` them if several);
    - else `additionalProperties` if that is a schema, else `{}` (any value) when it is absent or
      true; when it is absent, `unevaluatedProperties` stands in for it (exact unless a sibling
      `allOf`/`$ref` also defines the name, and then only stricter).
    A name that `additionalProperties: false` forbids is left out: the schema is unsatisfiable by
    JSON Schema's own rules, and listing the name would make it satisfiable.

    Returns a new structure; `schema` is not changed. Recursion follows the schema's nesting, so
    callers bound its depth first (`spec.canonical_text` does).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: reachable_required(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [reachable_required(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = reachable_required(out[key])
    items = out.get("items")
    if isinstance(items, list):  # the tuple form of drafts 4 to 2019-09
        out["items"] = [reachable_required(sub) for sub in items]
    elif items is not None:
        out["items"] = reachable_required(items)
    if isinstance(out.get("dependencies"), dict):  # drafts 4-7: a schema, or a list of names
        out["dependencies"] = {name: reachable_required(dep) for name, dep in out["dependencies"].items()}
    return _list_required_names(out)


def _list_required_names(schema: dict) -> dict:
    required, properties = schema.get("required"), schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return schema
    missing = [name for name in dict.fromkeys(n for n in required if isinstance(n, str)) if name not in properties]
    if not missing:
        return schema
    extra = schema.get("additionalProperties", schema.get("unevaluatedProperties", True))
    patterns = schema.get("patternProperties")
    patterns = patterns if isinstance(patterns, dict) else {}
    added = dict(properties)
    for name in missing:
        matched = [sub for pattern, sub in patterns.items() if _matches(pattern, name)]
        if matched:
            added[name] = matched[0] if len(matched) == 1 else {"allOf": matched}
        elif extra is False:
            continue
        else:
            added[name] = extra if isinstance(extra, dict) else {}
    if len(added) == len(properties):
        return schema
    return {**schema, "properties": added}


def _matches(pattern: Any, name: str) -> bool:
    # Python's re stands in for ECMA-262 regexes, which patternProperties uses: they agree on the
    # patterns property names use in practice. One it cannot read matches nothing.
    try:
        return isinstance(pattern, str) and re.search(pattern, name) is not None
    except re.error:
        return False
