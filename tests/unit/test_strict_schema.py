"""OpenAI's strict mode: an object schema that leaves additionalProperties unsaid takes no unlisted keys."""

import copy

from engine.server.protocol import parse_chat
from engine.server.strict_schema import strict_schema

# what pydantic writes for User(name: str, age: int, pets: list[Pet] = [], best: Pet | None, scores: dict[str, int])
USER = {
    "$defs": {
        "Pet": {"properties": {"name": {"type": "string"}}, "required": ["name"], "title": "Pet", "type": "object"}
    },
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "pets": {"default": [], "items": {"$ref": "#/$defs/Pet"}, "type": "array"},
        "best": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}], "default": None},
        "scores": {"additionalProperties": {"type": "integer"}, "default": {}, "type": "object"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    },
    "required": ["name", "age"],
    "title": "User",
    "type": "object",
}


def test_every_object_that_says_nothing_is_closed_at_every_depth():
    before = copy.deepcopy(USER)
    strict = strict_schema(USER)
    assert USER == before  # the request's own schema is left as it is
    assert strict["additionalProperties"] is False
    assert strict["$defs"]["Pet"]["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert strict["properties"]["scores"]["additionalProperties"] == {"type": "integer"}  # a dict says what it takes
    assert strict["properties"]["best"] == USER["properties"]["best"]  # $ref and null: nothing to close
    assert strict_schema({"type": "object", "additionalProperties": True}) == {
        "type": "object",
        "additionalProperties": True,
    }
    assert strict_schema({"anyOf": [{"properties": {}}, {"type": ["object", "null"]}]}) == {
        "anyOf": [
            {"properties": {}, "additionalProperties": False},
            {"type": ["object", "null"], "additionalProperties": False},
        ]
    }


def test_strict_true_closes_the_response_format_and_a_tools_parameters():
    ask = [{"role": "user", "content": "x"}]

    def fmt(**strict):
        return {"type": "json_schema", "json_schema": {"name": "user", "schema": USER, **strict}}

    assert parse_chat({"messages": ask, "response_format": fmt(strict=True)}).json_schema == strict_schema(USER)
    assert parse_chat({"messages": ask, "response_format": fmt()}).json_schema == USER
    assert parse_chat({"messages": ask, "response_format": fmt(strict=False)}).json_schema == USER
    tool = {"type": "function", "function": {"name": "save", "parameters": USER, "strict": True}}
    loose = {"type": "function", "function": {"name": "load", "parameters": USER}}
    r = parse_chat({"messages": ask, "tools": [tool, loose], "tool_choice": "required"})
    assert [t["function"]["parameters"] for t in r.forced_tools] == [strict_schema(USER), USER]
    assert r.tools == r.forced_tools and tool["function"]["parameters"] is USER
