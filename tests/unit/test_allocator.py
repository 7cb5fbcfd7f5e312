"""engine serve's allocator: when it runs itself again with mimalloc preloaded, and that the library loads."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine import allocator

LIB = allocator.mimalloc_path()


def test_auto_preloads_mimalloc_once_before_what_was_preloaded():
    env = allocator.preload_env("auto", LIB or Path("/lib/libmimalloc.so"), {"LD_PRELOAD": "/x.so", "A": "1"})
    assert env["LD_PRELOAD"].split(":")[1:] == ["/x.so"] and "libmimalloc.so" in env["LD_PRELOAD"].split(":")[0]
    assert env["A"] == "1" and env[allocator.MARK] == "1" and env[allocator.PURGE] == "0"  # freed pages back at once
    assert allocator.preload_env("auto", Path("/m.so"), {allocator.PURGE: "50"})[allocator.PURGE] == "50"  # as given
    assert allocator.preload_env("auto", Path("/lib/libmimalloc.so"), env) is None  # the process run again


def test_system_and_a_missing_library():
    path = Path("/lib/libmimalloc.so")
    assert allocator.preload_env("system", path, {}) is None
    assert allocator.preload_env("auto", None, {}) is None
    with pytest.raises(ValueError, match="cmeel-mimalloc"):
        allocator.preload_env("mimalloc", None, {})
    with pytest.raises(ValueError, match="allocator must be one of"):
        allocator.preload_env("jemalloc", path, {})


@pytest.mark.skipif(LIB is None or not sys.platform.startswith("linux"), reason="mimalloc not installed here")
def test_the_preloaded_library_is_the_allocator_a_process_runs_on():
    code = "from engine import allocator; print(allocator.loaded())"
    env = allocator.preload_env("mimalloc", LIB, {"PATH": "/usr/bin:/bin"})
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "mimalloc"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == allocator.loaded()


def test_a_call_to_main_never_runs_itself_again(monkeypatch):
    # main(argv) from Python (tests, embedding) must not replace the caller's process
    from engine import cli

    calls = []
    monkeypatch.setattr(cli, "reexec", lambda *a: calls.append(a))
    monkeypatch.setattr(cli, "cmd_serve", lambda args: 0)  # the parser built inside main takes this one
    assert cli.main(["serve", "--model", "tiny-qwen35"]) == 0 and calls == []
