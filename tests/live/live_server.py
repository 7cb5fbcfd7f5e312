"""`engine serve` processes for live tests, launched through the harness's launcher (port picked free)."""

from __future__ import annotations

import json

import httpx

from harness.run.servers import engine_serve_command, free_port, start_server, tail


class LiveServer:
    def __init__(self, *args: str, api_key: str | None = None):
        self.port = free_port()
        extra = ["--api-key", api_key] if api_key else []
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = engine_serve_command(list(args), self.port, *extra)
        self.server = start_server(cmd, self.port, timeout_s=180, headers=headers)
        self.url = self.server.url
        self.client = self.server.client(timeout=120)

    def stats(self) -> dict:
        return self.client.get("/stats").json()

    def stop(self) -> tuple[int | None, str, str]:
        """SIGTERM, then wait: (exit status, stdout, stderr)."""
        self.client.close()
        code = self.server.stop()
        return code, tail(self.server.stdout_path, 100_000), tail(self.server.stderr_path, 100_000)


def stream(client: httpx.Client, path: str, body: dict) -> tuple[list[dict], bool]:
    """POST with stream: true; (the JSON events, whether `data: [DONE]` ended the stream)."""
    events, done = [], False
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            assert not done, "event after [DONE]"
            events.append(json.loads(payload))
    return events, done
