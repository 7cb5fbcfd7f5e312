"""Rebuild a run record (the JSON companion's shape) from the database alone, or a run's requests as a table.

What the database does not keep (SSE event arrival times, generated text,
token ids) comes back empty; everything the report's tables need is there.
"""

from __future__ import annotations

import json

import pandas as pd
import sqlite_utils

from harness.records import SCHEMA_VERSION


def requests_frame(db: sqlite_utils.Database, run_id: str) -> pd.DataFrame:
    """One row per request of a run, in the order they were recorded: the keys (run_id, block, model, arm,
    phase, attempt, idx), then the requests table's status and metric columns (itl_ms stays a JSON list).
    Integer columns stay integers where a failed request left them empty."""
    _run_row(db, run_id)
    return pd.read_sql("select * from requests where run_id = ? order by rowid", db.conn, params=[run_id],
                       dtype_backend="numpy_nullable")  # fmt: skip


def _run_row(db: sqlite_utils.Database, run_id: str) -> dict:
    rows = list(db.query("select * from runs where run_id = ?", [run_id]))
    if not rows:
        raise KeyError(run_id)
    return rows[0]


def export_run(db: sqlite_utils.Database, run_id: str) -> dict:
    r = _run_row(db, run_id)
    models: dict[tuple[int, str], dict] = {}
    for a in db.query("select * from arms where run_id = ? order by rowid", [run_id]):
        key = (a["block"], a["model"])
        m = models.setdefault(key, {"model": a["model"], "model_dir": "", "manifest_sha256": a["manifest_sha256"],
                                    "workload_sha256": a["workload_sha256"], "workload_path": None,
                                    "block": a["block"], "workload_seed": a["block"], "arm_order": [], "arms": [],
                                    "parity": {}})  # fmt: skip
        m["arm_order"].append(a["arm"])
        cells = []
        for c in db.query("select * from cells where run_id = ? and block = ? and model = ? and arm = ? order by rowid",
                          [run_id, a["block"], a["model"], a["arm"]]):  # fmt: skip
            reqs = list(db.query("select * from requests where run_id = ? and block = ? and model = ? and arm = ? "
                                 "and phase = ? order by attempt, idx",
                                 [run_id, a["block"], a["model"], a["arm"], c["phase"]]))  # fmt: skip
            attempts = []
            for n in sorted({q["attempt"] for q in reqs}):
                got = [_request(q) for q in reqs if q["attempt"] == n]
                errors = [q["error"] for q in got if q["error"]]
                attempts.append({"attempt": n, "ok": not errors, "error": errors[0] if errors else None,
                                 "wall_s": None, "requests": got})  # fmt: skip
            cells.append({"phase": c["phase"], "status": c["status"], "reason": c["reason"], "attempts": attempts,
                          "metrics": json.loads(c["metrics"] or "{}")})  # fmt: skip
        m["arms"].append({"arm": a["arm"], "command": json.loads(a["command"] or "[]"), "env": {}, "status": a["status"],
                          "error": a["error"], "load_to_ready_s": a["load_to_ready_s"],
                          "peak_rss_bytes": a["peak_rss_bytes"], "rss_samples": [], "stderr_tail": a["stderr_tail"] or "",
                          "kernels": json.loads(a.get("kernels") or "null"), "cells": cells})  # fmt: skip
    return {
        "schema_version": SCHEMA_VERSION, "run_id": r["run_id"], "created": r["created"], "kind": r["kind"],
        "label": r["label"], "diagnostic": bool(r["diagnostic"]), "settings": json.loads(r["settings"] or "{}"),
        "provenance": json.loads(r["provenance"] or "{}"), "preflight": json.loads(r["preflight"] or "{}"),
        "commands": {a["arm"]: a["command"] for m in models.values() for a in m["arms"]},
        "models": list(models.values()), "finished": bool(r["finished"]), "exported_from_db": True,
    }  # fmt: skip


def _request(q: dict) -> dict:
    return {"phase": q["phase"], "attempt": q["attempt"], "index": q["idx"], "prompt_tokens_sent": q["prompt_tokens_sent"],
            "ok": bool(q["ok"]), "error": q["error"], "sent_at": q["sent_at"], "headers_ms": q["headers_ms"],
            "first_byte_ms": q["first_byte_ms"], "ttft_ms": q["ttft_ms"], "tpot_ms": q["tpot_ms"], "e2el_ms": q["e2el_ms"],
            "event_ms": [], "itl_ms": json.loads(q["itl_ms"] or "[]"), "output_tokens": q["output_tokens"],
            "prompt_tokens": q["prompt_tokens"], "cached_tokens": q["cached_tokens"], "finish_reason": q["finish_reason"],
            "output_sha256": q["output_sha256"], "text": "", "token_ids": None}  # fmt: skip
