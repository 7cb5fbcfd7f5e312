"""Tools through the official openai SDK: a template that renders them (--chat-template), calls in the history.

A random-weight model does not choose to call a tool, so what is checked end to end is that every form of
a tool conversation is taken, rendered and answered; the parsing of calls out of the text is
tests/unit/test_tool_calls.py's.
"""

from pathlib import Path

import openai
import pytest
from live_server import LiveServer

MODEL = "tiny-qwen3"
TEMPLATE = Path(__file__).parent.parent / "fixtures" / "tool_template.jinja"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
ROUND_TRIP = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C and rain"},
]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--model", MODEL, "--chat-template", str(TEMPLATE))
    yield srv
    assert srv.stop()[0] == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_tools_are_rendered_into_the_prompt(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=4)
    assert with_tools.choices[0].message.role == "assistant"
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the signatures are in the prompt
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice="none", max_tokens=4)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_tool_round_trip_is_taken_streaming_and_not(client):
    r = client.chat.completions.create(model=MODEL, messages=ROUND_TRIP, tools=[TOOL], max_tokens=4)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model=MODEL, messages=ROUND_TRIP, tools=[TOOL], max_tokens=4,
                                                 stream=True))  # fmt: skip
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_forced_call_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="not supported yet"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=4)
