"""What a run leaves behind: a schema-versioned JSON companion and rows in an SQLite database.

The JSON is rewritten (atomically) after every cell, so a crash loses at most
the cell in flight. The database (sqlite-utils) indexes every run:

    runs      one row per run: provenance, settings, preflight, JSON path, status (why it ended early)
    models    one row per (block, model): artifact, workload, arm order, parity verdicts
    arms      one row per (block, model, arm): command, env, load-to-ready, peak RSS, status, stderr tail,
              the kernel set an engine server reported in /stats
    cells     one row per (block, model, arm, phase): status, metrics, error, attempt wall times
    requests  one row per request: timings, usage, finish reason, output hash, which limit ended it
    samples   RSS samples of each arm's server process tree

Every row is written when its part of the JSON is, and `db_sync` writes the
whole record once more when a run ends however it ends (finished,
interrupted, failed), so the two agree; `db_export.export_run` rebuilds the
JSON from the rows. A run's status is running, finished, interrupted (a
signal) or failed (a harness error); an arm's is running, measured, failed
(could not start, died, hung) or interrupted.

Schema changes are ordered migrations recorded in `_migrations`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils

from harness.run.client import RequestRecord

SCHEMA_VERSION = 1

# Cell statuses (the report shows one on every cell).
MEASURED, RECOVERED, FAILED, NOT_MEASURED = "measured", "recovered", "failed", "not_measured"
# Run and arm statuses, besides MEASURED and FAILED.
RUNNING, FINISHED, INTERRUPTED = "running", "finished", "interrupted"


@dataclass
class Attempt:
    attempt: int
    ok: bool
    error: str | None
    wall_s: float
    requests: list[RequestRecord]


@dataclass
class Cell:
    phase: str
    status: str = NOT_MEASURED
    reason: str | None = None  # why failed / not measured / unsupported
    attempts: list[Attempt] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    stderr_tail: str | None = None  # a failed cell: the server's stderr when it failed


@dataclass
class ArmRun:
    arm: str
    command: list[str]
    env: dict[str, str]
    status: str = NOT_MEASURED  # running | measured | failed (could not start, died, hung) | interrupted
    error: str | None = None
    load_to_ready_s: float | None = None
    peak_rss_bytes: int | None = None
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    stderr_tail: str = ""
    kernels: dict[str, Any] | None = None  # an engine arm's KernelSet record, from its /stats
    quality: dict[str, Any] | None = None  # an engine arm's held-out perplexity (harness.gates.quality.held_out_score)
    device_memory: dict[str, Any] | None = None  # an engine server's MLX memory at the end (/stats `memory`)
    endpoint: dict[str, Any] | None = None  # a server the harness did not start: its url and model id
    cells: list[Cell] = field(default_factory=list)


@dataclass
class ModelRun:
    model: str
    model_dir: str
    manifest_sha256: str
    workload_sha256: str
    workload_path: str | None
    block: int = 0  # trials: the paired block; a plain run has one block
    workload_seed: int = 0
    arm_order: list[str] = field(default_factory=list)
    arms: list[ArmRun] = field(default_factory=list)
    parity: dict[str, Any] = field(default_factory=dict)


def _request_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d.update(tpot_ms=r.tpot_ms, itl_ms=r.itl_ms, output_sha256=r.output_sha256, text_sha256=r.text_sha256)
    return d


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, RequestRecord):
        return _request_json(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj


@dataclass
class RunRecord:
    run_id: str
    created: str
    kind: str  # "run" | "trials"
    label: str | None
    diagnostic: bool
    settings: dict[str, Any]
    provenance: dict[str, Any]
    preflight: dict[str, Any]
    commands: dict[str, list[str]] = field(default_factory=dict)
    preflight_end: dict[str, Any] = field(default_factory=dict)  # the same check once the last arm stopped
    models: list[ModelRun] = field(default_factory=list)
    finished: bool = False
    status: str = RUNNING  # running | finished | interrupted | failed
    error: str | None = None  # why a run did not finish ("interrupted by SIGTERM")

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **_jsonable(self)}


def write_json(record: RunRecord, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=1))
    os.replace(tmp, path)


# ---------------------------------------------------------------- database


def _m1_initial(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "run_id": str,
            "created": str,
            "kind": str,
            "label": str,
            "diagnostic": int,
            "json_path": str,
            "git_commit": str,
            "source_tree_sha256": str,
            "host": str,
            "provenance": str,
            "settings": str,
            "preflight": str,
            "finished": int,
        },
        pk="run_id",
    )
    keys = {"run_id": str, "block": int, "model": str, "arm": str}
    db["arms"].create(
        {
            **keys,
            "command": str,
            "load_to_ready_s": float,
            "peak_rss_bytes": int,
            "status": str,
            "error": str,
            "stderr_tail": str,
            "workload_sha256": str,
            "manifest_sha256": str,
        },
        pk=("run_id", "block", "model", "arm"),
    )
    db["cells"].create(
        {**keys, "phase": str, "status": str, "reason": str, "attempts": int, "metrics": str},
        pk=("run_id", "block", "model", "arm", "phase"),
    )
    db["requests"].create(
        {
            **keys,
            "phase": str,
            "attempt": int,
            "idx": int,
            "ok": int,
            "error": str,
            "sent_at": float,
            "headers_ms": float,
            "first_byte_ms": float,
            "ttft_ms": float,
            "tpot_ms": float,
            "e2el_ms": float,
            "itl_ms": str,
            "output_tokens": int,
            "prompt_tokens": int,
            "prompt_tokens_sent": int,
            "cached_tokens": int,
            "finish_reason": str,
            "output_sha256": str,
        },
        pk=("run_id", "block", "model", "arm", "phase", "attempt", "idx"),
    )
    db["samples"].create({**keys, "t_s": float, "rss_bytes": int})
    db["samples"].create_index(["run_id", "model", "arm"])


def _m2_arm_kernels(db: sqlite_utils.Database) -> None:
    db["arms"].add_column("kernels", str)  # JSON: KernelSet.as_record() from the server's /stats


def _m3_fault_records(db: sqlite_utils.Database) -> None:
    db["runs"].add_column("status", str)
    db["runs"].add_column("error", str)
    db["models"].create(
        {
            "run_id": str,
            "block": int,
            "model": str,
            "model_dir": str,
            "manifest_sha256": str,
            "workload_sha256": str,
            "workload_path": str,
            "workload_seed": int,
            "arm_order": str,
            "parity": str,
        },
        pk=("run_id", "block", "model"),
    )
    db["arms"].add_column("env", str)  # JSON
    db["cells"].add_column("wall_s", str)  # JSON: each attempt's wall seconds
    db["cells"].add_column("stderr_tail", str)
    db["requests"].add_column("timeout_kind", str)
    db["requests"].add_column("status_code", int)


def _m4_arm_quality(db: sqlite_utils.Database) -> None:
    db["arms"].add_column("quality", str)  # JSON: the engine arm's held-out perplexity


def _m5_stability(db: sqlite_utils.Database) -> None:
    db["runs"].add_column("preflight_end", str)  # JSON: the preflight check after the last arm
    db["arms"].add_column("device_memory", str)  # JSON: the engine server's MLX memory (/stats)
    db["requests"].add_column("prompt_sha256", str)


def _m6_external_arms(db: sqlite_utils.Database) -> None:
    db["arms"].add_column("endpoint", str)  # JSON: an external server's url and model id


MIGRATIONS = [
    _m1_initial,
    _m2_arm_kernels,
    _m3_fault_records,
    _m4_arm_quality,
    _m5_stability,
    _m6_external_arms,
]  # append only; each runs once, in order


def open_db(path: Path) -> sqlite_utils.Database:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(path)
    if "_migrations" not in db.table_names():
        db["_migrations"].create({"version": int, "name": str}, pk="version")
    done = {row["version"] for row in db["_migrations"].rows}
    for version, migrate in enumerate(MIGRATIONS, start=1):
        if version not in done:
            with db.conn:
                migrate(db)
                db["_migrations"].insert({"version": version, "name": migrate.__name__})
    return db


ARM_KEYS, CELL_KEYS = ("run_id", "block", "model", "arm"), ("run_id", "block", "model", "arm", "phase")
REQUEST_KEYS = (*CELL_KEYS, "attempt", "idx")


def db_run(db: sqlite_utils.Database, record: RunRecord, json_path: Path) -> None:
    p = record.provenance
    db["runs"].upsert(
        {
            "run_id": record.run_id,
            "created": record.created,
            "kind": record.kind,
            "label": record.label,
            "diagnostic": int(record.diagnostic),
            "json_path": str(json_path),
            "git_commit": p.get("git_commit"),
            "source_tree_sha256": p.get("source_tree_sha256"),
            "host": p.get("host"),
            "provenance": json.dumps(p),
            "settings": json.dumps(record.settings),
            "preflight": json.dumps(record.preflight),
            "finished": int(record.finished),
            "preflight_end": json.dumps(record.preflight_end),
            "status": record.status,
            "error": record.error,
        },
        pk="run_id",
    )


def db_model(db: sqlite_utils.Database, run_id: str, model: ModelRun) -> None:
    db["models"].upsert(
        {
            "run_id": run_id,
            "block": model.block,
            "model": model.model,
            "model_dir": model.model_dir,
            "manifest_sha256": model.manifest_sha256,
            "workload_sha256": model.workload_sha256,
            "workload_path": model.workload_path,
            "workload_seed": model.workload_seed,
            "arm_order": json.dumps(model.arm_order),
            "parity": json.dumps(model.parity),
        },
        pk=("run_id", "block", "model"),
    )


def db_cell(db: sqlite_utils.Database, run_id: str, model: ModelRun, arm: str, cell: Cell) -> None:
    with db.atomic():
        _cell_rows(db, run_id, model, arm, cell)


def _cell_rows(db: sqlite_utils.Database, run_id: str, model: ModelRun, arm: str, cell: Cell) -> None:
    keys = {"run_id": run_id, "block": model.block, "model": model.model, "arm": arm}
    db["cells"].upsert(
        {
            **keys,
            "phase": cell.phase,
            "status": cell.status,
            "reason": cell.reason,
            "attempts": len(cell.attempts),
            "metrics": json.dumps(cell.metrics),
            "wall_s": json.dumps([a.wall_s for a in cell.attempts]),
            "stderr_tail": cell.stderr_tail,
        },
        pk=CELL_KEYS,
    )
    rows = []
    for a in cell.attempts:
        for r in a.requests:
            rows.append(
                {
                    **keys,
                    "phase": cell.phase,
                    "attempt": a.attempt,
                    "idx": r.index,
                    "ok": int(r.ok),
                    "error": r.error,
                    "sent_at": r.sent_at,
                    "headers_ms": r.headers_ms,
                    "first_byte_ms": r.first_byte_ms,
                    "ttft_ms": r.ttft_ms,
                    "tpot_ms": r.tpot_ms,
                    "e2el_ms": r.e2el_ms,
                    "itl_ms": json.dumps(r.itl_ms),
                    "output_tokens": r.output_tokens,
                    "prompt_tokens": r.prompt_tokens,
                    "prompt_tokens_sent": r.prompt_tokens_sent,
                    "cached_tokens": r.cached_tokens,
                    "finish_reason": r.finish_reason,
                    "output_sha256": r.output_sha256,
                    "timeout_kind": r.timeout_kind,
                    "status_code": r.status_code,
                    "prompt_sha256": r.prompt_sha256,
                }
            )
    db["requests"].upsert_all(rows, pk=REQUEST_KEYS)


def db_arm(db: sqlite_utils.Database, run_id: str, model: ModelRun, arm: ArmRun) -> None:
    """The arm's row and its RSS samples (replacing earlier ones: an arm is written when it starts and ends)."""
    with db.atomic():
        _arm_rows(db, run_id, model, arm)


def _arm_rows(db: sqlite_utils.Database, run_id: str, model: ModelRun, arm: ArmRun) -> None:
    keys = {"run_id": run_id, "block": model.block, "model": model.model, "arm": arm.arm}
    db["arms"].upsert(
        {
            **keys,
            "command": json.dumps(arm.command),
            "env": json.dumps(arm.env),
            "load_to_ready_s": arm.load_to_ready_s,
            "peak_rss_bytes": arm.peak_rss_bytes,
            "status": arm.status,
            "error": arm.error,
            "stderr_tail": arm.stderr_tail,
            "workload_sha256": model.workload_sha256,
            "manifest_sha256": model.manifest_sha256,
            "kernels": None if arm.kernels is None else json.dumps(arm.kernels),
            "quality": None if arm.quality is None else json.dumps(arm.quality),
            "device_memory": None if arm.device_memory is None else json.dumps(arm.device_memory),
            "endpoint": None if arm.endpoint is None else json.dumps(arm.endpoint),
        },
        pk=ARM_KEYS,
    )
    db["samples"].delete_where("run_id = ? and block = ? and model = ? and arm = ?", list(keys.values()))
    db["samples"].insert_all({**keys, "t_s": t, "rss_bytes": b} for t, b in arm.rss_samples)


def db_sync(db: sqlite_utils.Database, record: RunRecord, json_path: Path) -> None:
    """Write the whole record in one transaction: after it, the database holds what the JSON holds."""
    with db.atomic():
        db_run(db, record, json_path)
        for model in record.models:
            db_model(db, record.run_id, model)
            for arm in model.arms:
                _arm_rows(db, record.run_id, model, arm)
                for cell in arm.cells:
                    _cell_rows(db, record.run_id, model, arm.arm, cell)
