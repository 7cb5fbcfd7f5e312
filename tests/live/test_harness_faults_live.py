"""`harness run all` under faults, with real servers on a tiny model: SIGTERM, SIGHUP and SIGINT to the
harness, kill -9 and SIGSTOP to an arm's server, a server that sends malformed SSE. Each is recorded, leaves
no process behind (psutil), and the database export equals the JSON companion.

Run as a script, this file is the fake server of the malformed-SSE case:

    python test_harness_faults_live.py --port N [--malformed 5,6]

It answers /health, and /v1/completions with a well-formed SSE stream, except for the completion requests
numbered in --malformed (counting from 1), which get a cut-off JSON event and a line on stderr.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from processes import TAG, leftovers, new_tag

from harness.report.db_export import export_run, kept_by_db
from harness.run.arms import ArmSpec, standard_arms
from harness.run.records import open_db
from harness.run.runner import Block, Runner, RunSettings
from harness.run.workloads import WorkloadSettings, phase_names

MODEL = "tiny-qwen3"
THIS = Path(__file__).resolve()
SETTINGS = RunSettings(
    tokens=4,
    decode_samples=1,
    workload=WorkloadSettings(
        cold_prompt_tokens=64, decode_prompt_tokens=32, concurrent_prompt_tokens=32, concurrency=(2,)
    ),
)
PHASES = phase_names(SETTINGS.workload)  # warmup, probe, decode, cold, warm, concurrency-2


def fake_arm(name: str, *args: str) -> ArmSpec:
    return ArmSpec(name, lambda d, port: [sys.executable, str(THIS), "--port", str(port), *args])


@pytest.fixture
def tag(monkeypatch) -> str:
    """This test's tag, in the environment its harness and servers inherit (`processes.leftovers`)."""
    value = new_tag()
    monkeypatch.setenv(TAG, value)
    return value


def servers_of(pid: int, marker: str) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in kids:  # other tests' children of this process may have exited since (zombies until reaped)
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_db_equals_json(out: Path, db_path: Path) -> dict:
    saved = json.loads(out.read_text())
    assert kept_by_db(export_run(open_db(db_path), saved["run_id"])) == kept_by_db(saved)
    return saved


# ---------------------------------------------------------------- signals


def json_cells(out: Path) -> int:
    try:
        run = json.loads(out.read_text())
    except (OSError, ValueError):
        return 0
    return sum(len(a["cells"]) for m in run["models"] for a in m["arms"])


@pytest.mark.parametrize(
    "sig,when",
    [
        (signal.SIGTERM, "loading"),  # while start_server waits for /health
        (signal.SIGHUP, "measuring"),  # mid-phase
        pytest.param(signal.SIGINT, "measuring", marks=pytest.mark.slow),  # the SIGHUP case's path, for Ctrl-C
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_a_signal_to_the_harness_stops_its_server_and_is_recorded(tiny_path, tmp_path, sig, when, tag):
    tiny_path(MODEL)  # synthesized before the harness looks for it
    out, db = tmp_path / "run.json", tmp_path / "runs.sqlite"
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "all",
        "--models",
        MODEL,
        "--arms",
        "engine",
        "--tokens",
        "4",
        "--skip-context",
        "--concurrency",
        "2",
        "--decode-samples",
        "40",
        "--diagnostic",
        "--out",
        str(out),
        "--db",
        str(db),
    ]
    with open(tmp_path / "stderr", "w") as err:
        harness = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        (server,) = wait_for(lambda: servers_of(harness.pid, "engine serve"), 60, "the engine server")
        if when == "measuring":
            wait_for(lambda: json_cells(out) >= 2, 60, "the warmup and probe cells")
        harness.send_signal(sig)
        rc = harness.wait(timeout=60)
    finally:
        if harness.poll() is None:
            harness.kill()
    assert rc == 128 + sig, (tmp_path / "stderr").read_text()[-3000:]
    wait_for(lambda: gone(server), 10, "the server to be gone")
    assert not leftovers(tag)
    run = assert_db_equals_json(out, db)
    assert run["status"] == "interrupted" and not run["finished"] and sig.name in run["error"]
    (arm,) = run["models"][0]["arms"]
    assert arm["status"] == "interrupted" and sig.name in arm["error"]
    assert [c["phase"] for c in arm["cells"]] == PHASES  # the CLI run has the same phases
    measured = [c["status"] for c in arm["cells"]].count("measured")
    assert (measured == 0) if when == "loading" else (measured >= 2)
    if when == "measuring":  # the probes that finished are compared, though the model's arms did not all run
        assert run["models"][0]["parity"]["verdicts"]["engine"]["match"]
    assert all(sig.name in c["reason"] for c in arm["cells"] if c["status"] == "not_measured")
    assert sig.name in (tmp_path / "stderr").read_text()
    exported = subprocess.run(
        [sys.executable, "-m", "harness", "db", "export", run["run_id"], "--db", str(db), "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert exported.returncode == 0 and kept_by_db(json.loads(exported.stdout)) == kept_by_db(run)


# ------------------------------------------------------- a server's faults


def stop_server_at(phase: str, sig: int, fired: list):
    """An on_phase hook: at `phase`, send `sig` to the arm's engine server (a child of this process)."""

    def on_phase(desc: str) -> None:
        if desc.endswith(f"/ {phase}") and not fired:
            (server,) = servers_of(os.getpid(), "engine serve")
            server.send_signal(sig)
            fired.append(server)

    return on_phase


def test_a_server_killed_mid_run_is_recorded_and_the_database_agrees(tiny_path, tmp_path, tag):
    model_dir = tiny_path(MODEL)
    fired = []
    runner = Runner(
        SETTINGS,
        tmp_path / "run.json",
        tmp_path / "runs.sqlite",
        log=lambda m: None,
        on_phase=stop_server_at("decode", signal.SIGKILL, fired),
    )
    record = runner.run([(MODEL, model_dir)], [Block(0, (standard_arms()["engine-serial"], fake_arm("after")))])
    dead, after = record.models[0].arms
    assert fired and dead.status == "failed" and "exited (status -9) during phase decode" in dead.error
    assert [c.status for c in dead.cells] == ["measured", "measured", "failed", *["not_measured"] * 3]
    assert after.status == "measured" and record.status == "finished"
    run = assert_db_equals_json(tmp_path / "run.json", tmp_path / "runs.sqlite")
    db = open_db(tmp_path / "runs.sqlite")
    assert db.execute("select count(*) from cells where status = 'not_measured'").fetchone()[0] == 3
    assert [a["status"] for a in run["models"][0]["arms"]] == ["failed", "measured"]
    assert not leftovers(tag)


def test_a_hung_server_stalls_its_cell_and_the_run_goes_on(tiny_path, tmp_path, tag):
    model_dir = tiny_path(MODEL)
    settings = replace(SETTINGS, stall_timeout_s=1.5, request_timeout_s=60)
    fired = []
    runner = Runner(
        settings,
        tmp_path / "run.json",
        tmp_path / "runs.sqlite",
        log=lambda m: None,
        on_phase=stop_server_at("decode", signal.SIGSTOP, fired),
    )
    start = time.perf_counter()
    record = runner.run([(MODEL, model_dir)], [Block(0, (standard_arms()["engine-serial"], fake_arm("after")))])
    hung, after = record.models[0].arms
    decode = next(c for c in hung.cells if c.phase == "decode")
    assert fired and decode.status == "failed" and "stalled: no bytes for 1.5 s" in decode.reason
    (attempt,) = decode.attempts  # no retry against a hung server
    assert 1.5 <= attempt.wall_s < 4 and attempt.requests[0].timeout_kind == "stalled"
    assert decode.stderr_tail is not None and "stopped answering" in hung.error
    assert [c.status for c in hung.cells][3:] == ["not_measured"] * 3
    assert after.status == "measured" and record.status == "finished" and time.perf_counter() - start < 60
    assert gone(fired[0])
    assert_db_equals_json(tmp_path / "run.json", tmp_path / "runs.sqlite")
    assert not leftovers(tag)


def test_a_server_sending_malformed_sse_fails_its_cell_and_the_database_agrees(tiny_path, tmp_path, tag):
    # requests 1-3 warm up, 4 is the probe; 5 and 6 are the decode phase's two attempts
    runner = Runner(SETTINGS, tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None)
    record = runner.run([(MODEL, tiny_path(MODEL))], [Block(0, (fake_arm("garbled", "--malformed", "5,6"),))])
    (arm,) = record.models[0].arms
    statuses = {c.phase: c.status for c in arm.cells}
    assert statuses.pop("decode") == "failed" and set(statuses.values()) == {"measured"}
    decode = next(c for c in arm.cells if c.phase == "decode")
    assert len(decode.attempts) == 2 and "JSONDecodeError" in decode.reason
    assert "malformed stream for request 6" in decode.stderr_tail
    assert arm.status == "measured" and record.status == "finished"
    run = assert_db_equals_json(tmp_path / "run.json", tmp_path / "runs.sqlite")
    assert run["models"][0]["arms"][0]["cells"][2]["stderr_tail"] == decode.stderr_tail
    assert not leftovers(tag)


# ------------------------------------------------------------- the fake


def serve_fake(port: int, malformed: set[int]) -> None:
    import itertools
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    numbers = itertools.count(1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            n = next(numbers)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if n in malformed:
                print(f"fake server: malformed stream for request {n}", file=sys.stderr, flush=True)
                self.wfile.write(b'data: {"choices": [{"index": 0, "text": " t"\n\ndata: [DONE]\n\n')
                return
            tokens = body["max_tokens"]
            for i in range(tokens):
                self.event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
            self.event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            prompt = len(body["prompt"])
            self.event(
                {
                    "choices": [],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens},
                }
            )
            self.wfile.write(b"data: [DONE]\n\n")

        def event(self, obj: dict) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    import argparse

    opts = argparse.ArgumentParser()
    opts.add_argument("--port", type=int, required=True)
    opts.add_argument("--malformed", default="", help="completion request numbers to garble, e.g. 5,6")
    a = opts.parse_args()
    serve_fake(a.port, {int(x) for x in a.malformed.split(",") if x})
