"""A real `engine serve` process on port 0, for live tests."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

import httpx

READY = re.compile(r"ready on (http://\S+)")


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, timeout: float = 120):
        cmd = [sys.executable, "-m", "engine", "serve", "--port", "0", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.url = self._wait_ready(timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def _wait_ready(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=1) and (line := self.proc.stdout.readline()):
                if m := READY.search(line):
                    return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine serve exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
        self.proc.kill()
        raise RuntimeError("engine serve did not become ready")

    def stats(self) -> dict:
        return self.client.get("/stats").json()

    def stop(self) -> tuple[int, str, str]:
        """SIGTERM, then wait: (exit code, rest of stdout, stderr)."""
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err


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
