"""JSON schemas as OpenAI's strict mode reads them (`response_format.json_schema.strict`, a tool's
`function.strict`): no object takes keys its schema does not list.

JSON Schema allows unlisted keys unless `additionalProperties` says otherwise, and so does llguidance;
pydantic's schemas never say it, so under them a model could write `{"name": "a", "age": 1, "myl": "}}}...`
until the length limit. Strict mode closes every object schema that leaves it unsaid.
"""

from __future__ import annotations

from typing import Any

_SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` in every object schema, at any depth ($defs, items,
    anyOf, ...), that says nothing of additional (or unevaluated) properties; the input is left as it is."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [strict_schema(sub) for sub in value]
        elif key in _SUBSCHEMA:
            value = strict_schema(value)
        out[key] = value
    kinds = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    is_object = "object" in kinds or "properties" in schema
    if is_object and not {"additionalProperties", "unevaluatedProperties"} & set(schema):
        out["additionalProperties"] = False
    return out
