"""Rebuild a run record (the JSON companion's shape) from the database alone, or a run's requests as a table.

The database does not keep SSE event arrival times, generated text (nor its
hash), token ids or raw usage; those come back empty. Everything else comes
back as the JSON companion has it, failed, not-measured and interrupted parts
included: `kept_by_db(json) == kept_by_db(export_run(...))` is the contract
(runs recorded before the models table existed lack its fields).
"""

from __future__ import annotations

import copy
import json

import pandas as pd
import sqlite_utils

from harness.run.records import FINISHED, RUNNING, SCHEMA_VERSION

# Per request: what the database does not keep.
UNKEPT_REQUEST_KEYS = ("event_ms", "text", "text_sha256", "token_ids", "usage")


def requests_frame(db: sqlite_utils.Database, run_id: str) -> pd.DataFrame:
    """One row per request of a run, in the order they were recorded: the keys (run_id, block, model, arm,
    phase, attempt, idx), then the requests table's status and metric columns (itl_ms stays a JSON list).
    Integer columns stay integers where a failed request left them empty."""
    _run_row(db, run_id)
    return pd.read_sql(
        "select * from requests where run_id = ? order by rowid",
        db.conn,
        params=[run_id],
        dtype_backend="numpy_nullable",
    )


def _run_row(db: sqlite_utils.Database, run_id: str) -> dict:
    rows = list(db.query("select * from runs where run_id = ?", [run_id]))
    if not rows:
        raise KeyError(run_id)
    return rows[0]


def kept_by_db(run: dict) -> dict:
    """A run record without what the database does not keep: equal for a JSON companion and its export."""
    run = copy.deepcopy(run)
    run.pop("exported_from_db", None)
    for m in run["models"]:
        for a in m["arms"]:
            for c in a["cells"]:
                for att in c["attempts"]:
                    for r in att["requests"]:
                        for key in UNKEPT_REQUEST_KEYS:
                            r.pop(key, None)
    return run


def export_run(db: sqlite_utils.Database, run_id: str) -> dict:
    r = _run_row(db, run_id)
    models: dict[tuple[int, str], dict] = {}
    if "models" in db.table_names():
        for m in db.query("select * from models where run_id = ? order by rowid", [run_id]):
            models[(m["block"], m["model"])] = {
                "model": m["model"],
                "model_dir": m["model_dir"],
                "manifest_sha256": m["manifest_sha256"],
                "workload_sha256": m["workload_sha256"],
                "workload_path": m["workload_path"],
                "block": m["block"],
                "workload_seed": m["workload_seed"],
                "arm_order": json.loads(m["arm_order"] or "[]"),
                "arms": [],
                "parity": json.loads(m["parity"] or "{}"),
            }
    legacy = set()  # models of a run recorded before the models table: rebuilt from their arms
    for a in db.query("select * from arms where run_id = ? order by rowid", [run_id]):
        key = (a["block"], a["model"])
        if key not in models:
            legacy.add(key)
            models[key] = {
                "model": a["model"],
                "model_dir": "",
                "manifest_sha256": a["manifest_sha256"],
                "workload_sha256": a["workload_sha256"],
                "workload_path": None,
                "block": a["block"],
                "workload_seed": a["block"],
                "arm_order": [],
                "arms": [],
                "parity": {},
            }
        if key in legacy:
            models[key]["arm_order"].append(a["arm"])
        models[key]["arms"].append(_arm(db, run_id, a))
    status = r.get("status") or (FINISHED if r["finished"] else RUNNING)
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": r["run_id"],
        "created": r["created"],
        "kind": r["kind"],
        "label": r["label"],
        "diagnostic": bool(r["diagnostic"]),
        "settings": json.loads(r["settings"] or "{}"),
        "provenance": json.loads(r["provenance"] or "{}"),
        "preflight": json.loads(r["preflight"] or "{}"),
        "preflight_end": json.loads(r.get("preflight_end") or "{}"),
        "commands": {a["arm"]: a["command"] for m in models.values() for a in m["arms"]},
        "models": list(models.values()),
        "finished": bool(r["finished"]),
        "status": status,
        "error": r.get("error"),
        "exported_from_db": True,
    }


def _arm(db: sqlite_utils.Database, run_id: str, a: dict) -> dict:
    keys = [run_id, a["block"], a["model"], a["arm"]]
    where = "run_id = ? and block = ? and model = ? and arm = ?"
    cells = []
    for c in db.query(f"select * from cells where {where} order by rowid", keys):
        reqs = list(
            db.query(f"select * from requests where {where} and phase = ? order by attempt, idx", [*keys, c["phase"]])
        )
        walls = json.loads(c.get("wall_s") or "[]")
        attempts = []
        for i, n in enumerate(sorted({q["attempt"] for q in reqs})):
            got = [_request(q) for q in reqs if q["attempt"] == n]
            errors = [q["error"] for q in got if not q["ok"]]
            attempts.append(
                {
                    "attempt": n,
                    "ok": not errors,
                    "error": errors[0] if errors else None,
                    "wall_s": walls[i] if i < len(walls) else None,
                    "requests": got,
                }
            )
        cells.append(
            {
                "phase": c["phase"],
                "status": c["status"],
                "reason": c["reason"],
                "attempts": attempts,
                "metrics": json.loads(c["metrics"] or "{}"),
                "stderr_tail": c.get("stderr_tail"),
            }
        )
    samples = [
        [s["t_s"], s["rss_bytes"]] for s in db.query(f"select * from samples where {where} order by rowid", keys)
    ]
    return {
        "arm": a["arm"],
        "command": json.loads(a["command"] or "[]"),
        "env": json.loads(a.get("env") or "{}"),
        "status": a["status"],
        "error": a["error"],
        "load_to_ready_s": a["load_to_ready_s"],
        "peak_rss_bytes": a["peak_rss_bytes"],
        "rss_samples": samples,
        "stderr_tail": a["stderr_tail"] or "",
        "kernels": json.loads(a.get("kernels") or "null"),
        "quality": json.loads(a.get("quality") or "null"),
        "device_memory": json.loads(a.get("device_memory") or "null"),
        "endpoint": json.loads(a.get("endpoint") or "null"),
        "cells": cells,
    }


def _request(q: dict) -> dict:
    return {
        "phase": q["phase"],
        "attempt": q["attempt"],
        "index": q["idx"],
        "prompt_tokens_sent": q["prompt_tokens_sent"],
        "ok": bool(q["ok"]),
        "error": q["error"],
        "timeout_kind": q.get("timeout_kind"),
        "status_code": q.get("status_code"),
        "sent_at": q["sent_at"],
        "headers_ms": q["headers_ms"],
        "first_byte_ms": q["first_byte_ms"],
        "ttft_ms": q["ttft_ms"],
        "tpot_ms": q["tpot_ms"],
        "e2el_ms": q["e2el_ms"],
        "event_ms": [],
        "itl_ms": json.loads(q["itl_ms"] or "[]"),
        "output_tokens": q["output_tokens"],
        "prompt_tokens": q["prompt_tokens"],
        "cached_tokens": q["cached_tokens"],
        "finish_reason": q["finish_reason"],
        "output_sha256": q["output_sha256"],
        "text": "",
        "token_ids": None,
        "prompt_sha256": q.get("prompt_sha256"),
    }
