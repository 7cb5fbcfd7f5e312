"""Tool calls parsed out of generated text, whole and in every split; requests that carry tools."""

import json

import pytest

from engine.server import responses
from engine.server.protocol import ApiError, parse_chat
from engine.server.tool_calls import ToolCallParser, parser_for, split

TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call> done'
)


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(pieces):
    """The calls as a stream gives them: per index the head's id and name, then the argument fragments joined."""
    calls = {}
    for piece in pieces:
        for d in piece.deltas:
            if d.name is not None:
                assert d.index not in calls and d.arguments == "" and d.id.startswith("call_")
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert d.id is None and d.arguments
                calls[d.index]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def whole(pieces):
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for p in pieces for c in p.calls]


def test_a_whole_text_gives_its_content_and_calls():
    parsed = split(TEXT)
    assert parsed.content == "Let me check.  done"
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id


@pytest.mark.parametrize("pieces", [2, 3])
def test_every_split_of_the_stream_gives_the_same(pieces):
    want = split(TEXT)
    cuts = range(1, len(TEXT))
    for a in cuts:
        for b in cuts if pieces == 3 else [len(TEXT)]:
            if b <= a:
                continue
            parser = ToolCallParser()
            got = [parser.push(TEXT[:a]), parser.push(TEXT[a:b]), parser.push(TEXT[b:]), parser.flush()]
            assert "".join(p.content for p in got) == want.content, (a, b)
            assert [(c.name, c.arguments) for p in got for c in p.calls] == [(c.name, c.arguments) for c in want.calls]
            assert streamed(got) == whole(got), (a, b)


def test_a_call_streams_its_name_then_its_arguments_as_they_are_written():
    parser = ToolCallParser()
    pieces = [parser.push(ch) for ch in TEXT] + [parser.flush()]
    first = next(i for i, p in enumerate(pieces) if p.deltas)
    assert TEXT[: first + 1].endswith('"arguments": {')  # the name as soon as the arguments open
    assert pieces[first].deltas[0].name == "get_weather"
    fragments = [d.arguments for p in pieces for d in p.deltas if d.index == 0 and d.name is None]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "unit": "C"}'
    assert streamed(pieces) == whole(pieces)


def test_an_argument_may_hold_the_closing_tag():
    text = '<tool_call>\n{"name": "f", "arguments": {"html": "</tool_call>"}}\n</tool_call>after'
    parsed = split(text)
    assert calls_of(parsed) == [("f", {"html": "</tool_call>"})] and parsed.content == "after"


def test_content_is_not_held_back_past_what_may_open_a_call():
    parser = ToolCallParser()
    assert parser.push("Hello <tool").content == "Hello "  # "<tool" may open a call
    assert parser.push(" box>").content == "<tool box>"
    assert parser.push("a < b").content == "a < b"


@pytest.mark.parametrize(
    "block",
    [
        '{"arguments": {}}',
        '["f"]',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": 3}',
    ],
)
def test_a_block_that_is_not_a_call_stays_content(block):
    text = f"a<tool_call>{block}</tool_call>b"
    assert split(text).content == text and split(text).calls == ()


def test_a_block_that_opens_as_a_call_is_one_with_its_arguments_as_written():
    # its name and arguments were streamed as they came; OpenAI's arguments, too, are the model's text
    parsed = split('a<tool_call>{"name": "f", "arguments": {oops}}</tool_call>b')
    assert parsed.content == "ab" and [(c.name, c.arguments) for c in parsed.calls] == [("f", "{oops}")]


@pytest.mark.parametrize(
    "text, calls",
    [
        ('a <tool_call>\n{"name": "f", "arguments": {"city": "Pa', [("f", '{"city": "Pa')]),  # cut: as far as written
        ('a <tool_call>\n{"name": "f", "arguments": {}}', [("f", "{}")]),
        ('a <tool_call>\n{"na', []),  # no name yet: dropped
        ("a <tool_call>", []),
        ("a <tool_c", []),  # the start of a call
    ],
)
def test_a_block_cut_off_is_never_content(text, calls):
    parser = ToolCallParser()
    pieces = [parser.push(text), parser.flush()]
    assert "".join(p.content for p in pieces) == "a "
    assert [(c.name, c.arguments) for p in pieces for c in p.calls] == calls
    assert streamed(pieces) == whole(pieces)


def test_the_format_comes_from_the_template(tiny_path):
    from pathlib import Path

    template = (Path(__file__).parent.parent / "fixtures" / "tool_template.jinja").read_text()
    assert parser_for(template) is ToolCallParser
    assert parser_for("{{ messages }}") is None and parser_for(None) is None


def test_responses_carry_calls_as_openai_does():
    out = responses.Output("chatcmpl-x", "m", True)
    parser = ToolCallParser()
    entries = []
    for piece in (TEXT[:70], TEXT[70:90], TEXT[90:], ""):
        parsed = parser.push(piece) if piece else parser.flush()
        out.text += parsed.content
        out.tool_calls += parsed.calls
        entries += [
            c["choices"][0]["delta"]["tool_calls"][0] for c in responses.call_chunks(out, parsed.deltas, str, False)
        ]
    # per call: its index, id, type and name with empty arguments, then fragments of its arguments
    assert [tc["index"] for tc in entries] == [0, 0, 0, 0, 1, 1]
    assert [tc["function"].get("name") for tc in entries] == ["get_weather", None, None, None, "get_time", None]
    assert entries[0]["id"].startswith("call_") and entries[0]["type"] == "function" and "id" not in entries[1]
    assert entries[0]["function"]["arguments"] == ""
    assert "".join(tc["function"]["arguments"] for tc in entries[1:4]) == out.tool_calls[0].arguments
    message = responses.body([(out, "tool_calls")], {}, str, False)["choices"][0]["message"]
    assert [tc["function"]["name"] for tc in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    out.text = ""
    assert responses.body([(out, "tool_calls")], {}, str, False)["choices"][0]["message"]["content"] is None


XML = (
    "Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


def test_the_xml_format_of_qwen3_coder_templates():
    xml = parser_for("{{ '<tool_call>\n<function=' }}")
    parsed = split(XML, xml)
    assert parsed.content == "Checking." and [c.name for c in parsed.calls] == ["get_weather"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "San José", "days": 3, "hourly": True}
    for cut in range(1, len(XML)):
        p = xml()
        got = [p.push(XML[:cut]), p.push(XML[cut:]), p.flush()]
        assert [c.arguments for g in got for c in g.calls] == [parsed.calls[0].arguments], cut
        assert streamed(got) == whole(got), cut
    broken = "<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>"
    assert split(broken, xml).content == broken


def test_the_xml_format_streams_a_parameter_at_a_time():
    xml = parser_for("{{ '<tool_call>\n<function=' }}")
    p = xml()
    pieces = [p.push(ch) for ch in XML] + [p.flush()]
    fragments = [d.arguments for piece in pieces for d in piece.deltas if d.name is None]
    assert fragments == ["{", '"city": "San José"', ', "days": 3', ', "hourly": true', "}"]
    assert streamed(pieces) == whole(pieces)
    cut = split(XML[: XML.index("<parameter=hourly>") + 22], xml)  # cut inside a value: the parameters before it
    assert [(c.name, json.loads(c.arguments)) for c in cut.calls] == [("get_weather", {"city": "San José", "days": 3})]
    inside = "<tool_call>\n<function=f>\n<parameter=html>\n</tool_call>\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(split(inside, xml)) == [("f", {"html": "</tool_call>"})]


def test_llama_3_writes_a_call_as_the_whole_reply():
    llama = parser_for('... Respond in the format {"name": function name, "parameters": dictionary of ...')
    assert llama is parser_for("{{ '<|python_tag|>' }}")
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}'
    for text in (call, call.removeprefix("<|python_tag|>"), "  " + call):
        parsed = split(text, llama)
        assert parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
            ("get_weather", {"city": "Lima"})
        ]
    p = llama()
    assert p.push("The weather").content == "The weather" and p.push(" is fine").content == " is fine"
    assert split('{"not": "a call"}', llama).content == '{"not": "a call"}'


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_chat_with_tools_and_a_tool_round_trip_is_accepted():
    r = parse_chat(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
            ],
            "tools": [TOOL],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
        }
    )
    assert r.tools == [TOOL]
    assert r.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    }
    assert r.messages[2] == {"role": "tool", "content": "4 C", "tool_call_id": "call_1"}
    assert (
        parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "none"}).tools
        is None
    )


def test_a_forced_call_and_a_schema_are_parsed():
    ask = [{"role": "user", "content": "x"}]
    other = {"type": "function", "function": {"name": "other"}}
    r = parse_chat({"messages": ask, "tools": [TOOL, other], "tool_choice": "required"})
    assert r.forced_tools == [TOOL, other] and not r.several_calls  # one call unless parallel_tool_calls is true
    r = parse_chat({"messages": ask, "tools": [TOOL, other], "tool_choice": "required", "parallel_tool_calls": True})
    assert r.several_calls
    named = {"type": "function", "function": {"name": "other"}}
    assert not parse_chat(
        {"messages": ask, "tools": [TOOL, other], "tool_choice": named, "parallel_tool_calls": True}
    ).several_calls
    r = parse_chat(
        {
            "messages": ask,
            "tools": [TOOL, other],
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "other"}},
        }
    )
    assert r.forced_tools == [other] and not r.several_calls and r.tools == [TOOL, other]
    assert parse_chat({"messages": ask, "response_format": {"type": "json_object"}}).json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_chat(
        {
            "messages": ask,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        }
    )
    assert r.json_schema == {**schema, "additionalProperties": False} and r.forced_tools is None  # strict
    # pydantic-ai's NativeOutput with a tool: both at once (a forced call's grammar then wins)
    r = parse_chat(
        {"messages": ask, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}
    )
    assert r.forced_tools == [TOOL] and r.json_schema == {"type": "object"}


@pytest.mark.parametrize(
    "body, match",
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among 'tools'"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format must be"),
        ({"response_format": {"type": "xml"}}, "response_format must be"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": []}, "non-empty list"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, r"tools\[0\]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON Schema"),
    ],
)
def test_tools_the_server_cannot_take_are_refused_by_name(body, match):
    with pytest.raises(ApiError, match=match) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **body})
    assert e.value.status == 400


def test_an_assistant_call_must_be_well_formed():
    with pytest.raises(ApiError, match=r"tool_calls\[0\]"):
        parse_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]})
    with pytest.raises(ApiError, match="content must be a string"):
        parse_chat({"messages": [{"role": "user", "content": None}]})
