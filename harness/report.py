"""`harness report`: saved run JSON -> one view model -> HTML (jinja2), Markdown or JSON.

Reads only the JSON files it is given: no model, server, GPU or network. The
HTML is one self-contained file: CSS inline, plots as inline SVG, no script
and no external reference of any kind (a Content-Security-Policy forbids
fetching anything). Ratios against the baseline arm appear only where both
arms did the same work in that phase (same prompts, output counts and finish
reasons); otherwise the ratio is withheld and the reason shown. A decode cell
too short to time (`summary.too_short`) carries that flag. Every string from a
run is escaped: by jinja2's autoescape in HTML, by `summary.md_cell` /
`md_text` in Markdown.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Optional

from jinja2 import Environment, FunctionLoader, StrictUndefined, select_autoescape

from harness import stats
from harness.records import FAILED, MEASURED, NOT_MEASURED, RECOVERED, SCHEMA_VERSION
from harness.summary import cell_of, md_row, md_text, metric, ok_requests, same_work, too_short


def templates() -> Traversable:
    """The folder holding report.html.j2: the package harness.templates, which pyproject.toml maps onto the
    repository's top-level templates/ (a wheel ships it as harness/templates/). setuptools' editable finder
    cannot import a package mapped onto a folder without __init__.py, so an editable install reads the
    checkout's folder directly."""
    try:
        return resources.files("harness.templates")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "templates"


TEMPLATES = templates()
BURST_GAP_MS = 0.1  # stream events closer than this arrived in one read

# (phase or phase prefix, metric key, label, higher is better)
RATIO_METRICS = [
    ("decode", "median_decode_tps", "decode tok/s", True),
    ("cold", "median_ttft_ms", "TTFT cold", False),
    ("warm", "median_ttft_ms", "TTFT warm", False),
    ("long", "median_ttft_ms", "TTFT long", False),
    ("concurrency-", "output_throughput", "aggregate tok/s", True),
]


def _matches(phase: str, prefix: str) -> bool:
    """A RATIO_METRICS entry names a phase, or with a trailing '-' a family of them."""
    return phase == prefix or (prefix.endswith("-") and phase.startswith(prefix))


@dataclass(frozen=True)
class Input:
    path: Path
    sha256: str
    run: dict


def load(paths: list[Path]) -> list[Input]:
    inputs = []
    for path in paths:
        try:
            raw = path.read_bytes()
            run = json.loads(raw)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        if not isinstance(run, dict) or run.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{path}: not a harness run record (schema_version {SCHEMA_VERSION} expected)")
        inputs.append(Input(path, hashlib.sha256(raw).hexdigest(), run))
    return inputs


# ------------------------------------------------------------------ pieces


def _provenance(inp: Input) -> dict:
    run, p = inp.run, inp.run["provenance"]
    return {
        "file": inp.path.name, "sha256": inp.sha256, "run_id": run["run_id"], "kind": run["kind"],
        "created": run["created"], "label": run.get("label"), "diagnostic": run["diagnostic"],
        "finished": run.get("finished"), "status": run.get("status"), "error": run.get("error"),
        "host": p.get("host"), "machine": machine(run), "os": p.get("os"),
        "versions": f"Python {p.get('python')}, MLX {p.get('mlx')}, mlx-lm {p.get('mlx_lm')}",
        "commit": (p.get("git_commit") or "?")[:12] + (" (uncommitted changes)" if p.get("git_dirty") else ""),
        "source_tree_sha256": p.get("source_tree_sha256"), "environment": p.get("environment") or {},
        "commands": run.get("commands", {}), "seeds": sorted({m["workload_seed"] for m in run["models"]}),
        "workloads": sorted({m["workload_sha256"][:16] for m in run["models"]}), "preflight": run.get("preflight"),
    }  # fmt: skip


def machine(run: dict) -> str:
    p = run["provenance"]
    return p.get("gpu") or f"{p.get('cpu')} ({p.get('cpu_count')} CPUs)"


def _cell_view(cell: dict) -> dict:
    m = cell.get("metrics") or {}
    value = None
    if cell["status"] in (MEASURED, RECOVERED):
        if cell["phase"] == "decode":
            value = _fmt(m.get("median_decode_tps"), "tok/s")
        elif cell["phase"] in ("cold", "warm", "long", "warmup", "probe"):
            value = _fmt(m.get("median_ttft_ms"), "ms TTFT", 0)
        elif cell["phase"].startswith("concurrency-"):
            value = _fmt(m.get("output_throughput"), "tok/s")
    flags = []
    if cell["phase"] == "decode" and cell["status"] in (MEASURED, RECOVERED):
        short = too_short(cell)
        if short:
            flags.append(short + " (the rate means little)")
    if m.get("short_outputs"):
        flags.append(f"{m['short_outputs']} outputs shorter than {m.get('requested_output_tokens')} tokens")
    if m.get("new_shapes") and cell["phase"] != "warmup":
        flags.append(f"{m['new_shapes']} new forward shapes (compiled on CUDA during the cell)")
    reasons = m.get("finish_reasons") or []
    if reasons and reasons != ["length"]:
        flags.append("finish: " + ", ".join(reasons) + (" (early EOS?)" if "stop" in reasons else ""))
    cached = [c for c in (m.get("cached_tokens") or []) if c]
    if cached:
        flags.append(f"cached tokens {', '.join(map(str, cached[:4]))}")
    if len(cell["attempts"]) > 1:
        flags.append(f"{len(cell['attempts'])} attempts")
    reqs = ok_requests(cell) if cell["status"] in (MEASURED, RECOVERED) else []
    gaps = [g for r in reqs for g in r["itl_ms"]]
    instant = sum(g < BURST_GAP_MS for g in gaps)
    if gaps and instant * 2 > len(gaps):
        # Most tokens arrived together: TPOT and decode rates then describe the bursts, not the
        # decoding (mlx_lm.server, for one, flushes once per decode window).
        flags.append(f"bursty stream: {instant} of {len(gaps)} token gaps under {BURST_GAP_MS} ms")
    return {"phase": cell["phase"], "status": cell["status"], "value": value, "flags": flags,
            "reason": cell.get("reason")}  # fmt: skip


def _fmt(x: Optional[float], unit: str, digits: int = 1) -> Optional[str]:
    return None if x is None else f"{x:,.{digits}f} {unit}"


def _phases(arm: dict) -> list[str]:
    return [c["phase"] for c in arm["cells"]]


def _ratio_rows(model: dict, baseline: str) -> list[dict]:
    base = next((a for a in model["arms"] if a["arm"] == baseline), None)
    rows = []
    if base is None:
        return rows
    for arm in model["arms"]:
        if arm is base:
            continue
        for phase in _phases(arm):
            for prefix, key, label, higher in RATIO_METRICS:
                if not _matches(phase, prefix):
                    continue
                a, b = metric(arm, phase, key), metric(base, phase, key)
                why = same_work(arm, base, phase)
                row = {"arm": arm["arm"], "phase": phase, "metric": label, "value": a, "baseline": b,
                       "ratio": None, "withheld": None, "higher_is_better": higher}  # fmt: skip
                if why is None and a and b:
                    row["ratio"] = a / b
                else:
                    row["withheld"] = why or "no value on one side"
                rows.append(row)
    return rows


def _strip(values: list[float], width: int = 360, height: int = 28) -> dict:
    """Points of a one-dimensional strip plot, scaled into the SVG box."""
    if not values:
        return {"points": [], "low": None, "high": None, "width": width, "height": height}
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    pts = [{"x": round(10 + (v - lo) / span * (width - 20), 1), "y": height / 2, "v": round(v, 2)} for v in values]
    return {"points": pts, "low": round(lo, 2), "high": round(hi, 2), "width": width, "height": height}


def _scatter(points: list[dict], width: int = 520, height: int = 260) -> dict:
    """Memory (x) versus decode rate (y), one labelled point per arm."""
    pts = [p for p in points if p["x"] is not None and p["y"] is not None]
    if not pts:
        return {"points": [], "width": width, "height": height}
    xs, ys = [p["x"] for p in pts], [p["y"] for p in pts]
    x0, x1, y0, y1 = 0, max(xs) * 1.1, 0, max(ys) * 1.15
    out = [{"cx": round(50 + (p["x"] - x0) / (x1 - x0) * (width - 80), 1),
            "cy": round(height - 30 - (p["y"] - y0) / (y1 - y0) * (height - 50), 1), **p} for p in pts]  # fmt: skip
    return {"points": out, "width": width, "height": height, "x_max": round(x1, 1), "y_max": round(y1, 1)}


def _requests(inp: Input, model: dict, arm: dict) -> list[dict]:
    rows = []
    for cell in arm["cells"]:
        for att in cell["attempts"]:
            for r in att["requests"]:
                rows.append({"run": inp.run["run_id"], "block": model["block"], "model": model["model"],
                             "arm": arm["arm"], "phase": cell["phase"], "attempt": att["attempt"], "idx": r["index"],
                             "ok": r["ok"], "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"], "e2el_ms": r["e2el_ms"],
                             "output_tokens": r["output_tokens"], "finish_reason": r["finish_reason"],
                             "cached_tokens": r["cached_tokens"], "output_sha256": (r["output_sha256"] or "")[:12],
                             "error": r["error"]})  # fmt: skip
    return rows


def _paired(inputs: list[Input], baseline: str) -> list[dict]:
    """For trials inputs: per model, arm and metric, the per-block ratios and their bootstrap verdict."""
    out = []
    for inp in inputs:
        if inp.run["kind"] != "trials":
            continue
        by_model: dict[str, list[dict]] = {}
        for m in inp.run["models"]:
            by_model.setdefault(m["model"], []).append(m)
        for name, blocks in by_model.items():
            arms = sorted({a["arm"] for b in blocks for a in b["arms"]} - {baseline})
            for arm_name in arms:
                for prefix, key, label, higher in RATIO_METRICS:
                    phases = sorted({c["phase"] for b in blocks for a in b["arms"] for c in a["cells"]
                                     if _matches(c["phase"], prefix)})
                    for phase in phases:
                        ratios, seeds, skipped = [], [], 0
                        for b in blocks:
                            arm = next((a for a in b["arms"] if a["arm"] == arm_name), None)
                            base = next((a for a in b["arms"] if a["arm"] == baseline), None)
                            if arm is None or base is None or same_work(arm, base, phase) is not None:
                                skipped += 1
                                continue
                            x, y = metric(arm, phase, key), metric(base, phase, key)
                            if not x or not y:
                                skipped += 1
                                continue
                            ratios.append(x / y)
                            seeds.append(b["workload_seed"])
                        if not ratios:
                            continue
                        res = stats.paired(f"{label} ({phase})", ratios, seeds, higher_is_better=higher)
                        out.append({"run": inp.run["run_id"], "model": name, "arm": arm_name, "baseline": baseline,
                                    "skipped_blocks": skipped, **res.as_record()})  # fmt: skip
    return out


def _choose_baseline(inputs: list[Input], baseline: Optional[str]) -> str:
    arms = [a["arm"] for inp in inputs for m in inp.run["models"] for a in m["arms"]]
    if baseline is not None:
        if baseline not in arms:
            raise ValueError(f"baseline arm {baseline!r} is in none of the inputs (arms: {sorted(set(arms))})")
        return baseline
    return "mlx-lm" if "mlx-lm" in arms else (arms[0] if arms else "")


# -------------------------------------------------------------- the view


def build_view(inputs: list[Input], baseline: Optional[str] = None) -> dict[str, Any]:
    baseline = _choose_baseline(inputs, baseline)
    machines: dict[str, list[dict]] = {}
    ratios, strips, memory, identity, failures, requests, quality = [], [], [], [], [], [], []
    for inp in inputs:
        for model in inp.run["models"]:
            where = f"{inp.run['run_id']} / {model['model']}" + (f" / block {model['block']}" if inp.run["kind"] == "trials" else "")
            verdicts = (model.get("parity") or {}).get("verdicts", {})
            for arm in model["arms"]:
                cells = [_cell_view(c) for c in arm["cells"]]
                for c in cells:
                    v = verdicts.get(arm["arm"])
                    if c["phase"] == "probe" and v is not None:
                        c["flags"].insert(0, "parity probe: " + ("same output" if v["match"] else "OUTPUT DIFFERS"))
                machines.setdefault(machine(inp.run), []).append({
                    "where": where, "arm": arm["arm"], "arm_status": arm["status"], "arm_error": arm.get("error"),
                    "load_to_ready_s": arm.get("load_to_ready_s"), "peak_rss_mib": (arm.get("peak_rss_bytes") or 0) / 2**20,
                    "cells": cells, "diagnostic": inp.run["diagnostic"],
                })  # fmt: skip
                decode = cell_of(arm, "decode")
                itl = [x for r in (ok_requests(decode) if decode else []) for x in r["itl_ms"]]
                ttft = [r["ttft_ms"] for c in arm["cells"] if c["status"] in (MEASURED, RECOVERED)
                        for r in ok_requests(c) if r["ttft_ms"] is not None and c["phase"] not in ("warmup",)]  # fmt: skip
                strips.append({"where": where, "arm": arm["arm"],
                               "decode": _strip((decode or {}).get("metrics", {}).get("decode_tps_samples") or []),
                               "ttft": _strip(ttft), "itl": _strip(itl)})  # fmt: skip
                memory.append({"label": f"{arm['arm']} ({model['model']})", "x": (arm.get("peak_rss_bytes") or 0) / 2**20 or None,
                               "y": metric(arm, "decode", "median_decode_tps")})  # fmt: skip
                if arm.get("quality"):
                    q = arm["quality"]
                    quality.append({"where": where, "arm": arm["arm"], "tier": q.get("tier"), "tokens": q.get("tokens"),
                                    "perplexity": q.get("perplexity"), "error": q.get("error"),
                                    "peak_rss_mib": (arm.get("peak_rss_bytes") or 0) / 2**20 or None})  # fmt: skip
                if arm["status"] == FAILED or arm.get("error"):
                    what = "server" if arm["status"] == FAILED else arm["status"]  # interrupted, say
                    failures.append({"where": where, "arm": arm["arm"], "what": what, "error": arm.get("error"),
                                     "stderr_tail": arm.get("stderr_tail", "")[-2000:]})  # fmt: skip
                for c in arm["cells"]:
                    if c["status"] in (FAILED, RECOVERED):
                        errors = [a["error"] for a in c["attempts"] if a["error"]]
                        failures.append({"where": where, "arm": arm["arm"], "what": f"{c['phase']} ({c['status']})",
                                         "error": c.get("reason") or "; ".join(errors), "stderr_tail": ""})  # fmt: skip
                requests += _requests(inp, model, arm)
            ratios.append({"where": where, "rows": _ratio_rows(model, baseline)})
            identity.append({"where": where, "reference": (model.get("parity") or {}).get("reference"),
                             "verdicts": (model.get("parity") or {}).get("verdicts", {}),
                             "arms": [a["arm"] for a in model["arms"]]})  # fmt: skip
    matrix = {}
    for mach, rows in machines.items():
        phases = list(dict.fromkeys(c["phase"] for r in rows for c in r["cells"]))
        for r in rows:
            by_phase = {c["phase"]: c for c in r["cells"]}
            r["cells"] = [by_phase.get(p) or {"phase": p, "status": NOT_MEASURED, "value": None, "flags": [],
                                              "reason": "not in this run"} for p in phases]  # fmt: skip
        matrix[mach] = {"phases": phases, "rows": rows}
    return {
        "title": "harness report: " + ", ".join(i.path.name for i in inputs),
        "baseline": baseline,
        "provenance": [_provenance(i) for i in inputs],
        "machines": matrix,
        "ratios": ratios,
        "paired": _paired(inputs, baseline),
        "strips": strips,
        "memory": _scatter(memory),
        "identity": identity,
        "quality": quality,
        "failures": failures,
        "requests": requests,
        "statuses": [MEASURED, RECOVERED, FAILED, NOT_MEASURED, "unsupported"],
    }


# ------------------------------------------------------------- renderers


def render_html(view: dict) -> str:
    loader = FunctionLoader(lambda name: (TEMPLATES / name).read_text(encoding="utf-8"))
    env = Environment(loader=loader, autoescape=select_autoescape(["html", "j2"], default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip
    return env.get_template("report.html.j2").render(**view)


def render_markdown(view: dict) -> str:
    lines = [f"# {md_text(view['title'])}", "", f"Baseline arm: {md_text(view['baseline'])}", "", "## Serving matrix", ""]
    for mach, m in view["machines"].items():
        lines += [f"### {md_text(mach)}", "", md_row(["run / model", "arm", *m["phases"]]),
                  "|---|---|" + "---|" * len(m["phases"])]  # fmt: skip
        for r in m["rows"]:
            cells = [f"{c['status']}" + (f": {c['value']}" if c["value"] else "") for c in r["cells"]]
            lines.append(md_row([r["where"], r["arm"], *cells]))
        lines.append("")
    lines += ["## Ratios against the baseline", "", "| run / model | arm | phase | metric | ratio |", "|---|---|---|---|---|"]
    for group in view["ratios"]:
        for r in group["rows"]:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else f"withheld: {r['withheld']}"
            lines.append(md_row([group["where"], r["arm"], r["phase"], r["metric"], ratio]))
    if view["paired"]:
        lines += ["", "## Paired blocks", "", "| model | arm | metric | blocks | geomean | 95% interval | verdict |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in view["paired"]:
            ci = f"{p['ci_low']:.3f}-{p['ci_high']:.3f}" if p["ci_low"] is not None else "-"
            lines.append(md_row([p["model"], p["arm"], p["metric"], p["blocks"], f"{p['geomean']:.3f}", ci,
                                 f"{p['verdict']} {p['note']}"]))  # fmt: skip
    if view["quality"]:
        lines += ["", "## Quality and size", "", "| run / model | arm | tier | held-out tokens | perplexity | peak RSS MiB |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for q in view["quality"]:
            ppl = f"{q['perplexity']:g}" if q["perplexity"] is not None else f"not measured: {q['error']}"
            rss = f"{q['peak_rss_mib']:.0f}" if q["peak_rss_mib"] else "-"
            lines.append(md_row([q["where"], q["arm"], q["tier"] or "-", q["tokens"] or "-", ppl, rss]))
    if view["failures"]:
        lines += ["", "## Failures", ""] + [f"- {md_text(f['where'])} / {md_text(f['arm'])} / {md_text(f['what'])}: "
                                            f"{md_text(f['error'])}" for f in view["failures"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def render_json(view: dict) -> str:
    return json.dumps(view, indent=1, default=str)
