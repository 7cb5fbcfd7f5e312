"""What real clients send, against a live server: vLLM's stream options (guidellm), echo with logprobs and
lists of prompts (lm-eval), the fields of OpenAI's and vLLM's request schemas (agent SDKs), min_tokens and
stop_token_ids. Requests captured from the clients themselves are in tests/fixtures/clients/."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from live_server import LiveServer, stream

from engine.loading import load_model
from engine.prompt_logprobs import log_softmax

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL)
    yield srv
    assert srv.stop()[0] == 0


def post(server, path: str, body: dict) -> dict:
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_on_every_chunk_with_vllms_continuous_usage_stats(server):
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    events, done = stream(
        server.client,
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "stream_options": options},
    )
    assert done
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events)
    assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["usage"]["completion_tokens"] == 5
    assert events[-1]["usage"]["engine"]["ignored_fields"] == ["stream_options.include_obfuscation"]


def test_echo_logprobs_are_the_log_softmax_of_the_engines_logits(server, tiny_path):
    prompt = [11, 402, 77, 1234, 9, 56, 300, 12]
    body = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    model = load_model(tiny_path(MODEL))[0]
    want = log_softmax(model.logits(model.hidden(mx.array(prompt[:-1])[None], model.make_cache()))[0])
    assert logprobs["token_logprobs"][1:] == [want[i, t].item() for i, t in enumerate(prompt[1:])]  # bit for bit
    assert [max(top.values()) for top in logprobs["top_logprobs"][1:]] == mx.max(want, axis=-1).tolist()
    assert choice["text"] == "".join(logprobs["tokens"])


def test_echo_leads_the_generated_text_and_its_logprobs(server):
    body = post(
        server,
        "/v1/completions",
        {"prompt": "The fox", "echo": True, "logprobs": 0, "max_tokens": 3, "ignore_eos": True},
    )
    choice, n = body["choices"][0], body["usage"]["prompt_tokens"]
    assert choice["text"].startswith("The fox") and len(choice["logprobs"]["tokens"]) == n + 3
    assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])
    events, _ = stream(server.client, "/v1/completions", {"prompt": "The fox", "echo": True, "max_tokens": 2})
    assert events[0]["choices"][0]["text"] == "The fox"


@pytest.mark.parametrize("prompts", [["The quick", "brown fox jumps", "over"], [[5, 6, 7], [8, 9], [10, 11, 12, 13]]])
def test_a_list_of_prompts_is_a_choice_each_from_one_batch(server, prompts):
    body = {"prompt": prompts, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    got = post(server, "/v1/completions", body)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    alone = [post(server, "/v1/completions", {**body, "prompt": p})["choices"][0] for p in prompts]
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in alone]  # greedy, each its own
    assert got["usage"]["completion_tokens"] == 12
    events, done = stream(server.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    by_index = {
        i: [t for e in events if e["choices"] and e["choices"][0]["index"] == i for t in e["choices"][0]["token_ids"]]
        for i in range(3)
    }
    assert done and [by_index[i] for i in range(3)] == [c["token_ids"] for c in alone]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_the_rows_of_a_list_of_prompts_decode_together(server):
    body = post(server, "/v1/completions", {"prompt": ["a b c"] * 4, "max_tokens": 8, "ignore_eos": True})
    assert body["usage"]["engine"]["batch_size"] > 1


def test_min_tokens_holds_the_end_back(server):
    base = {"prompt": [5, 6, 7], "max_tokens": 6, "return_token_ids": True}
    first = post(server, "/v1/completions", base)["choices"][0]["token_ids"][0]
    # the first greedy token made an end token: the reply ends at once, unless min_tokens holds it back
    ended = post(server, "/v1/completions", {**base, "stop_token_ids": [first]})["choices"][0]
    assert ended["token_ids"] == [] and ended["finish_reason"] == "stop"
    held = post(server, "/v1/completions", {**base, "stop_token_ids": [first], "min_tokens": 3})["choices"][0]
    assert len(held["token_ids"]) >= 3 and first not in held["token_ids"][:3]


def test_fields_of_openai_and_vllm_are_ignored_by_name_typos_refused(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    extra = {
        "reasoning_effort": "low",
        "verbosity": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "modalities": ["text"],
        "prediction": None,
        "skip_special_tokens": True,
    }
    got = post(server, "/v1/chat/completions", {**chat, **extra})
    assert got["usage"]["engine"]["ignored_fields"] == sorted(extra)
    r = server.client.post("/v1/chat/completions", json={**chat, "max_token": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"


def test_the_readmes_curl_examples_send_json(server):
    """The README's examples carry the JSON content type: a form post (curl -d alone) is refused with 415."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    curls = [line for line in readme.splitlines() if line.lstrip().startswith("curl ")]
    assert curls and all("-H 'Content-Type: application/json'" in line for line in curls)
    r = server.client.post(
        "/v1/completions",
        content=json.dumps({"prompt": "x"}),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415


# ------------------------------------------------------------------ requests captured from the clients

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "clients").glob("*.json"))


@pytest.fixture(scope="module")
def trained():
    srv = LiveServer("--model", "trained-qwen3")
    yield srv
    assert srv.stop()[0] == 0


def replay(server, capture: dict) -> dict | list[dict]:
    """The captured request again: the JSON reply, or a stream's events (ended by [DONE])."""
    body = capture["body"]
    if body.get("stream"):
        events, done = stream(server.client, capture["path"], body)
        assert done
        return events
    return post(server, capture["path"], body)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_what_the_clients_sent_is_served(trained, path):
    capture = json.loads(path.read_text())
    body, reply, name = capture["body"], replay(trained, capture), path.stem
    if name.startswith("guidellm"):  # usage on every chunk, as vLLM's continuous_usage_stats gives it
        assert all("usage" in e for e in reply) and reply[-1]["usage"]["completion_tokens"] == body.get(
            "max_tokens", body.get("max_completion_tokens")
        )
        return
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if name.startswith("lm-eval"):  # one choice per prompt; scored: the prompt, then the token generated
        assert [c["index"] for c in choices] == list(range(len(body["prompt"])))
        if body.get("echo"):  # each prompt's tokens and one more: together the prompt tokens and a token a choice
            assert sum(len(c["logprobs"]["tokens"]) - 1 for c in choices) == reply["usage"]["prompt_tokens"]
        for choice, prompt in zip(choices, body["prompt"]):
            if body.get("echo"):
                logprobs = choice["logprobs"]
                assert logprobs["token_logprobs"][0] is None
                assert isinstance(prompt, str) or len(logprobs["token_logprobs"]) == len(prompt) + 1
                # lm-eval's reading: the continuation's sum and whether each token was the greedy one
                assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:-1])
                assert all(
                    max(top.values()) >= lp
                    for top, lp in zip(logprobs["top_logprobs"][1:-1], logprobs["token_logprobs"][1:-1])
                )
        return
    message = choices[0]["message"]
    if "tool_choice" in body and body["tool_choice"] not in ("auto", "none"):
        assert len(message["tool_calls"]) == 1 and choices[0]["finish_reason"] == "tool_calls"
    if body.get("reasoning_effort"):
        assert "reasoning_effort" in reply["usage"]["engine"]["ignored_fields"]


@pytest.mark.parametrize("spelling", ["guided_json", "structured_outputs"])
def test_vllms_structured_outputs_constrain_a_completion(server, spelling):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    value = schema if spelling == "guided_json" else {"json": schema}
    got = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 32, spelling: value})
    assert json.loads(got["choices"][0]["text"]) in ({"ok": True}, {"ok": False})
