"""Tool calls parsed out of generated text, whole and in every split; requests that carry tools."""

import json

import pytest

from engine.server import responses
from engine.server.protocol import ApiError, parse_chat
from engine.server.tool_calls import ToolCallParser, parser_for, split

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call> done')  # fmt: skip


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


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
        for b in (cuts if pieces == 3 else [len(TEXT)]):
            if b <= a:
                continue
            parser = ToolCallParser()
            got = [parser.push(TEXT[:a]), parser.push(TEXT[a:b]), parser.push(TEXT[b:]), parser.flush()]
            assert "".join(p.content for p in got) == want.content, (a, b)
            assert [(c.name, c.arguments) for p in got for c in p.calls] == [(c.name, c.arguments) for c in want.calls]


def test_content_is_not_held_back_past_what_may_open_a_call():
    parser = ToolCallParser()
    assert parser.push("Hello <tool").content == "Hello "  # "<tool" may open a call
    assert parser.push(" box>").content == "<tool box>"
    assert parser.push("a < b").content == "a < b"


@pytest.mark.parametrize("block", ['{"name": "f", "arguments": {oops}', '{"arguments": {}}', '["f"]',
                                   '{"name": "f", "arguments": "not json"}', '{"name": "", "arguments": {}}'])  # fmt: skip
def test_a_block_that_is_not_a_call_stays_content(block):
    text = f"a<tool_call>{block}</tool_call>b"
    assert split(text).content == text and split(text).calls == ()


def test_an_unclosed_block_stays_content():
    text = 'a <tool_call>\n{"name": "f", "arguments": {}}'
    assert split(text).content == text and split(text).calls == ()


def test_the_format_comes_from_the_template(tiny_path):
    from pathlib import Path

    template = (Path(__file__).parent.parent / "fixtures" / "tool_template.jinja").read_text()
    assert parser_for(template) is ToolCallParser
    assert parser_for("{{ messages }}") is None and parser_for(None) is None


def test_responses_carry_calls_as_openai_does():
    out = responses.Output("chatcmpl-x", "m", True)
    parser = ToolCallParser()
    streamed = []
    for piece in (TEXT[:60], TEXT[60:]):
        parsed = parser.push(piece)
        out.text += parsed.content
        out.tool_calls += parsed.calls
        streamed += [c["choices"][0]["delta"]["tool_calls"][0] for c in responses.call_chunks(out, parsed.calls, str, False)]
    # per call: its index, id, type and name with empty arguments, then its arguments
    assert [tc["index"] for tc in streamed] == [0, 0, 1, 1]
    assert [tc["function"].get("name") for tc in streamed] == ["get_weather", None, "get_time", None]
    assert streamed[0]["id"].startswith("call_") and streamed[0]["type"] == "function" and "id" not in streamed[1]
    assert [tc["function"]["arguments"] for tc in streamed[:2]] == ["", out.tool_calls[0].arguments]
    message = responses.body([(out, "tool_calls")], {}, str, False)["choices"][0]["message"]
    assert [tc["function"]["name"] for tc in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    out.text = ""
    assert responses.body([(out, "tool_calls")], {}, str, False)["choices"][0]["message"]["content"] is None


XML = ("Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n"
       "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>")  # fmt: skip


def test_the_xml_format_of_qwen3_coder_templates():
    xml = parser_for("{{ '<tool_call>\n<function=' }}")
    parsed = split(XML, xml)
    assert parsed.content == "Checking." and [c.name for c in parsed.calls] == ["get_weather"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "San José", "days": 3, "hourly": True}
    for cut in range(1, len(XML)):
        p = xml()
        got = [p.push(XML[:cut]), p.push(XML[cut:]), p.flush()]
        assert [c.arguments for g in got for c in g.calls] == [parsed.calls[0].arguments], cut
    broken = "<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>"
    assert split(broken, xml).content == broken


def test_llama_3_writes_a_call_as_the_whole_reply():
    llama = parser_for("... Respond in the format {\"name\": function name, \"parameters\": dictionary of ...")
    assert llama is parser_for("{{ '<|python_tag|>' }}")
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}'
    for text in (call, call.removeprefix("<|python_tag|>"), "  " + call):
        parsed = split(text, llama)
        assert parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
            ("get_weather", {"city": "Lima"})]  # fmt: skip
    p = llama()
    assert p.push("The weather").content == "The weather" and p.push(" is fine").content == " is fine"
    assert split('{"not": "a call"}', llama).content == '{"not": "a call"}'


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_a_chat_with_tools_and_a_tool_round_trip_is_accepted():
    r = parse_chat({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}],
        "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True})  # fmt: skip
    assert r.tools == [TOOL]
    assert r.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}  # fmt: skip
    assert r.messages[2] == {"role": "tool", "content": "4 C", "tool_call_id": "call_1"}
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "none"}).tools is None


def test_a_forced_call_and_a_schema_are_parsed():
    ask = [{"role": "user", "content": "x"}]
    other = {"type": "function", "function": {"name": "other"}}
    r = parse_chat({"messages": ask, "tools": [TOOL, other], "tool_choice": "required"})
    assert r.forced_tools == [TOOL, other] and not r.several_calls  # one call unless parallel_tool_calls is true
    r = parse_chat({"messages": ask, "tools": [TOOL, other], "tool_choice": "required", "parallel_tool_calls": True})
    assert r.several_calls
    named = {"type": "function", "function": {"name": "other"}}
    assert not parse_chat({"messages": ask, "tools": [TOOL, other], "tool_choice": named,
                           "parallel_tool_calls": True}).several_calls  # fmt: skip
    r = parse_chat({"messages": ask, "tools": [TOOL, other], "parallel_tool_calls": False,
                    "tool_choice": {"type": "function", "function": {"name": "other"}}})  # fmt: skip
    assert r.forced_tools == [other] and not r.several_calls and r.tools == [TOOL, other]
    assert parse_chat({"messages": ask, "response_format": {"type": "json_object"}}).json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_chat({"messages": ask, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                                            "strict": True}}})  # fmt: skip
    assert r.json_schema == schema and r.forced_tools is None


@pytest.mark.parametrize("body, match", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among 'tools'"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
    ({"response_format": {"type": "json_schema"}}, "response_format must be"),
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": []}, "non-empty list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, r"tools\[0\]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON Schema"),
])  # fmt: skip
def test_tools_the_server_cannot_take_are_refused_by_name(body, match):
    with pytest.raises(ApiError, match=match) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **body})
    assert e.value.status == 400


def test_an_assistant_call_must_be_well_formed():
    with pytest.raises(ApiError, match=r"tool_calls\[0\]"):
        parse_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]})
    with pytest.raises(ApiError, match="content must be a string"):
        parse_chat({"messages": [{"role": "user", "content": None}]})
