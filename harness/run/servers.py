"""Server processes for benchmarks and live tests: launch, wait until ready, stop the whole tree.

Readiness is `GET /health` answering 200 (any server with that endpoint); the
time from launch to ready is recorded. stdout and stderr go to files, never to
pipes nobody reads (a server that logs a line per request would block once a
pipe's buffer filled). Each server leads its own process group (a terminal's
SIGINT/SIGHUP does not reach it), so the launcher must stop it on every exit
path: stopping sends SIGTERM (and SIGCONT, so a stopped process can act on
it), waits, then kills whatever is left of the process tree (psutil) and of
the server's process group (children whose parent already died).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

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


def server_stats(client: httpx.Client) -> dict:
    """An engine server's /stats ({} when it does not answer with a JSON object)."""
    try:
        r = client.get("/stats")
        stats = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # no answer, not JSON
        return {}
    return stats if isinstance(stats, dict) else {}


def server_memory(client: httpx.Client) -> dict | None:
    """An engine server's MLX memory (/stats `memory`: active, peak and cached bytes); None if it does not say."""
    memory = server_stats(client).get("memory")
    return memory if isinstance(memory, dict) else None


def since_ready(client: httpx.Client) -> dict[str, int | None]:
    """What an engine server first ran or compiled after ready, from one /stats read: forward shapes
    (`new_shapes`), the engine's kernel builds (`kernel_builds`) and the modules written to its kernel cache
    directory, MLX's and the engine's (`compiled_modules`); each None where it does not say."""
    stats = server_stats(client)
    shapes, modules = stats.get("shapes"), stats.get("compiled_modules")
    values = {
        "new_shapes": shapes.get("new_since_ready") if isinstance(shapes, dict) else None,
        "kernel_builds": shapes.get("kernel_builds_since_ready") if isinstance(shapes, dict) else None,
        "compiled_modules": modules.get("since_ready") if isinstance(modules, dict) else None,
    }
    return {k: v if isinstance(v, int) else None for k, v in values.items()}


def tail(path: Path, limit: int = 4000) -> str:
    """The last `limit` characters of a log ("" where it cannot be read), read from its last 4 x `limit` bytes
    (UTF-8 takes at most 4 a character), not the whole of a long-running server's log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4 * limit))
            return f.read().decode(errors="replace")[-limit:]
    except OSError:
        return ""


# A Python exception's last traceback line ("RuntimeError: ...") or a log record at ERROR level
_ERROR_LINE = re.compile(r"^(?:[\w.]*(?:Error|Exception): .*|.*\bERROR\b.*)$")


def first_error(path: Path, limit: int = 1 << 20) -> str | None:
    """The first line of a server's log (its last `limit` characters) that reports an error: what a server that answers
    every request with an error since then usually said when it broke (mlx-lm's server logs one request a line, so
    the tail is access lines)."""
    return next((line.strip() for line in tail(path, limit).splitlines() if _ERROR_LINE.match(line.strip())), None)


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

    def client(self, timeout: float | httpx.Timeout = 600) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def tree(self) -> list[psutil.Process]:
        if self.proc.returncode is not None:
            return []  # reaped: its pid may belong to another process by now (the group kill finds orphans)
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

    def stop(self, grace_s: float = 20) -> int | None:
        """SIGTERM, up to `grace_s` to exit, then SIGKILL to the tree and the process group. Idempotent."""
        procs = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a stopped (SIGSTOP) server cannot act on SIGTERM otherwise
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            code = None
        for p in procs:  # children the server started, and the server itself if it hung
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        # Orphans whose parent died are outside the tree but still in the group; a group's id is not
        # reused while any member lives.
        self._signal_group(signal.SIGKILL)
        if code is None:
            self.proc.wait(timeout=10)
        return code

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the server's pid
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ExternalServer:
    """A server the harness did not start (`harness run all --arm NAME=URL`): measured through its URL, with
    nothing to stop and no process to sample. `model_id`: the first model its /v1/models lists, which every
    request names (servers such as vLLM require it)."""

    url: str
    model_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    load_to_ready_s: float | None = None
    proc = None
    stderr_path = Path(os.devnull)
    alive = True

    @classmethod
    def connect(cls, url: str, timeout_s: float = 30) -> ExternalServer:
        """The server at `url`, its model id read from /v1/models; ServerStartError when it does not answer."""
        server = cls(url.rstrip("/"))
        try:
            with server.client(timeout_s) as c:
                r = c.get("/v1/models")
                r.raise_for_status()
                data = r.json().get("data") or []
        except (httpx.HTTPError, ValueError) as e:
            raise ServerStartError(f"{url}: /v1/models did not answer ({e})") from None
        server.model_id = data[0].get("id") if data and isinstance(data[0], dict) else None
        return server

    def client(self, timeout: float | httpx.Timeout = 600) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def exited(self, within_s: float) -> bool:
        return False

    def stop(self, grace_s: float = 20) -> int | None:
        return None


def start_server(
    command: Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 600,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    probe: dict | None = None,
    on_launch: Callable[[ServerProcess], None] = lambda _: None,
    spawning: Callable[[], AbstractContextManager] = nullcontext,
) -> ServerProcess:
    """Launch `command` (which must listen on `port`) and wait until GET /health answers 200.

    `probe`: a completion body that must also answer 200 (for servers whose /health
    answers before the model is loaded). `on_launch` sees the process as soon as it
    exists, so a caller can stop it on any exit path; an exception while waiting
    (a signal, Ctrl-C) stops it here before propagating. `spawning()` is entered
    around the launch and `on_launch` (a caller's `Interrupts.deferred`): a
    signal there waits until the process is known, so none is left unstopped."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    server = None
    try:
        with spawning():
            with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
                proc = subprocess.Popen(
                    list(command), stdout=out, stderr=err, env={**os.environ, **(env or {})}, start_new_session=True
                )
            server = ServerProcess(list(command), f"http://{host}:{port}", proc, log_dir, 0.0, dict(headers or {}))
            on_launch(server)
        _wait_ready(server, start, timeout_s, probe)
    except BaseException:
        if server is not None:
            server.stop(grace_s=2)
        raise
    server.load_to_ready_s = time.perf_counter() - start
    return server


def _wait_ready(server: ServerProcess, start: float, timeout_s: float, probe: dict | None) -> None:
    url, proc, deadline = server.url, server.proc, start + timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{server.command[0]} exited with {proc.returncode}:\n{tail(server.stderr_path)}")
        try:
            ready = httpx.get(f"{url}/health", timeout=2).status_code == 200
            if ready and probe is not None:
                left = max(deadline - time.perf_counter(), 1)
                r = httpx.post(f"{url}/v1/completions", json=probe, headers=server.headers, timeout=left)
                ready = r.status_code == 200
            if ready:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ServerStartError(f"no answer from {url}/health within {timeout_s:.0f} s:\n{tail(server.stderr_path)}")
