"""Bad input gets an OpenAI-style error and a 4xx, and the server stays up."""

import httpx
import pytest
from live_server import LiveServer

from engine.batch.kv_layout import kv_layout
from engine.loading import load_model

MODEL = "tiny-qwen35"
CONTEXT = 1024


@pytest.fixture(scope="module")
def server(tiny_path):
    # A budget that one row of up to 256 tokens fits (KV grows in 256-token steps) and 257 does not.
    budget = kv_layout(load_model(tiny_path(MODEL))[0]).row_bytes(1, 255)
    srv = LiveServer("--model", MODEL, "--max-context", str(CONTEXT), "--kv-budget", str(budget))
    yield srv
    assert srv.stop()[0] == 0


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    return err


def post(server, body, path="/v1/completions"):
    return server.client.post(path, json=body)


def test_invalid_json_and_non_object_bodies(server):
    for raw in (b"{not json", b"[1, 2]", b"", "\u00e9".encode("latin-1")):
        r = server.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert error_of(r, 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "10"),
        ("max_tokens", 1.5),
        ("temperature", "hot"),
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -3),
        ("top_k", 99999),
        ("stream", "yes"),
        ("stop", 3),
        ("stop", [""]),
        ("logit_bias", {"a": 1}),
        ("logit_bias", {"5": 1000}),
        ("logprobs", 50),
        ("seed", "x"),
        ("n", 2),
        ("stream_options", {"include_usage": True}),  # without stream
    ],
)
def test_wrong_types_and_ranges_name_the_field(server, field, value):
    err = error_of(post(server, {"prompt": "hello", field: value}), 400)
    assert err["param"] == field or field in err["message"]


def test_unknown_fields_are_refused_by_name(server):
    err = error_of(post(server, {"prompt": "hello", "max_token": 5}), 400)
    assert err["code"] == "unknown_field" and err["param"] == "max_token"


@pytest.mark.parametrize("prompt", ["", [], 5, [[1, 2], [3]], [1, "a"], None])
def test_empty_or_malformed_prompts(server, prompt):
    error_of(post(server, {"prompt": prompt}), 400)


@pytest.mark.parametrize("ids", [[5, 4096], [5, -1], [10**12]])
def test_token_ids_outside_the_vocabulary(server, ids):
    assert error_of(post(server, {"prompt": ids}), 400)["code"] == "invalid_token_id"


def test_prompts_longer_than_the_context(server):
    err = error_of(post(server, {"prompt": [7] * (CONTEXT + 5)}), 400)
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    err = error_of(post(server, {"prompt": [7] * 1000, "max_tokens": 100}), 400)
    assert err["code"] == "context_length_exceeded" and "24" in err["message"]  # the most it could ask for


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_must_be_positive(server, value):
    assert error_of(post(server, {"prompt": "x", "max_tokens": value}), 400)["param"] == "max_tokens"
    r = post(
        server, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": value}, "/v1/chat/completions"
    )
    assert error_of(r, 400)["param"] == "max_completion_tokens"


def test_unknown_model_is_404(server):
    err = error_of(post(server, {"prompt": "x", "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and MODEL in err["message"]


def test_a_request_that_can_never_fit_the_kv_budget(server):
    err = error_of(post(server, {"prompt": "x", "max_tokens": 600}), 400)
    assert err["code"] == "kv_budget_exceeded" and "--kv-budget" in err["message"]


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ],
)
def test_malformed_chat_messages(server, messages):
    error_of(post(server, {"messages": messages}, "/v1/chat/completions"), 400)


def test_unknown_routes_and_methods(server):
    assert error_of(server.client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(server.client.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_the_server_is_still_up_and_counted_the_rejections(server):
    post(server, {"prompt": "x", "max_tokens": 600})
    r = post(server, {"prompt": "still fine", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.stats()["totals"]["rejected"] >= 1
