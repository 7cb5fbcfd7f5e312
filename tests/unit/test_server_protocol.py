"""Request bodies -> typed requests, without a server."""

import json

import pytest

from engine.server.protocol import ApiError, parse_chat, parse_completion, parse_json


def test_a_full_completion_body():
    r = parse_completion(
        {
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "min_p": 0.1,
            "stop": "END",
            "seed": 3,
            "logit_bias": {"5": -100},
            "logprobs": 2,
            "repetition_penalty": 1.1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
            "user": "someone",
        }
    )
    assert r.prompts == ((1, 2, 3),) and r.max_tokens == 7 and r.ignored == ("user",)
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.repetition_penalty) == (0.5, 0.9, 4, 0.1, 3, 1.1)
    assert s.logit_bias == {5: -100.0} and s.logprobs and s.top_logprobs == 2
    assert r.stop == ("END",) and r.stream and r.include_usage and r.ignore_eos and r.return_token_ids


def test_defaults_are_greedy_without_logprobs():
    r = parse_completion({"prompt": "hi"})
    assert r.prompts == ("hi",) and r.max_tokens is None and r.sampling.is_greedy
    assert not r.sampling.wants_logprobs and not r.stream and r.stop == ()


def test_a_batch_of_one_prompt_is_accepted():
    assert parse_completion({"prompt": [[4, 5]]}).prompts == ((4, 5),)
    assert parse_completion({"prompt": ["x"]}).prompts == ("x",)


def test_a_list_of_prompts_is_a_choice_each_in_order():
    assert parse_completion({"prompt": ["a", "b", "c"]}).prompts == ("a", "b", "c")
    assert parse_completion({"prompt": [[1, 2], [3]]}).prompts == ((1, 2), (3,))
    assert parse_completion({"prompt": ["a", [3]]}).prompts == ("a", (3,))
    for prompt in ([], ["a", ""], [[1], []], [["a"]], ["a"] * 257):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": prompt})
        assert e.value.status == 400 and e.value.param == "prompt"


def test_echo_takes_max_tokens_0_and_logprobs_but_not_when_streamed():
    r = parse_completion({"prompt": "x y", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.echo and r.max_tokens == 0 and r.sampling.top_logprobs == 1
    with pytest.raises(ApiError, match="at least 1"):
        parse_completion({"prompt": "x", "max_tokens": 0})
    with pytest.raises(ApiError, match="stream: false"):
        parse_completion({"prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    assert parse_completion({"prompt": "x", "echo": True, "stream": True}).echo


def test_stream_options_of_vllm_and_openai():
    r = parse_completion(
        {
            "prompt": "x",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False},
        }
    )
    assert r.include_usage and r.continuous_usage and r.ignored == ("stream_options.include_obfuscation",)
    with pytest.raises(ApiError, match="unknown stream_options"):
        parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usag": True}})


def test_fields_of_openai_and_vllm_are_honoured_or_ignored_by_name_and_others_refused():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    r = parse_chat(
        {
            **chat,
            "reasoning_effort": "low",
            "verbosity": "low",
            "prompt_cache_key": "k",
            "safety_identifier": "s",
            "modalities": ["text"],
            "prediction": None,
            "skip_special_tokens": True,
            "min_tokens": 3,
            "stop_token_ids": [7, 9],
        }
    )
    assert r.ignored == (
        "modalities",
        "prediction",
        "prompt_cache_key",
        "reasoning_effort",
        "safety_identifier",
        "skip_special_tokens",
        "verbosity",
    )
    assert r.min_tokens == 3 and r.stop_token_ids == (7, 9)
    with pytest.raises(ApiError, match=r"unknown field\(s\): max_token$") as e:
        parse_chat({**chat, "max_token": 5})
    assert e.value.param == "max_token"
    for bad in ({"min_tokens": -1}, {"stop_token_ids": [1, "2"]}, {"stop_token_ids": 3}):
        with pytest.raises(ApiError):
            parse_chat({**chat, **bad})


def test_chat_logprobs_and_max_completion_tokens():
    r = parse_chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "logprobs": True,
            "top_logprobs": 3,
            "max_completion_tokens": 9,
            "max_tokens": 2,
        }
    )
    assert r.messages == [{"role": "user", "content": "ab"}] and r.max_tokens == 9
    assert r.sampling.logprobs and r.sampling.top_logprobs == 3
    with pytest.raises(ApiError, match="top_logprobs"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": True},
        {"prompt": "x", "max_tokens": True},
        {"prompt": [1, True]},
        {"prompt": "x", "top_p": float("nan")},
    ],
)
def test_json_booleans_are_not_numbers(body):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400


def test_prompt_fields_belong_to_their_endpoint():
    with pytest.raises(ApiError, match="unknown field"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt": "y"})
    with pytest.raises(ApiError, match="unknown field"):
        parse_completion({"prompt": "y", "messages": []})


def test_error_bodies_have_the_openai_shape():
    with pytest.raises(ApiError) as e:
        parse_json(b"[")
    body = e.value.body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_json" and body["message"]


def test_accepted_connections_have_nagle_off():
    """Without TCP_NODELAY a kept-alive SSE stream arrives in ~40 ms bursts (Nagle + delayed ACKs)."""
    import socket

    from engine.server.http_edges import listen

    server = listen("127.0.0.1", 0)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        for s in (conn, client, server):
            s.close()


def test_vllms_structured_output_spellings_are_the_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra in (
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
        {"structured_outputs": {"json": schema}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    ):
        assert parse_completion({"prompt": "x", **extra}).json_schema == schema
        assert parse_chat({"messages": [{"role": "user", "content": "x"}], **extra}).json_schema == schema
    assert parse_completion({"prompt": "x", "structured_outputs": {"json_object": True}}).json_schema == {
        "type": "object"
    }
    for bad in (
        {"structured_outputs": {"regex": "a+"}},
        {"guided_json": "not json"},
        {"guided_json": schema, "response_format": {"type": "json_object"}},
    ):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "x", **bad})
        assert e.value.status == 400
