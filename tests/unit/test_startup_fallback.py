"""`harness startup` where the default server cannot start beside the serial one (one device too small for both)."""

from pathlib import Path

from harness.bench import startup
from harness.run.servers import ServerStartError


class FakeServer:
    def __init__(self, command, alive):
        self.command, self.url, self.load_to_ready_s, self.alive = command, "http://127.0.0.1:9", 1.0, alive

    def __enter__(self):
        self.alive.append(self)
        return self

    def __exit__(self, *exc):
        self.alive.remove(self)


def test_the_default_server_starts_alone_when_it_cannot_start_beside_the_serial_one(monkeypatch, tmp_path):
    alive, commands = [], []

    def start_server(cmd, port, **kwargs):
        commands.append(cmd)
        if "--batch" not in cmd and alive:  # the default server, the serial one running
            raise ServerStartError("engine serve exited with 2: out of memory")
        return FakeServer(cmd, alive)

    monkeypatch.setattr(startup, "start_server", start_server)
    monkeypatch.setattr(startup, "server_stats", lambda client: {})
    monkeypatch.setattr(startup, "server_memory", lambda client: {})
    monkeypatch.setattr(
        startup, "_send", lambda client, prompts, tokens, label, timeouts: startup.Requests(label, len(prompts))
    )
    cfg = startup.StartupConfig(bursts=(2,), rounds=2)
    result = startup.measure("m", tmp_path, 100, cfg)

    assert [s.label for s in result.starts] == ["serial (--batch 1)", "start", "restart"]
    assert result.lone is None and not alive  # no lone rounds; every server stopped
    assert len(result.errors) == 1 and "did not start beside the serial one" in result.errors[0]
    caches = [cmd[cmd.index("--kernel-cache-dir") + 1] for cmd in commands]
    # the default server's second try starts cold on a fresh kernel cache, which the restart then reuses
    assert caches[2] != caches[1] and caches[3] == caches[2] == result.kernel_cache_dir
    assert Path(caches[2]).is_dir()
