"""Server processes for benchmarks and live tests: launch, wait until ready, stop the whole tree.

Readiness is `GET /health` answering 200 (any server with that endpoint); the
time from launch to ready is recorded. stdout and stderr go to files, never to
pipes nobody reads (a server that logs a line per request would block once a
pipe's buffer filled). Stopping sends SIGTERM, waits, then kills whatever is
left of the process tree (psutil).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import httpx
import psutil


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message carries its stderr tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_serve_command(model_args: Sequence[str], port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine", "serve", *model_args, "--port", str(port), *extra]


def tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


@dataclass
class ServerProcess:
    """A running server. `stop()` returns its exit status (None if it had to be killed)."""

    command: list[str]
    url: str
    proc: subprocess.Popen
    log_dir: Path
    load_to_ready_s: float
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / "stderr.log"

    def client(self, timeout: float = 600) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exited(self, within_s: float) -> bool:
        """Whether the process has exited or does within `within_s` (a crash takes a moment to reap)."""
        try:
            self.proc.wait(timeout=within_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, grace_s: float = 20) -> Optional[int]:
        procs = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            code = None
        for p in procs:  # children the server started, and the server itself if it hung
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if code is None:
            self.proc.wait(timeout=10)
        return code

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    command: Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 600,
    log_dir: Optional[Path] = None,
    env: Optional[dict[str, str]] = None,
    headers: Optional[dict[str, str]] = None,
    probe: Optional[dict] = None,
) -> ServerProcess:
    """Launch `command` (which must listen on `port`) and wait until GET /health answers 200.

    `probe`: a completion body that must also answer 200 (for servers whose /health
    answers before the model is loaded)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(list(command), stdout=out, stderr=err, env={**os.environ, **(env or {})},
                                start_new_session=True)  # fmt: skip
    url = f"http://{host}:{port}"
    server = ServerProcess(list(command), url, proc, log_dir, 0.0, dict(headers or {}))
    deadline = start + timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{command[0]} exited with {proc.returncode}:\n{tail(server.stderr_path)}")
        try:
            ready = httpx.get(f"{url}/health", timeout=2).status_code == 200
            if ready and probe is not None:
                left = max(deadline - time.perf_counter(), 1)
                r = httpx.post(f"{url}/v1/completions", json=probe, headers=headers, timeout=left)
                ready = r.status_code == 200
            if ready:
                server.load_to_ready_s = time.perf_counter() - start
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise ServerStartError(f"no answer from {url}/health within {timeout_s:.0f} s:\n{tail(server.stderr_path)}")
