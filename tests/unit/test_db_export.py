"""`harness db export`: a run recorded into the database comes back as JSON or as one CSV row per request."""

import io
import json
from dataclasses import fields
from pathlib import Path

import pandas as pd

from harness.cli import main as harness_main
from harness.report.db_export import requests_frame
from harness.run.client import RequestRecord
from harness.run.records import ArmRun, Attempt, Cell, ModelRun, RunRecord, db_arm, db_cell, db_run, open_db

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"
KEYS = ["run_id", "block", "model", "arm", "phase", "attempt", "idx"]


def make_request(r: dict) -> RequestRecord:
    return RequestRecord(**{f.name: r[f.name] for f in fields(RequestRecord) if f.name in r})


def make_cell(c: dict) -> Cell:
    attempts = [
        Attempt(t["attempt"], t["ok"], t["error"], t["wall_s"], [make_request(r) for r in t["requests"]])
        for t in c["attempts"]
    ]
    return Cell(c["phase"], c["status"], c["reason"], attempts, c["metrics"])


def record_run(db, run: dict) -> int:
    """Writes a run JSON's rows as `harness run` does; returns how many requests it holds."""
    record = RunRecord(
        run["run_id"],
        run["created"],
        run["kind"],
        run["label"],
        run["diagnostic"],
        run["settings"],
        run["provenance"],
        run["preflight"],
        finished=run["finished"],
    )
    db_run(db, record, Path("run.json"))
    n = 0
    for m in run["models"]:
        model = ModelRun(m["model"], m["model_dir"], m["manifest_sha256"], m["workload_sha256"], None, block=m["block"])
        for a in m["arms"]:
            db_arm(db, run["run_id"], model, ArmRun(a["arm"], a["command"], {}, status=a["status"]))
            for c in a["cells"]:
                cell = make_cell(c)
                db_cell(db, run["run_id"], model, a["arm"], cell)
                n += sum(len(t.requests) for t in cell.attempts)
    return n


def fixture_with_a_failed_request() -> dict:
    """The tiny run, its engine cold request failed: the row keeps its keys, its metrics are empty."""
    run = json.loads(FIXTURE.read_text())
    cold = next(c for c in run["models"][0]["arms"][0]["cells"] if c["phase"] == "cold")
    failed = cold["attempts"][0]["requests"][0]
    failed.update(ok=False, error="HTTP 500: boom", ttft_ms=None, e2el_ms=None, output_tokens=None, event_ms=[])
    return run


def test_the_csv_has_one_row_per_request_with_its_keys_first(tmp_path):
    db = open_db(tmp_path / "runs.sqlite")
    run = fixture_with_a_failed_request()
    n = record_run(db, run)
    frame = requests_frame(db, run["run_id"])
    assert len(frame) == n == 20
    assert list(frame.columns[: len(KEYS)]) == KEYS
    assert {"ok", "error", "ttft_ms", "tpot_ms", "e2el_ms", "output_tokens", "finish_reason"} <= set(frame.columns)
    assert set(frame["arm"]) == {"engine", "mlx-lm"} and set(frame["run_id"]) == {run["run_id"]}
    failed = frame[frame["ok"] == 0]
    assert len(failed) == 1 and failed["error"].iloc[0] == "HTTP 500: boom"
    text = pd.read_csv(io.StringIO(frame.to_csv(index=False)), dtype=str)
    assert text["output_tokens"].isna().sum() == 1  # the failed request's cell is empty ...
    assert text["output_tokens"].dropna().str.fullmatch(r"\d+").all()  # ... and the others stay integers (no "12.0")


def test_db_export_writes_csv_and_json(tmp_path, capsys):
    db_path = tmp_path / "runs.sqlite"
    run = json.loads(FIXTURE.read_text())
    n = record_run(open_db(db_path), run)
    out = tmp_path / "requests.csv"
    assert (
        harness_main(["db", "export", run["run_id"], "--db", str(db_path), "--format", "csv", "--out", str(out)]) == 0
    )
    table = pd.read_csv(out)
    assert len(table) == n and list(table.columns[: len(KEYS)]) == KEYS
    capsys.readouterr()
    assert harness_main(["db", "export", run["run_id"], "--db", str(db_path), "--format", "csv"]) == 0
    assert capsys.readouterr().out == out.read_text()
    assert harness_main(["db", "export", run["run_id"], "--db", str(db_path)]) == 0  # json stays the default
    exported = json.loads(capsys.readouterr().out)
    assert exported["run_id"] == run["run_id"] and exported["exported_from_db"]


def test_an_unknown_run_is_a_cli_error(tmp_path, capsys):
    db_path = tmp_path / "runs.sqlite"
    record_run(open_db(db_path), json.loads(FIXTURE.read_text()))
    assert harness_main(["db", "export", "nope", "--db", str(db_path), "--format", "csv"]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
