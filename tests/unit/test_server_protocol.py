"""Request bodies -> typed requests, without a server."""

import pytest

from engine.server.protocol import ApiError, parse_chat, parse_completion, parse_json


def test_a_full_completion_body():
    r = parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                          "top_k": 4, "min_p": 0.1, "stop": "END", "seed": 3, "logit_bias": {"5": -100},
                          "logprobs": 2, "repetition_penalty": 1.1, "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
                          "user": "someone"})  # fmt: skip
    assert r.prompt_ids == (1, 2, 3) and r.prompt_text is None and r.max_tokens == 7
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.repetition_penalty) == (0.5, 0.9, 4, 0.1, 3, 1.1)
    assert s.logit_bias == {5: -100.0} and s.logprobs and s.top_logprobs == 2
    assert r.stop == ("END",) and r.stream and r.include_usage and r.ignore_eos and r.return_token_ids


def test_defaults_are_greedy_without_logprobs():
    r = parse_completion({"prompt": "hi"})
    assert r.prompt_text == "hi" and r.max_tokens is None and r.sampling.is_greedy
    assert not r.sampling.wants_logprobs and not r.stream and r.stop == ()


def test_a_batch_of_one_prompt_is_accepted():
    assert parse_completion({"prompt": [[4, 5]]}).prompt_ids == (4, 5)
    assert parse_completion({"prompt": ["x"]}).prompt_text == "x"


def test_chat_logprobs_and_max_completion_tokens():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9, "max_tokens": 2})  # fmt: skip
    assert r.messages == [{"role": "user", "content": "ab"}] and r.max_tokens == 9
    assert r.sampling.logprobs and r.sampling.top_logprobs == 3
    with pytest.raises(ApiError, match="top_logprobs"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})


@pytest.mark.parametrize("body", [{"prompt": "x", "temperature": True}, {"prompt": "x", "max_tokens": True},
                                  {"prompt": [1, True]}, {"prompt": "x", "top_p": float("nan")}])  # fmt: skip
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

    from engine.server.main import listen

    server = listen("127.0.0.1", 0)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        for s in (conn, client, server):
            s.close()
