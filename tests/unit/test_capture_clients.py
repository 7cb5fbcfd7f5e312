"""tools.capture_clients: a request passes through unchanged, SSE included, and its log line is what was sent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
# `tools/` is run from the checkout, not installed: loaded from its file.
_spec = importlib.util.spec_from_file_location("capture_clients", ROOT / "tools" / "capture_clients.py")
capture_clients = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capture_clients)

EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"]


async def completions(request: Request):
    body = await request.json()
    if body.get("echo"):
        return JSONResponse({"error": {"message": "echo is not supported"}}, 400)

    async def events():
        for event in EVENTS:
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


def make_proxy(tmp_path) -> tuple[TestClient, object]:
    upstream = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    log = tmp_path / "captured.jsonl"
    app = capture_clients.make_app("http://upstream", log, transport=httpx.ASGITransport(app=upstream))
    return TestClient(app), log


def test_a_stream_passes_through_unchanged_and_the_request_is_logged_without_its_key(tmp_path):
    client, log = make_proxy(tmp_path)
    body = {"prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True}}
    with client:
        r = client.post("/v1/completions?x=1", json=body, headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(EVENTS)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (record["method"], record["path"], record["query"]) == ("POST", "/v1/completions", "x=1")
    assert record["status"] == 200
    assert record["body"] == body
    assert "authorization" not in record["headers"] and "secret" not in log.read_text()


def test_a_refusal_is_passed_on_and_logged_with_its_reason(tmp_path):
    client, log = make_proxy(tmp_path)
    with client:
        r = client.post("/v1/completions", json={"prompt": "x", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "echo is not supported"
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["status"] == 400 and record["response"]["error"]["message"] == "echo is not supported"
