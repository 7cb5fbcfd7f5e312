"""A logging reverse proxy: what a third-party client really sends to a server, one JSON line per request.

    python3 -m tools.capture_clients --upstream http://127.0.0.1:8000 --port 0 --log /tmp/captured.jsonl

Point the client at the printed address in place of the server's. Every request is forwarded as it came
(less its hop-by-hop headers) and its response streamed back unchanged, SSE included; the log line has the
method, path, query, headers (authorization and cookies left out), the body (parsed JSON where it is JSON),
the response status and, for a status of 400 or more, the response body, so a refusal names its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "host",
    "content-length",
}
SECRET = {"authorization", "cookie", "x-api-key", "api-key"}


def body_of(raw: bytes) -> object:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def request_record(request: Request, raw: bytes) -> dict:
    return {
        "time": time.time(),
        "method": request.method,
        "path": request.url.path,
        "query": request.url.query or None,
        "headers": {k: v for k, v in request.headers.items() if k.lower() not in SECRET},
        "body": body_of(raw),
    }


def make_app(upstream: str, log_path: Path, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The proxy's app; `transport` replaces the network (a test's ASGI upstream)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None), transport=transport)

    def append(record: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    async def forward(request: Request) -> Response:
        raw = await request.body()
        record = request_record(request, raw)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=raw
        )
        try:
            response = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as e:
            append({**record, "status": 502, "error": repr(e)})
            return Response(json.dumps({"error": {"message": f"proxy: {e!r}"}}), 502, media_type="application/json")
        record["status"] = response.status_code
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        if response.status_code >= 400:
            content = await response.aread()
            await response.aclose()
            append({**record, "response": body_of(content)})
            return Response(content, response.status_code, headers=out_headers)
        append(record)
        return StreamingResponse(
            response.aiter_raw(), response.status_code, headers=out_headers, background=BackgroundTask(response.aclose)
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port; the ready line names it")
    parser.add_argument("--log", type=Path, required=True, help="JSONL file each request is appended to")
    args = parser.parse_args(argv)
    sock = socket.socket()
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(args.upstream.rstrip("/"), args.log), log_level="warning")
    print(f"capture_clients: listening on http://{args.host}:{port} -> {args.upstream}", flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
