"""A real `engine serve` process: endpoints, streaming, usage, the prompt cache, disconnects, shutdown."""

import time

import httpx
import pytest
from live_server import LiveServer, stream

from engine.engine import Engine
from harness.run.servers import tail

MODEL = "tiny-qwen35"
KEY = "sekret"


@pytest.fixture(scope="module")
def server(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--max-context", "512", api_key=KEY)
    yield srv
    code, out, err = srv.stop()
    assert code == 0, err[-2000:]
    assert out.splitlines()[0].startswith(f"engine serve: ready on http://127.0.0.1:{srv.port} (model {MODEL}")
    assert out.splitlines()[-1] == "engine serve: stopped"


@pytest.fixture(scope="module")
def engine(tiny_path):
    return Engine.load(model_path=tiny_path(MODEL))


def complete(server, **body):
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_models_and_stats(server):
    assert server.client.get("/health").json()["status"] == "ok"
    models = server.client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    stats = server.stats()
    assert stats["batch"]["max_rows"] == 8 and stats["batch"]["mode"] == "continuous"
    assert {"active_rows", "pending_rows", "kv_bytes", "kv_budget_bytes"} <= set(stats["batch"])
    assert stats["batch"]["prefill_pacing"] is None  # the exact tier's default: off
    assert {"entries", "bytes", "hits"} <= set(stats["prompt_cache"])
    assert {"requests", "completed", "prompt_tokens", "completion_tokens"} <= set(stats["totals"])


def test_greedy_tokens_equal_the_engine_in_process(server, engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again")
    out = complete(server, prompt=prompt, max_tokens=24, temperature=0, return_token_ids=True, ignore_eos=True)
    expected = [t.token_id for t in engine.generate(prompt, max_tokens=24, ignore_eos=True)]
    assert out["choices"][0]["token_ids"] == expected
    assert out["choices"][0]["text"] == engine.tokenizer.decode(expected)


def test_text_and_token_id_prompts_agree(server, engine):
    text = "Alpha beta gamma delta epsilon"
    ids = engine.tokenizer.encode(text)
    by_text = complete(server, prompt=text, max_tokens=8, return_token_ids=True, ignore_eos=True)
    by_ids = complete(server, prompt=ids, max_tokens=8, return_token_ids=True, ignore_eos=True)
    assert by_text["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]
    assert by_text["usage"]["prompt_tokens"] == len(ids)


def test_usage_fields_and_the_engine_extension(server):
    out = complete(server, prompt="usage check one two", max_tokens=5, ignore_eos=True)
    u = out["usage"]
    assert (u["completion_tokens"], u["total_tokens"]) == (5, u["prompt_tokens"] + 5)
    assert u["prompt_tokens_details"]["cached_tokens"] >= 0
    ext = u["engine"]
    assert ext["lane"] == "continuous" and ext["batch_size"] >= 1 and ext["finish"] == "length"
    t = ext["timings_ms"]
    assert set(t) == {"queue", "prefill", "first_token", "decode", "total"}
    assert all(v is not None and v >= 0 for v in t.values())
    assert t["total"] >= t["first_token"] >= t["prefill"]
    assert out["choices"][0]["finish_reason"] == "length"


def test_streaming_completion_matches_the_non_streaming_one(server):
    body = {"prompt": "streaming is the same text", "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    whole = complete(server, **body)
    events, done = stream(server.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert done
    chunks = [e for e in events if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


def test_streaming_without_include_usage_sends_no_usage(server):
    events, done = stream(server.client, "/v1/completions", {"prompt": "no usage", "max_tokens": 3})
    assert done and all("usage" not in e for e in events)


def test_chat_completion_and_chat_stream(server, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    r = server.client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 10, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion"
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant"
    prompt = engine.tokenizer.apply_chat_template(messages)
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    expected = [t.token_id for t in engine.generate(prompt, max_tokens=10, ignore_eos=True)]
    assert whole["choices"][0]["token_ids"] == expected and msg["content"] == engine.tokenizer.decode(expected)
    events, done = stream(
        server.client, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "ignore_eos": True}
    )
    assert done and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == msg["content"]


def test_logprobs_in_both_shapes(server):
    out = complete(server, prompt="log probs please", max_tokens=4, logprobs=3, ignore_eos=True)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(d) <= 3 and x <= 0 for d, x in zip(lp["top_logprobs"], lp["token_logprobs"]))
    r = server.client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        },
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


def test_stop_strings_end_the_output_before_the_stop_text(server, engine):
    base = complete(server, prompt="stop here test", max_tokens=12, ignore_eos=True, return_token_ids=True)
    ids = base["choices"][0]["token_ids"]
    stop_text = engine.tokenizer.decode(ids[4:6])
    out = complete(server, prompt="stop here test", max_tokens=12, ignore_eos=True, stop=[stop_text])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert stop_text not in out["choices"][0]["text"]
    assert base["choices"][0]["text"].startswith(out["choices"][0]["text"])


def test_seeded_sampling_repeats(server):
    body = {
        "prompt": "sampled text",
        "max_tokens": 10,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    a, b = complete(server, **body), complete(server, **body)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_a_repeated_prompt_reports_cached_tokens(server, engine):
    prompt = engine.tokenizer.encode("a long shared system prompt that many requests repeat word for word " * 3)
    first = complete(server, prompt=prompt, max_tokens=6, ignore_eos=True, return_token_ids=True)
    second = complete(server, prompt=prompt, max_tokens=6, ignore_eos=True, return_token_ids=True)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert server.stats()["prompt_cache"]["hits"] >= 1


def test_requests_sharing_a_long_system_prompt_reuse_its_last_block(server, engine):
    # tiny-qwen35 is a hybrid model (context 512): its DeltaNet state is kept every 256 prompt tokens
    # (--prompt-cache-block), so a 300-token shared prefix serves 256
    system = engine.tokenizer.encode("you are one agent of many; follow the shared instructions. " * 40)[:300]
    tails = [engine.tokenizer.encode(" task one"), engine.tokenizer.encode(" another task, two")]
    first, second = (complete(server, prompt=system + t, max_tokens=4, ignore_eos=True) for t in tails)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 256
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert server.stats()["prompt_cache"]["block_hits"] >= 1


def wait_idle(server, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = server.stats()["batch"]
        if batch["active_rows"] == batch["pending_rows"] == batch["live_requests"] == 0:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"rows leaked: {server.stats()}")


def test_a_client_that_disconnects_mid_stream_has_its_row_cancelled(server):
    before = server.stats()["totals"]["cancelled"]
    body = {"prompt": "a very long answer", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leave mid-stream: closing the response drops the connection
    batch = wait_idle(server)
    assert batch["kv_bytes"] == 0
    assert server.stats()["totals"]["cancelled"] == before + 1
    assert complete(server, prompt="still serving", max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_one_log_line_per_request(server):
    out = complete(server, prompt="log me", max_tokens=3)
    time.sleep(0.2)
    lines = [x for x in tail(server.server.stderr_path, 100_000).splitlines() if out["id"] in x]
    assert len(lines) == 1
    for field in (
        "lane=continuous",
        "prompt=",
        "completion=3",
        "cached=",
        "batch=",
        "queue=",
        "prefill=",
        "ttft=",
        "decode=",
        "total=",
        "finish=length",
    ):
        assert field in lines[0], field


def test_wrong_or_missing_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
