"""Tools through the official openai SDK: a template that renders them (--chat-template), calls in the history.

A random-weight model does not choose to call a tool on its own: left free it is checked for taking every
form of a tool conversation; forced (tool_choice required, response_format json_schema) its replies are
checked for validity, which the grammar guarantees.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from live_server import LiveServer

MODEL = "tiny-qwen3"
TEMPLATE = Path(__file__).parent.parent / "fixtures" / "tool_template.jinja"
FIXTURES = Path(__file__).parent.parent / "fixtures" / "clients"  # requests real clients sent
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
ROUND_TRIP = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C and rain"},
]


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
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ROUND_TRIP, tools=[TOOL], max_tokens=4, stream=True)
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop", "tool_calls")


SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {"city": {"enum": ["Oslo", "Paris"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def test_a_forced_call_comes_back_as_a_valid_call_streaming_and_not(client):
    forced = dict(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=4, max_tokens=120
    )
    r = client.chat.completions.create(**forced, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    calls = {}
    for chunk in client.chat.completions.create(**forced, parallel_tool_calls=False, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert list(calls.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    several = client.chat.completions.create(**forced, parallel_tool_calls=True).choices[0].message.tool_calls
    assert several and all(jsonschema.validate(json.loads(c.function.arguments), SCHEMA) is None for c in several)
    several = client.chat.completions.create(**forced).choices[0].message.tool_calls  # one unless parallel is true
    assert len(several) == 1


def test_a_call_streams_its_name_then_fragments_of_its_arguments(client):
    forced = dict(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=4, max_tokens=120
    )
    (whole,) = client.chat.completions.create(**forced).choices[0].message.tool_calls
    entries = [
        tc
        for chunk in client.chat.completions.create(**forced, stream=True)
        for tc in chunk.choices[0].delta.tool_calls or ()
    ]
    head, fragments = entries[0], entries[1:]
    assert head.id.startswith("call_") and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(fragments) > 5 and all(f.id is None and f.function.name is None for f in fragments)
    assert "".join(f.function.arguments for f in fragments) == whole.function.arguments


@pytest.mark.parametrize("max_tokens, names", [(26, ["get_weather"]), (4, [])])
def test_a_call_cut_off_by_max_tokens_is_no_content(client, max_tokens, names):
    """Cut inside its arguments, a call keeps those written so far (as OpenAI's truncated call); cut before its
    name, nothing of it is left: in neither case does its markup come back as text for a client to replay."""
    forced = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=1.0,
        seed=4,
        max_tokens=max_tokens,
    )
    choice = client.chat.completions.create(**forced).choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "length" and not choice.message.content
    assert [c.function.name for c in calls] == names
    chunks = list(client.chat.completions.create(**forced, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(tc.function.arguments or "" for c in chunks for tc in c.choices[0].delta.tool_calls or ())
    assert streamed == "".join(c.function.arguments for c in calls)
    if calls:  # as far as it was written: an open JSON object
        assert streamed.startswith("{") and not streamed.endswith("}")


@pytest.mark.parametrize("concurrent", [1, 8])
def test_a_json_schema_reply_validates(client, concurrent):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}

    def ask(i):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"forecast {i}"}],
            response_format=fmt,
            temperature=1.0,
            seed=i,
            max_tokens=80,
        )
        return r.choices[0].message.content

    with ThreadPoolExecutor(concurrent) as pool:
        replies = list(pool.map(ask, range(concurrent)))
    for reply in replies:
        jsonschema.validate(json.loads(reply), SCHEMA)


def test_a_strict_schema_reply_holds_only_the_keys_it_lists(client):
    """instructor and pydantic send pydantic's schemas, which leave additionalProperties unsaid, with strict: true."""
    person = {
        "type": "object",
        "title": "Person",
        "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": person, "strict": True}}
    for seed in range(6):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, seed=seed, max_tokens=60
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}


FORECAST = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}


def test_with_tools_and_a_schema_a_forced_call_is_a_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        response_format=FORECAST,
        temperature=1.0,
        seed=3,
        max_tokens=120,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_with_tools_and_a_schema_the_reply_may_be_a_call_or_the_schemas_json(client):
    from tokenizers import Tokenizer

    from engine.synth import ensure_model

    opening = Tokenizer.from_file(str(ensure_model(MODEL) / "tokenizer.json")).encode("<", add_special_tokens=False)
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER], response_format=FORECAST, max_tokens=120)
    # the model pushed to open a call: only the call's alternative of the grammar takes "<"
    r = client.chat.completions.create(**ask, logit_bias={str(opening.ids[0]): 100})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    r = client.chat.completions.create(**ask, logit_bias={str(opening.ids[0]): -100})  # kept from it: the schema
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
    }
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad, max_tokens=4)


def test_constrained_replies_on_the_serial_lane():
    srv = LiveServer("--model", MODEL, "--chat-template", str(TEMPLATE), "--batch", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}

        def ask(i):
            return client.chat.completions.create(
                model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, seed=i, max_tokens=80
            )

        with ThreadPoolExecutor(8) as pool:  # 8 at once, taken one after another
            replies = list(pool.map(ask, range(8)))
        for r in replies:
            assert r.usage.model_extra["engine"]["lane"] == "serial"
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=2,
            max_tokens=120,
        )
        jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), SCHEMA)
    finally:
        assert srv.stop()[0] == 0


def test_the_artifacts_own_template_takes_tools():
    srv = LiveServer("--model", MODEL)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL,
            messages=ROUND_TRIP,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=7,
            max_tokens=120,
        )
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    finally:
        assert srv.stop()[0] == 0


@pytest.fixture(scope="module")
def trained():
    """trained-qwen3 on its own template (which renders tools and writes <tool_call> JSON blocks): a model that
    writes calls as it was trained to, repeating them where the grammar lets it."""
    srv = LiveServer("--model", "trained-qwen3")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert srv.stop()[0] == 0


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_pydantic_ais_native_output_with_a_tool(trained, choice):
    """pydantic-ai's NativeOutput beside a tool sends tools and a strict json_schema together (its request as
    captured): the reply is a valid call or the schema's JSON, and a call where one is required."""
    body = json.loads((FIXTURES / "pydantic-ai-native-output-tool.json").read_text())["body"]
    r = trained.chat.completions.create(**{**body, "tool_choice": choice})
    schema = body["response_format"]["json_schema"]["schema"]
    message, params = r.choices[0].message, body["tools"][0]["function"]["parameters"]
    if message.tool_calls or choice == "required":
        (call,) = message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
    else:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(message.content), schema)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_is_one_call_that_ends_the_reply(trained, choice):
    r = trained.chat.completions.create(
        model="trained-qwen3", messages=ASK, tools=[CITY], tool_choice=choice, max_tokens=400
    )
    (call,) = r.choices[0].message.tool_calls  # one call, not the same call until max_tokens
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 400
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
