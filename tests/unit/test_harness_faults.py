"""Harness faults without model weights: request limits, malformed SSE, process-tree cleanup, signals,
JSON and database agreement, Markdown escaping, decode cells too short to time."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from harness.cli import build_parser
from harness.report import page as report
from harness.report.db_export import export_run, kept_by_db
from harness.run import summary
from harness.run.client import STALLED, TIMED_OUT, RequestRecord, Timeouts, stream_completion
from harness.run.interrupts import Interrupts, RunInterrupted
from harness.run.records import (
    FAILED,
    INTERRUPTED,
    MEASURED,
    NOT_MEASURED,
    ArmRun,
    Attempt,
    Cell,
    ModelRun,
    RunRecord,
    db_arm,
    db_sync,
    open_db,
    write_json,
)
from harness.run.servers import ServerProcess, start_server

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"
HOSTILE = "<script>alert(1)</script>|x\ny"


# ------------------------------------------------------------ request limits


def tcp_server(headers: bytes = b"", keepalive_every_s: float = 0.0):
    """A TCP server that reads a request, then sends `headers` and a keepalive comment every
    `keepalive_every_s` s (headers empty: nothing, ever). Returns (socket, stop event)."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            if headers:
                conn.sendall(headers)
            while not stop.wait(keepalive_every_s or 0.05):
                if headers:
                    try:
                        conn.sendall(b": keepalive\n\n")
                    except OSError:
                        return

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return sock, stop


def timed_request(url: str, timeouts: Timeouts) -> tuple[RequestRecord, float]:
    rec = RequestRecord("decode", 0, 0, 3)
    start = time.perf_counter()
    with httpx.Client(base_url=url) as client:
        stream_completion(client, {"prompt": [1, 2, 3], "max_tokens": 4}, rec, timeouts)
    return rec, time.perf_counter() - start


def test_a_server_that_accepts_and_never_answers_is_a_stall():
    sock, stop = tcp_server()
    try:
        rec, took = timed_request(f"http://127.0.0.1:{sock.getsockname()[1]}", Timeouts(request_s=30, stall_s=0.5))
    finally:
        stop.set()
        sock.close()
    assert not rec.ok and rec.timeout_kind == STALLED and rec.error.startswith("stalled: no bytes for 0.5 s")
    assert 0.5 <= took < 3


def test_a_stream_that_trickles_keepalives_runs_into_the_request_limit():
    headers = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    sock, stop = tcp_server(headers, keepalive_every_s=0.1)
    try:
        rec, took = timed_request(f"http://127.0.0.1:{sock.getsockname()[1]}", Timeouts(request_s=0.6, stall_s=5))
    finally:
        stop.set()
        sock.close()
    assert not rec.ok and rec.timeout_kind == TIMED_OUT and "ran past 0.6 s" in rec.error
    assert rec.first_byte_ms is not None and 0.6 <= took < 3


@pytest.mark.parametrize(
    "stream",
    [
        b'data: {"choices": [{"text": " a"\n\ndata: [DONE]\n\n',  # cut-off JSON
        b"data: [1, 2]\n\ndata: [DONE]\n\n",
        b"data: null\n\n",
        b'data: {"choices": "x"}\n\n',
        b'data: {"choices": [{"text": 5}]}\n\n',
        b'data: {"choices": [{"text": " a", "finish_reason": "length"}]}\n\n',  # no usage, no [DONE]
    ],
)
def test_malformed_sse_is_a_failed_request_not_a_crash(stream):
    transport = httpx.MockTransport(
        lambda req: httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})
    )
    rec = RequestRecord("decode", 0, 0, 3)
    with httpx.Client(transport=transport, base_url="http://fake") as client:
        stream_completion(client, {"prompt": [1, 2, 3], "max_tokens": 4}, rec)
    assert not rec.ok and rec.error and rec.timeout_kind is None


# ------------------------------------------------------- process-tree cleanup

# A server-like tree: a child that starts a grandchild and exits (the grandchild is orphaned, still in the
# server's process group), while the root ignores SIGTERM.
TREE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
mid = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                        "print(p.pid, flush=True)"], stdout=subprocess.PIPE, text=True)
print(mid.stdout.readline().strip(), flush=True)
mid.wait()
time.sleep(60)
"""


def launch(code: str, tmp_path: Path) -> ServerProcess:
    with open(tmp_path / "out", "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, start_new_session=True)
    return ServerProcess([sys.executable], "http://127.0.0.1:1", proc, tmp_path, 0.0)


def wait_for(predicate, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_kills_the_tree_and_the_orphans_of_its_process_group(tmp_path):
    server = launch(TREE, tmp_path)
    wait_for(lambda: (tmp_path / "out").read_text().strip())
    orphan = int((tmp_path / "out").read_text().split()[0])
    assert psutil.Process(orphan).ppid() != server.proc.pid  # not in the tree: only the group reaches it
    server.stop(grace_s=0.3)
    assert server.proc.returncode is not None
    wait_for(lambda: gone(orphan), 5)
    server.stop(grace_s=0.3)  # again: a no-op


def test_a_stopped_server_acts_on_sigterm_at_once(tmp_path):
    server = launch("import time; time.sleep(60)", tmp_path)
    os.kill(server.proc.pid, signal.SIGSTOP)
    start = time.perf_counter()
    assert server.stop(grace_s=10) == -signal.SIGTERM  # SIGCONT let it take the SIGTERM
    assert time.perf_counter() - start < 5


def test_a_signal_while_the_server_loads_stops_it(tmp_path):
    launched = []
    never_ready = [sys.executable, "-c", "import time; time.sleep(60)"]
    with Interrupts().installed(signums=(signal.SIGUSR1,)):
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(RunInterrupted):
            start_server(never_ready, 1, timeout_s=30, log_dir=tmp_path, on_launch=launched.append)
    (server,) = launched
    assert server.proc.returncode is not None and gone(server.proc.pid)


def test_a_signal_as_the_server_is_launched_waits_until_it_is_known_and_stops_it(tmp_path):
    # the signal lands between the launch and its registration: deferred, it fires once the caller knows
    # the process, which start_server then stops
    launched = []
    never_ready = [sys.executable, "-c", "import time; time.sleep(60)"]
    interrupts = Interrupts()

    def register(server):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        launched.append(server)

    with interrupts.installed(signums=(signal.SIGUSR1,)):
        with pytest.raises(RunInterrupted):
            start_server(
                never_ready, 1, timeout_s=30, log_dir=tmp_path, on_launch=register, spawning=interrupts.deferred
            )
    (server,) = launched
    assert server.proc.returncode is not None and gone(server.proc.pid)


def test_interrupts_fire_once_and_wait_out_deferred_blocks():
    interrupts = Interrupts()
    with interrupts.installed(signums=(signal.SIGUSR1,)):
        with pytest.raises(RunInterrupted) as raised, interrupts.deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            finished_block = True  # the signal did not cut the block short
        assert finished_block and raised.value.signum == signal.SIGUSR1 == interrupts.fired
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal: ignored while the first one's cleanup runs
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_signal_whose_exception_python_dropped_is_raised_at_the_next_check():
    # a handler can run inside an import lock's callback, where Python prints the exception and goes on: the run
    # went on to the end and exited 0 (seen in CI); its next check raises it
    interrupts = Interrupts()
    interrupts.check()  # nothing fired: nothing raised
    with interrupts.installed(signums=(signal.SIGUSR1,)):
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
        except RunInterrupted:
            pass  # dropped, as Python drops it in such a callback
        with pytest.raises(RunInterrupted) as raised:
            interrupts.check()
    assert raised.value.signum == signal.SIGUSR1


# ------------------------------------------------------- JSON and database


def make_request(ok: bool, index: int = 0, **kw) -> RequestRecord:
    fields = {
        "ok": True,
        "status_code": 200,
        "sent_at": 1.5,
        "headers_ms": 1.0,
        "first_byte_ms": 1.2,
        "ttft_ms": 2.0,
        "e2el_ms": 40.0,
        "event_ms": [2.0, 20.0, 40.0],
        "output_tokens": 3,
        "prompt_tokens": 3,
        "finish_reason": "length",
        "text": " a b c",
        "usage": {"completion_tokens": 3},
    }
    if not ok:
        fields = {
            "ok": False,
            "error": "stalled: no bytes for 2 s (ReadTimeout)",
            "timeout_kind": STALLED,
            "status_code": 200,
        }
    return RequestRecord("decode", 0, index, 3, **{**fields, **kw})


def faulted_record() -> RunRecord:
    """A run cut short by SIGTERM: a measured arm, one that stalled, one interrupted mid-phase."""
    rec = RunRecord(
        "faults000001",
        "2025-01-01T00:00:00+00:00",
        "run",
        HOSTILE,
        True,
        {"tokens": 4},
        {"host": "h"},
        {"other_cpu_percent": 1.0},
        status=INTERRUPTED,
        error="the run was interrupted by SIGTERM",
    )
    model = ModelRun(
        "tiny",
        "/m",
        "m" * 64,
        "w" * 64,
        "/w.json",
        arm_order=["a", "b", "c"],
        parity={"reference": "a", "verdicts": {"a": {"match": True}}},
    )
    good = Cell(
        "decode", MEASURED, None, [Attempt(0, True, None, 0.05, [make_request(True)])], {"median_decode_tps": 50.0}
    )
    lost = make_request(False)
    stalled = Cell(
        "decode",
        FAILED,
        f"1 of 1 requests failed: {lost.error}",
        [Attempt(0, False, lost.error, 2.0, [lost])],
        {},
        stderr_tail="server log\n",
    )
    model.arms = [
        ArmRun(
            "a",
            ["serve", "a"],
            {"X": "1"},
            MEASURED,
            load_to_ready_s=1.25,
            peak_rss_bytes=10,
            rss_samples=[(0.0, 10), (0.25, 9)],
            kernels={"tier": "exact"},
            cells=[good],
            quality={"tokens": 64, "tier": "exact", "nll": 1.0, "perplexity": 2.718},
        ),
        ArmRun(
            "b",
            ["serve", "b"],
            {},
            FAILED,
            "the server stopped answering",
            cells=[stalled, Cell("cold", NOT_MEASURED, "the server stopped answering")],
        ),
        ArmRun(
            "c",
            ["serve", "c"],
            {},
            INTERRUPTED,
            "the run was interrupted by SIGTERM during phase decode",
            cells=[Cell("decode", NOT_MEASURED, "interrupted"), Cell("cold", NOT_MEASURED, "interrupted")],
        ),
    ]
    rec.models.append(model)
    rec.commands = {a.arm: a.command for a in model.arms}
    return rec


def test_the_database_export_is_the_json_companion_after_a_fault(tmp_path):
    rec = faulted_record()
    db = open_db(tmp_path / "runs.sqlite")
    db_arm(db, rec.run_id, rec.models[0], rec.models[0].arms[0])  # written at the start too: no doubled samples
    write_json(rec, tmp_path / "run.json")
    db_sync(db, rec, tmp_path / "run.json")
    saved = json.loads((tmp_path / "run.json").read_text())
    exported = export_run(open_db(tmp_path / "runs.sqlite"), rec.run_id)
    assert kept_by_db(exported) == kept_by_db(saved)
    assert exported["status"] == INTERRUPTED and exported["error"] == rec.error
    statuses = [(a["arm"], a["status"], [c["status"] for c in a["cells"]]) for a in exported["models"][0]["arms"]]
    assert statuses == [
        ("a", "measured", ["measured"]),
        ("b", "failed", ["failed", "not_measured"]),
        ("c", "interrupted", ["not_measured", "not_measured"]),
    ]
    assert exported["models"][0]["arms"][1]["cells"][0]["attempts"][0]["requests"][0]["timeout_kind"] == STALLED
    assert [r[0] for r in db.execute("select version from _migrations")] == [1, 2, 3, 4, 5, 6]


def test_a_run_recorded_before_the_models_table_still_exports(tmp_path):
    db = open_db(tmp_path / "runs.sqlite")
    db["runs"].insert({"run_id": "old", "kind": "run", "finished": 1})
    db_arm(db, "old", ModelRun("tiny", "/m", "m" * 64, "w" * 64, None), ArmRun("a", ["serve"], {}, MEASURED))
    run = export_run(db, "old")
    assert run["status"] == "finished" and run["models"][0]["arm_order"] == ["a"]


# ------------------------------------------------------------- the CLI


def test_request_and_stall_timeouts_reach_the_run_settings():
    from harness.run.cli import _run_plan

    args = build_parser().parse_args(
        ["run", "all", "--models", "tiny-qwen3", "--request-timeout", "90", "--stall-timeout", "2.5", "--dry-run"]
    )
    settings = _run_plan(args)[1]
    assert (settings.request_timeout_s, settings.stall_timeout_s) == (90, 2.5)
    assert settings.timeouts == Timeouts(request_s=90, stall_s=2.5)
    defaults = _run_plan(build_parser().parse_args(["trials", "--models", "tiny-qwen3", "--dry-run"]))[1]
    assert (defaults.request_timeout_s, defaults.stall_timeout_s) == (1800, 300)


def test_cell_repeats_plan_repetition_blocks_of_the_load_cells_in_alternating_order(capsys):
    from harness.cli import main as harness_main

    assert (
        harness_main(
            [
                "run",
                "all",
                "--models",
                "tiny-qwen3",
                "--arms",
                "engine,mlx-lm",
                "--concurrency",
                "2",
                "--rates",
                "4",
                "--cell-repeats",
                "3",
                "--skip-context",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "block 0: workload seed 0; arms in order ['engine', 'mlx-lm']\n" in out
    assert (
        "block 1: workload seed 0; arms in order ['mlx-lm', 'engine']; a repetition of the warm-up and the load" in out
    )
    assert "block 2: workload seed 0; arms in order ['engine', 'mlx-lm']; a repetition" in out
    repeated = out.split("block 1:")[1]
    assert "concurrency-2" in repeated and "rate-4" in repeated and "decode" not in repeated
    with pytest.raises(SystemExit):  # trials repeat whole blocks already
        build_parser().parse_args(["trials", "--cell-repeats", "2"])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "all", "--stall-timeout", value])
    assert exited.value.code == 2 and "seconds" in capsys.readouterr().err


# ------------------------------------------------- Markdown and HTML output


def columns(line: str) -> int:
    """Cells of a Markdown table row: pipes not escaped by a backslash."""
    return len(re.findall(r"(?<!\\)\|", line)) - 1


def hostile_run() -> dict:
    run = json.loads(FIXTURE.read_text())
    run["label"] = HOSTILE
    run["models"][0]["model"] = HOSTILE
    run["models"][0]["arms"][0]["error"] = HOSTILE
    run["models"][0]["arms"][0]["status"] = "failed"
    return run


def test_the_run_summary_escapes_labels_in_its_markdown():
    md = summary.markdown(hostile_run())
    assert "<script" not in md and "&lt;script&gt;alert(1)&lt;/script&gt;\\|x y" in md
    for block in md.split("\n\n"):  # each table keeps its columns: header, rule, a row an arm or cell
        table = [line for line in block.splitlines() if line.startswith("|")]
        assert len({columns(line) for line in table}) <= 1, block
    table = next(b for b in md.split("\n\n") if b.startswith("| arm |"))
    assert len(table.splitlines()) == 4  # the header, its rule, two arms


def test_the_report_escapes_labels_in_markdown_and_html(tmp_path):
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(hostile_run()))
    view = report.build_view(report.load([path]))
    md = report.render_markdown(view)
    assert "<script" not in md and "alert(1)" in md
    for block in md.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({columns(line) for line in rows}) <= 1, block
    failures = md.split("## Failures")[1]
    assert all(line.startswith("- ") for line in failures.strip().splitlines())  # a newline did not split an item
    html = report.render_html(view)
    assert "<script" not in html.lower() and "&lt;script&gt;" in html


# ---------------------------------------------------- too short to time


def decode_arm(name: str, tokens: int, decode_ms: float, rate: float) -> dict:
    reqs = [
        {
            "prompt_tokens_sent": 10,
            "output_tokens": tokens,
            "finish_reason": "length",
            "ttft_ms": 5.0,
            "e2el_ms": 5.0 + decode_ms,
            "itl_ms": [],
        }
    ]
    cell = {
        "phase": "decode",
        "status": "measured",
        "reason": None,
        "metrics": {"median_decode_tps": rate},
        "attempts": [{"attempt": 0, "ok": True, "error": None, "requests": reqs}],
    }
    return {"arm": name, "status": "measured", "cells": [cell], "peak_rss_bytes": None, "load_to_ready_s": 1.0}


def summary_of(*arms: dict, diagnostic: bool = False) -> tuple[list[dict], summary.ModelSummary]:
    run = {
        "kind": "run",
        "settings": {},
        "provenance": {},
        "diagnostic": diagnostic,
        "models": [{"model": "m", "model_dir": "/none", "block": 0, "parity": {}, "arms": list(arms)}],
    }
    return summary.rows(run), summary.model_summaries(run)[0]


def test_a_decode_cell_too_short_to_time_gets_no_rate_and_no_ratio():
    # --tokens 8 against mlx_lm.server: seven tokens after the first, all in one burst
    (engine, mlx), ms = summary_of(decode_arm("engine", 8, 30.0, 233.0), decode_arm("mlx-lm", 8, 0.37, 18814.0))
    assert engine["decode_tps"] is None and mlx["decode_tps"] is None
    assert [r[1] for r in ms.rows] == ["too short [1]", "too short [2]"]  # the reasons are notes, not cells
    assert ms.notes == ["[1] engine: too short: 7 timed tokens (< 16)", "[2] mlx-lm: too short: 7 timed tokens (< 16)"]
    assert "engine: decode withheld [1]" in ms.lines  # the ratio's reason is the cell's note


def test_a_burst_of_enough_tokens_is_still_too_short():
    (engine, mlx), ms = summary_of(decode_arm("engine", 64, 900.0, 70.0), decode_arm("mlx-lm", 64, 3.0, 21000.0))
    assert engine["decode_tps"] == 70.0 and mlx["decode_tps"] is None
    assert "engine: decode withheld [1]" in ms.lines and ms.notes == [
        "[1] mlx-lm: too short: 3.0 ms of decode (< 50 ms)"
    ]


def test_a_decode_cell_long_enough_keeps_its_rate_and_ratio():
    (engine, mlx), ms = summary_of(decode_arm("engine", 64, 900.0, 70.0), decode_arm("mlx-lm", 64, 1260.0, 50.0))
    assert (engine["decode_tps"], mlx["decode_tps"]) == (70.0, 50.0) and ms.rows[0][1] == "70.0"
    assert "engine: decode 1.40x unknown" in ms.lines and not ms.notes  # no per-request timings: no interval


def test_a_diagnostic_run_prints_its_rates_and_no_ratio():
    (engine, _), ms = summary_of(
        decode_arm("engine", 64, 900.0, 70.0), decode_arm("mlx-lm", 64, 1260.0, 50.0), diagnostic=True
    )
    assert engine["decode_tps"] == 70.0 and ms.rows[0][1] == "70.0"
    assert "engine: decode withheld [1]" in ms.lines and ms.notes == ["[1] diagnostic run (measured on a busy machine)"]


def test_a_run_without_the_baseline_shows_no_withheld_ratio():
    _, ms = summary_of(decode_arm("engine", 64, 900.0, 70.0))
    assert ms.lines == [] and ms.notes == []


def test_the_terminal_summary_and_db_list_print_markup_like_names_as_text(tmp_path, capsys):
    from harness.cli import main as harness_main
    from harness.run.cli import _print_summary

    rec = faulted_record()
    rec.label = rec.models[0].model = "[/red]tiny[bold]|x"
    _print_summary(rec, tmp_path / "run.json", tmp_path / "runs.sqlite")  # rich would raise MarkupError
    assert "[/red]tiny[bold]|x" in capsys.readouterr().out
    assert "[/red]tiny[bold]\\|x" in (tmp_path / "run.md").read_text()
    db_sync(open_db(tmp_path / "runs.sqlite"), rec, tmp_path / "run.json")
    assert harness_main(["db", "list", "--db", str(tmp_path / "runs.sqlite")]) == 0
    listed = capsys.readouterr().out
    assert "[/red]tiny[bold]|x" in listed and "interrupted" in listed


def test_cells_that_ran_new_shapes_are_listed_and_flagged(tmp_path):
    run = json.loads(FIXTURE.read_text())
    model, arm = run["models"][0]["model"], run["models"][0]["arms"][0]
    cells = [c for c in arm["cells"] if c.get("metrics")]
    for cell in cells:  # the warm-up's own shapes are what it is for: never listed
        cell["metrics"]["new_shapes"] = 5 if cell["phase"] == "warmup" else 0
    later = next(c for c in cells if c["phase"] != "warmup")
    later["metrics"]["new_shapes"] = 3
    later["metrics"]["compiled_modules"] = 2  # MLX compiled modules of its own meanwhile
    assert summary.compiled_cells(run) == [
        f"{model} / {arm['arm']} / {later['phase']}: 3 new shapes, 2 kernel modules compiled"
    ]
    assert "first ran forward shapes or compiled kernel modules" in summary.markdown(run)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    html = report.render_html(report.build_view(report.load([path])))
    assert "3 new forward shapes" in html and "5 new forward shapes" not in html
    assert "compiled on CUDA" not in html  # a CPU run: a new shape compiles nothing
    assert "2 kernel modules compiled during the cell" in html
