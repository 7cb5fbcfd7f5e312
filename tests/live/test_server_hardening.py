"""The server as a hostile client and an operator would try it: every answer a 2xx or a JSON 4xx, no
request harming another, limits that hold, a start that refuses what it cannot serve."""

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, stream

from harness.run.servers import engine_serve_command, free_port

MODEL = "tiny-qwen35"
CONTEXT = 512
KEY = "sekrit"


@pytest.fixture(scope="module")
def server(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--max-context", str(CONTEXT), "--max-body-bytes", "256KiB")
    yield srv
    assert srv.stop()[0] == 0


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    return r.json()["error"]


def raw_post(server, raw: bytes, path="/v1/completions", content_type="application/json", **headers):
    return server.client.post(path, content=raw, headers={"content-type": content_type, **headers})


def greedy(server, prompt, max_tokens=8, **extra):
    r = server.client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------------------- the door


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**70)])
def test_seeds_outside_64_bits_are_refused_at_the_door(server, seed):
    err = error_of(server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": seed}), 400)
    assert err["param"] == "seed"


def test_a_bad_seed_beside_other_requests_harms_none_of_them(server):
    bodies = [
        {"prompt": [30 + i, 7, 8], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True} for i in range(6)
    ]
    alone = [greedy(server, b["prompt"], 6)["choices"][0]["token_ids"] for b in bodies]
    bad = {"prompt": "hi", "max_tokens": 4, "seed": -1, "temperature": 1.0}
    with ThreadPoolExecutor(7) as pool:
        answers = list(pool.map(lambda b: server.client.post("/v1/completions", json=b), [bad] + bodies))
    assert answers[0].status_code == 400
    assert [a.json()["choices"][0]["token_ids"] for a in answers[1:]] == alone


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion
        b'{"prompt": ' + b'{"a": ' * 30_000 + b"1" + b"}" * 30_001,
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's 4300-digit limit
        b'{"prompt": "hi \\ud800"}',  # a lone surrogate in the prompt
        b'{"prompt": "hi", "stop": ["\\udc00"]}',  # in a stop string
    ],
)
def test_bodies_the_parser_cannot_take_are_json_400s(server, raw):
    assert error_of(raw_post(server, raw), 400)["code"] in ("invalid_json", "invalid_text")


def test_a_lone_surrogate_in_chat_content_is_a_400(server):
    raw = b'{"messages": [{"role": "user", "content": "x \\ud83d y"}]}'
    assert error_of(raw_post(server, raw, "/v1/chat/completions"), 400)["code"] == "invalid_text"


def test_a_body_over_the_limit_is_refused_unread(server):
    big = json.dumps({"prompt": "a " * 200_000}).encode()  # ~400 KB against 256 KiB
    assert error_of(raw_post(server, big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(40):
            yield b" " * 10_000

    r = server.client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"


def test_a_text_prompt_far_over_the_context_is_refused_before_tokenizing(server):
    text = "word " * 40_000  # 200 KB, under the body limit; at least 200000 / (longest token) tokens
    start = time.perf_counter()
    err = error_of(server.client.post("/v1/completions", json={"prompt": text, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_posts_must_be_json(server, content_type):
    r = raw_post(server, json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), content_type=content_type)
    assert error_of(r, 415)["code"] == "unsupported_media_type"


def test_a_host_header_naming_another_site_is_refused(server):
    err = error_of(server.client.get("/v1/models", headers={"host": "attacker.example:80"}), 400)
    assert err["code"] == "invalid_host"
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:1"):
        assert server.client.get("/health", headers={"host": host}).status_code == 200


def exchange(server, raw: bytes, wait: float = 5.0) -> tuple[bytes, bool]:
    """Raw bytes to the server over a socket of their own: (all it answered, whether it closed the connection)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        try:
            s.sendall(raw)
        except OSError:  # the server closed early; its answer is still there to read
            pass
        answer = b""
        try:
            while chunk := s.recv(1 << 16):
                answer += chunk
        except TimeoutError:
            return answer, False
    return answer, True


def test_content_length_with_transfer_encoding_is_a_400_that_closes_the_connection(server):
    # the bytes after the chunked body would be a second request (GET /stats) on a connection kept open
    smuggled = b"GET /stats HTTP/1.1\r\nHost: localhost\r\n\r\n"
    answer, closed = exchange(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
    )
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1 and b'"ambiguous_framing"' in answer
    assert closed


@pytest.mark.parametrize("size", [40_000, 100_000, 1_000_000])
def test_a_request_head_over_the_limit_is_a_431_that_closes_the_connection(server, size):
    answer, closed = exchange(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'"request_header_fields_too_large"' in answer and closed


def test_a_head_within_the_limit_is_served(server):
    answer, _ = exchange(
        server, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 30_000 + b"\r\n\r\n", 1.0
    )
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_http_1_0_without_a_host_is_served(server):
    answer, closed = exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer, answer[:300]
    assert closed  # HTTP/1.0 without keep-alive: one request a connection


# arbitrary bodies against the live server; max_tokens kept small where it is a valid count
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "logit_bias",
        "logprobs",
        "stream",
        "n",
        "model",
        "ignore_eos",
        "bogus",
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(_fields, _values, max_size=6),
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    st.integers(1, 3),
)
def test_fuzzed_bodies_get_a_2xx_or_a_json_4xx(server, body, path, max_tokens):
    if not isinstance(body.get("max_tokens"), bool) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = max_tokens
    body.setdefault("max_tokens", max_tokens)
    try:
        raw = json.dumps(body).encode()
    except ValueError:  # NaN and infinities are not JSON
        return
    with server.client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        r.read()
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_after_the_fuzz_a_reference_request_gives_the_same_ids(server):
    first = greedy(server, [3, 1, 4, 1, 5], 8)["choices"][0]["token_ids"]
    test_fuzzed_bodies_get_a_2xx_or_a_json_4xx(server)
    assert greedy(server, [3, 1, 4, 1, 5], 8)["choices"][0]["token_ids"] == first


# --------------------------------------------------------------------------------------- the engine


def test_a_stop_string_ends_as_a_stop_with_the_same_count_every_time(server):
    ids = greedy(server, "The quick brown fox", 24)["choices"][0]["token_ids"]
    text_of = server.client.post(
        "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True}
    ).json()["choices"][0]["text"]
    # three characters from the middle of the greedy text, starting at a visible one
    middle = next(i for i in range(len(text_of) // 2, len(text_of)) if not text_of[i].isspace())
    stop = text_of[middle : middle + 3]
    assert stop.strip(), f"no visible text to stop on in {text_of!r}"
    before = server.stats()["totals"]
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "ignore_eos": True,
        "stop": [stop],
        "stream_options": {"include_usage": True},
    }
    counts = set()
    for _ in range(5):
        plain = server.client.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"})
        usage = plain.json()["usage"]
        assert plain.json()["choices"][0]["finish_reason"] == "stop" and usage["engine"]["finish"] == "stop"
        counts.add(usage["completion_tokens"])
        events, done = stream(server.client, "/v1/completions", body)
        assert done and events[-1]["usage"]["engine"]["finish"] == "stop"
        counts.add(events[-1]["usage"]["completion_tokens"])
    assert len(counts) == 1 and counts.pop() < len(ids)
    time.sleep(0.3)  # the engine records the ends after the responses
    after = server.stats()["totals"]
    assert after["cancelled"] == before["cancelled"] and after["completed"] - before["completed"] >= 10


def test_a_non_streaming_client_that_leaves_frees_its_row(server):
    before = server.stats()["totals"]["cancelled"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "go on", "max_tokens": 400, "ignore_eos": True}, timeout=0.5
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["batch"]["live_requests"] == 0 and stats["totals"]["cancelled"] > before:
            break
        time.sleep(0.1)
    assert stats["batch"]["live_requests"] == 0 and stats["totals"]["cancelled"] == before + 1


def test_metrics_in_prometheus_text_with_vllm_names(server):
    greedy(server, [5, 6, 7], 4)
    r = server.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_sum",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        'engine:requests_total{end="completed"',
    ):
        assert name in text, name

    def generated() -> float:
        text = server.client.get("/metrics").text
        return float(
            next(line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")).split()[-1]
        )

    # both read the engine's snapshot, which follows the step that ended a request
    deadline = time.monotonic() + 5
    while generated() != server.stats()["totals"]["completion_tokens"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert generated() == server.stats()["totals"]["completion_tokens"]


# ------------------------------------------------------------------------------------------ operators


@pytest.fixture(scope="module")
def keyed(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--batch", "1", "--max-queued-requests", "2", api_key=KEY)
    yield srv
    assert srv.stop()[0] == 0


def test_stats_and_metrics_need_the_key_health_does_not(keyed):
    bare = httpx.Client(base_url=keyed.url, timeout=10)
    for path in ("/stats", "/metrics", "/v1/models"):
        assert error_of(bare.get(path), 401)["code"] == "invalid_api_key"
    assert bare.get("/health").status_code == 200
    assert keyed.client.get("/stats").status_code == 200


def test_a_full_queue_answers_503_with_retry_after(keyed):
    body = {"prompt": [9, 9, 9], "max_tokens": 120, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: keyed.client.post("/v1/completions", json=body), range(8)))
    full = [a for a in answers if a.status_code == 503]
    assert full and all(a.json()["error"]["code"] == "queue_full" and a.headers["retry-after"] for a in full)
    assert all(a.status_code in (200, 503) for a in answers) and any(a.status_code == 200 for a in answers)
    assert keyed.stats()["totals"]["rejected"] >= len(full)


def test_a_list_of_prompts_past_the_queue_is_refused_whole(keyed):
    # 5 prompts, a queue of 2: a 503, and the prompts the engine took leave with it, cancelled (not completed)
    before = keyed.stats()["totals"]
    r = keyed.client.post("/v1/completions", json={"prompt": [[9, 9, 9]] * 5, "max_tokens": 200, "ignore_eos": True})
    assert error_of(r, 503)["code"] == "queue_full"
    deadline = time.monotonic() + 60
    while True:  # /stats is refreshed between engine steps: wait for the five to be counted
        stats = keyed.stats()
        totals = stats["totals"]
        gone = totals["rejected"] - before["rejected"] + totals["cancelled"] - before["cancelled"]
        if (gone >= 5 and not stats["batch"]["live_requests"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert gone == 5 and totals["rejected"] > before["rejected"]
    assert stats["batch"]["live_requests"] == stats["batch"]["pending_rows"] == 0


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = engine_serve_command(["--model", MODEL], free_port(), *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_a_port_in_use_is_one_line_before_loading(tiny_path):
    tiny_path(MODEL)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "engine", "serve", "--model", MODEL, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2 and "cannot listen on" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert time.perf_counter() - start < 20  # no model was loaded first


def test_kv_bits_the_model_cannot_take_refuse_to_start(tiny_path):
    tiny_path("tiny-qwen3")  # head dim 16: no 64-value groups
    done = subprocess.run(
        engine_serve_command(["--model", "tiny-qwen3"], free_port(), "--kv-bits", "4"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "cannot be served with --kv-bits 4" in done.stderr, done.stderr
    assert "ready" not in done.stdout


def test_health_says_loading_until_the_model_is_warm(tiny_path):
    tiny_path(MODEL)
    port = free_port()
    proc = subprocess.Popen(
        engine_serve_command(["--model", MODEL], port), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:  # the loading thread holds the interpreter much of the time: answers can be slow
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            loading = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10)
            assert loading.status_code in (200, 503)
            if loading.status_code == 503:
                assert loading.json()["error"]["code"] == "loading"
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert seen[-1] == (200, "ok") and (503, "loading") in seen


# --------------------------------------------------------------------------------------------- load


@pytest.fixture(scope="module")
def pair(tiny_path):
    tiny_path(MODEL)
    batched = LiveServer("--model", MODEL, "--batch", "64", "--max-queued-requests", "0")
    serial = LiveServer("--model", MODEL, "--batch", "1")
    yield batched, serial
    assert [batched.stop()[0], serial.stop()[0]] == [0, 0]


def test_64_concurrent_for_3_rounds_equal_the_serial_lane(pair):
    batched, serial = pair
    bodies = [
        {"prompt": [200 + i, 3 + i % 5, 11], "max_tokens": 4 + i % 7, "ignore_eos": True, "return_token_ids": True}
        for i in range(64)
    ]

    def ids(server, body):
        r = server.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    want = [ids(serial, b) for b in bodies]
    with ThreadPoolExecutor(64) as pool:
        for _ in range(3):
            assert list(pool.map(lambda b: ids(batched, b), bodies)) == want
