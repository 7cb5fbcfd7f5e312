"""`harness report`: saved JSON -> one view model -> HTML (jinja2), Markdown or JSON.

Reads only the JSON files it is given: no model, server, GPU or network. The
HTML is one self-contained file: CSS inline, plots as inline SVG
(`report_plots`), no script and no external reference of any kind (a
Content-Security-Policy forbids fetching anything). Its first screen is the
headline: per model, each arm against the baseline arm on decode, TTFT,
aggregate throughput at each concurrency, goodput and memory, every ratio with
its interval and verdict from the paired requests (`stats.sample_ratio`), or
the reason it is withheld (`comparable.withheld`: a busy machine, a cell too
short to time, other work); then the throughput-latency curves, latency
percentiles and distributions. A baseline arm from another file is compared
only when host, artifact and workload match. In-process files (`harness
native`, `spec`, `quality`; `report_inputs`) get sections of their own. Every
string from a run is escaped: by jinja2's autoescape in HTML, by
`summary.md_cell` / `md_text` in Markdown; in the plots it is drawn as paths.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Optional

from jinja2 import Environment, FunctionLoader, StrictUndefined, select_autoescape

from harness import anomalies, comparable, report_inputs, report_plots, stats
from harness.report_markdown import render_markdown  # noqa: F401 - the report's renderers are all here
from harness.records import FAILED, MEASURED, NOT_MEASURED, RECOVERED
from harness.summary import LATENCY_HEADERS, cell_of, latency_rows, metric, ok_requests, too_short


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

CV_FLAG = 0.10  # a cell whose requests' coefficient of variation passes this is flagged unstable

# (phase or phase prefix, metric key, label, higher is better)
RATIO_METRICS = [
    ("decode", "median_decode_tps", "decode tok/s", True),
    ("chat", "median_decode_tps", "decode tok/s chat", True),
    ("cold", "median_ttft_ms", "TTFT cold", False),
    ("cold", "median_prefill_tps", "prefill tok/s cold", True),
    ("warm", "median_ttft_ms", "TTFT warm", False),
    ("long", "median_ttft_ms", "TTFT long", False),
    ("concurrency-", "output_throughput", "aggregate tok/s", True),
    ("prefix", "median_ttft_ms", "TTFT shared prefix", False),
    ("multiturn", "median_ttft_ms", "TTFT multi-turn", False),
    ("staggered", "median_ttft_ms", "TTFT staggered", False),
    ("staggered", "median_prefill_tps", "prefill tok/s staggered", True),
    ("rate-", "output_throughput", "aggregate tok/s", True),
]


def _matches(phase: str, prefix: str) -> bool:
    """A RATIO_METRICS entry names a phase, or with a trailing '-' a family of them."""
    return phase == prefix or (prefix.endswith("-") and phase.startswith(prefix))


@dataclass(frozen=True)
class Input:
    path: Path
    sha256: str
    run: Any  # a run record; for the other kinds, what the command wrote
    kind: str = report_inputs.RUN


def load(paths: list[Path]) -> list[Input]:
    inputs = []
    for path in paths:
        try:
            raw = path.read_bytes()
            data = json.loads(raw)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        kind = report_inputs.kind_of(data)
        if kind is None:
            raise ValueError(f"{path}: not a harness run record (harness run / trials) nor harness native, spec "
                             "or quality JSON")  # fmt: skip
        inputs.append(Input(path, hashlib.sha256(raw).hexdigest(), data, kind))
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
        "stability": stability(run),
    }  # fmt: skip


def stability(run: dict) -> list[str]:
    """What marks a run as measured on an unquiet machine or a moving tree: the run-level reason, the preflight
    check at the end, the cells after which it found the machine busy."""
    out = [why] if (why := comparable.run_reason(run)) else []
    out += [f"at the end of the run: {p}" for p in (run.get("preflight_end") or {}).get("problems") or ()]
    busy = [f"{m['model']} / {a['arm']} / {c['phase']}" for m in run["models"] for a in m["arms"] for c in a["cells"]
            if ((c.get("metrics") or {}).get("preflight") or {}).get("problems")]  # fmt: skip
    if busy:
        out.append(f"the machine was busy after {len(busy)} cells ({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})")
    return out


def machine(run: dict) -> str:
    p = run["provenance"]
    return p.get("gpu") or f"{p.get('cpu')} ({p.get('cpu_count')} CPUs)"


def _cell_view(cell: dict, load: Optional[dict] = None) -> dict:
    """A serving-matrix cell: its status, its value and its flags; `load`: the run's workload settings."""
    m = cell.get("metrics") or {}
    value = None
    if cell["status"] in (MEASURED, RECOVERED):
        if cell["phase"] in ("decode", "chat"):
            value = _fmt(m.get("median_decode_tps"), "tok/s")
        elif cell["phase"] in ("cold", "warm", "long", "warmup", "probe", "prefix", "multiturn", "staggered"):
            value = _fmt(m.get("median_ttft_ms"), "ms TTFT", 0)
            if value and m.get("median_prefill_tps") is not None:
                value += f", prefill {_fmt(m['median_prefill_tps'], 'tok/s', 0)}"
        elif cell["phase"].startswith("concurrency-"):
            value = _fmt(m.get("output_throughput"), "tok/s")
        elif cell["phase"].startswith("rate-"):
            value = f"{_fmt(m.get('output_throughput'), 'tok/s')}, {_fmt(m.get('request_throughput'), 'req/s', 2)} achieved"
    flags = anomalies.cell_flags(cell, load or {})
    if cell["phase"] == "decode" and cell["status"] in (MEASURED, RECOVERED):
        short = too_short(cell)
        if short:
            flags.append(short + " (the rate means little)")
    if m.get("short_outputs"):
        flags.append(f"{m['short_outputs']} outputs shorter than {m.get('requested_output_tokens')} tokens")
    if m.get("new_shapes") and cell["phase"] != "warmup":
        flags.append(f"{m['new_shapes']} new forward shapes (compiled on CUDA during the cell)")
    if m.get("compiled_modules") and cell["phase"] != "warmup":
        flags.append(f"{m['compiled_modules']} kernel modules compiled during the cell")
    reasons = m.get("finish_reasons") or []
    if reasons and reasons != ["length"]:
        flags.append("finish: " + ", ".join(reasons) + (" (early EOS?)" if "stop" in reasons else ""))
    cached = [c for c in (m.get("cached_tokens") or []) if c]
    if cached:
        flags.append(f"cached tokens {', '.join(map(str, cached[:4]))}")
    if len(cell["attempts"]) > 1:
        flags.append(f"{len(cell['attempts'])} attempts")
    reqs = ok_requests(cell) if cell["status"] in (MEASURED, RECOVERED) else []
    cv, n = coefficient_of_variation(cell) if reqs and cell["phase"] not in ("warmup", "probe") else (None, 0)
    if cv is not None and cv > CV_FLAG:
        flags.append(f"unstable: the requests' CV is {cv:.0%} over {n} (flagged above {CV_FLAG:.0%})")
    busy = (m.get("preflight") or {}).get("problems")
    if busy:
        flags.append(f"machine busy after the cell: {busy[0]}")
    gaps = [g for r in reqs for g in r["itl_ms"]]
    instant = sum(g < BURST_GAP_MS for g in gaps)
    if gaps and instant * 2 > len(gaps):
        # Most tokens arrived together: TPOT and decode rates then describe the bursts, not the
        # decoding (mlx_lm.server, for one, flushes once per decode window).
        flags.append(f"bursty stream: {instant} of {len(gaps)} token gaps under {BURST_GAP_MS} ms")
    return {"phase": cell["phase"], "status": cell["status"], "value": value, "flags": flags,
            "reason": cell.get("reason")}  # fmt: skip


def coefficient_of_variation(cell: dict) -> tuple[Optional[float], int]:
    """(CV, samples) of the per-request quantity a cell is read by: decode rates in the decode phase, TPOT at
    concurrency (TTFT there grows with queueing by design), TTFT elsewhere; None below 3 requests."""
    reqs = ok_requests(cell)
    if cell["phase"] == "decode":
        values = [1e3 / r["tpot_ms"] for r in reqs if r.get("tpot_ms")]
    elif cell["phase"].startswith("concurrency-"):
        values = [r["tpot_ms"] for r in reqs if r.get("tpot_ms")]
    else:
        values = [r["ttft_ms"] for r in reqs if r.get("ttft_ms") is not None]
    if len(values) < 3:
        return None, len(values)
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return (sd / mean if mean else None), len(values)


def _fmt(x: Optional[float], unit: str, digits: int = 1) -> Optional[str]:
    return None if x is None else f"{x:,.{digits}f} {unit}"


def _phases(arm: dict) -> list[str]:
    return [c["phase"] for c in arm["cells"]]


def _baseline(inp: Input, model: dict, runs: list[Input], baseline: str) -> tuple[Optional[dict], Optional[dict], str]:
    """(the baseline's run, its arm, a note) for a model record: its own baseline arm, else one of another input
    with the same host, artifact and workload; (None, None, why not) otherwise ("" where no input has one)."""
    own = next((a for a in model["arms"] if a["arm"] == baseline), None)
    if own is not None:
        return inp.run, own, ""
    host = inp.run["provenance"].get("host")
    reasons = []
    for other in runs:
        for m in other.run["models"] if other is not inp else ():
            arm = next((a for a in m["arms"] if a["arm"] == baseline), None)
            if arm is None or m["model"] != model["model"]:
                continue
            differ = [what for what, x, y in (("host", other.run["provenance"].get("host"), host),
                                               ("artifact", m["manifest_sha256"], model["manifest_sha256"]),
                                               ("workload", m["workload_sha256"], model["workload_sha256"])) if x != y]  # fmt: skip
            if not differ:
                return other.run, arm, f"{baseline} from {other.path.name}"
            reasons.append(f"{baseline} is in {other.path.name} on another {' and '.join(differ)}")
    return None, None, "; ".join(reasons) + (": shown side by side, not divided" if reasons else "")


def _headline(inp: Input, model: dict, runs: list[Input], baseline: str) -> dict:
    """Each arm against the baseline (`comparable.compare`): decode, TTFT, aggregate throughput and goodput at
    each concurrency, then memory (one reading each: a ratio, no interval)."""
    base_run, base, note = _baseline(inp, model, runs, baseline)
    slo = dict(inp.run["settings"].get("goodput") or [])
    rows = []
    for arm in model["arms"]:
        if base is None or arm is base:
            continue
        for phase in _phases(arm):
            for prefix, key, label, higher in RATIO_METRICS:
                if not _matches(phase, prefix):
                    continue
                level = phase.split("-", 1)[1] if prefix in ("concurrency-", "rate-") else ""
                name = label + (f" @{level}" if level else "") + (" req/s" if prefix == "rate-" else "")
                rows.append(comparable.compare(inp.run, arm, base_run, base, phase, name, key, higher))
                if prefix in ("concurrency-", "rate-") and slo:
                    rows.append(comparable.compare(inp.run, arm, base_run, base, phase,
                                                   f"goodput req/s @{level}" + (" req/s" if prefix == "rate-" else ""),
                                                   "request_goodput", True, slo))  # fmt: skip
        for label, value in (("peak RSS MiB", lambda a: (a.get("peak_rss_bytes") or 0) / 2**20 or None),
                             ("device peak MiB", lambda a: ((a.get("device_memory") or {}).get("peak_bytes") or 0) / 2**20 or None)):  # fmt: skip
            a, b = value(arm), value(base)
            if a is None or (b is None and label.startswith("device")):  # mlx_lm.server reports no device memory
                continue
            rows.append({"arm": arm["arm"], "baseline_arm": base["arm"], "phase": "-", "metric": label, "value": a,
                         "baseline": b, "higher_is_better": False, "ratio": a / b if a and b else None,
                         "ci_low": None, "ci_high": None, "verdict": None, "samples": 0,
                         "note": "one reading" if a and b else "", "withheld": None if a and b else "no value on one side",
                         "outputs": ""})  # fmt: skip
    return {"where": _where(inp, model), "baseline": baseline, "note": note, "rows": rows}


def _where(inp: Input, model: dict) -> str:
    return f"{inp.run['run_id']} / {model['model']}" + (f" / block {model['block']}" if inp.run["kind"] == "trials" else "")


def _curves(inp: Input, model: dict) -> dict:
    """The model's plots (`report_plots`): throughput and latency percentiles against concurrency, and the
    distributions of TTFT and TPOT over the concurrency cells' requests (the decode phase's where none)."""
    aggregate, per_request, cdf = {}, {}, {}
    ttft: dict[str, dict] = {p: {} for p, _ in report_plots.PERCENTILE_STYLES}
    tpot: dict[str, dict] = {p: {} for p, _ in report_plots.PERCENTILE_STYLES}
    for arm in model["arms"]:
        name = arm["arm"]
        cells = [c for c in arm["cells"] if c["phase"].startswith("concurrency-") and c["status"] in (MEASURED, RECOVERED)]
        for c in cells:
            level, m = int(c["phase"].split("-", 1)[1]), c["metrics"]
            aggregate.setdefault(name, []).append((level, m.get("output_throughput")))
            per_request.setdefault(name, []).append((level, m.get("median_decode_tps")))
            for pct in ttft:
                ttft[pct].setdefault(name, []).append((level, m.get(f"{pct}_ttft_ms" if pct != "p50" else "median_ttft_ms")))
                tpot[pct].setdefault(name, []).append((level, m.get(f"{pct}_tpot_ms" if pct != "p50" else "median_tpot_ms")))
        decode = cell_of(arm, "decode")
        pool = [r for c in cells or ([decode] if decode else []) for r in ok_requests(c)]
        cdf[name] = {"TTFT ms": [r["ttft_ms"] for r in pool], "TPOT ms": [r.get("tpot_ms") for r in pool]}
    offered, rate_ttft = {}, {p: {} for p, _ in report_plots.PERCENTILE_STYLES}
    for arm in model["arms"]:
        for c in arm["cells"]:
            if c["phase"].startswith("rate-") and c["status"] in (MEASURED, RECOVERED):
                m = c["metrics"]
                offered.setdefault(arm["arm"], []).append((m["offered_rate"], m.get("output_throughput")))
                for pct in rate_ttft:
                    rate_ttft[pct].setdefault(arm["arm"], []).append(
                        (m["offered_rate"], m.get(f"{pct}_ttft_ms" if pct != "p50" else "median_ttft_ms")))
    return {"where": _where(inp, model), "throughput": report_plots.throughput(aggregate, per_request),
            "latency": report_plots.latency(ttft, tpot), "cdf": report_plots.cdf(cdf),
            "rates": report_plots.rates(offered, rate_ttft)}


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
                        ratios, seeds, values, skipped = [], [], [], 0
                        for b in blocks:
                            arm = next((a for a in b["arms"] if a["arm"] == arm_name), None)
                            base = next((a for a in b["arms"] if a["arm"] == baseline), None)
                            if arm is None or base is None or comparable.withheld(inp.run, arm, inp.run, base, phase):
                                skipped += 1
                                continue
                            x, y = metric(arm, phase, key), metric(base, phase, key)
                            if not x or not y:
                                skipped += 1
                                continue
                            ratios.append(x / y)
                            seeds.append(b["workload_seed"])
                            values.append((x, y))
                        if not ratios:
                            continue
                        res = stats.paired(f"{label} ({phase})", ratios, seeds, higher_is_better=higher)
                        out.append({"run": inp.run["run_id"], "model": name, "arm": arm_name, "baseline": baseline,
                                    "skipped_blocks": skipped, "phase": phase, "label": label,
                                    "higher_is_better_metric": higher, "arm_mean": _geomean(v[0] for v in values),
                                    "baseline_mean": _geomean(v[1] for v in values), **res.as_record()})  # fmt: skip
    return out


def _geomean(values) -> Optional[float]:
    logs = [math.log(v) for v in values if v and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _trials_headline(inp: Input, paired: list[dict]) -> list[dict]:
    """A trials file's headline: per model, each arm's paired-block results (geometric means over blocks)."""
    groups: dict[str, list[dict]] = {}
    for p in paired:
        if p["run"] != inp.run["run_id"]:
            continue
        name = p["label"] + (f" @{p['phase'].split('-', 1)[1]}" if p["phase"].startswith("concurrency-") else "")
        groups.setdefault(p["model"], []).append({
            "arm": p["arm"], "baseline_arm": p["baseline"], "phase": p["phase"], "metric": name,
            "value": p["arm_mean"], "baseline": p["baseline_mean"], "higher_is_better": p["higher_is_better"],
            "ratio": p["geomean"], "ci_low": p["ci_low"], "ci_high": p["ci_high"], "verdict": p["verdict"],
            "note": f"{p['blocks']} blocks" + (f"; {p['note']}" if p["note"] else ""), "samples": p["blocks"],
            "withheld": None, "outputs": ""})  # fmt: skip
    return [{"where": f"{inp.run['run_id']} / {model} (trials: geometric means over paired blocks)",
             "baseline": paired[0]["baseline"] if paired else "", "note": "", "rows": rows} for model, rows in groups.items()]


def _choose_baseline(inputs: list[Input], baseline: Optional[str]) -> str:
    arms = [a["arm"] for inp in inputs for m in inp.run["models"] for a in m["arms"]]
    if baseline is not None:
        if baseline not in arms:
            raise ValueError(f"baseline arm {baseline!r} is in none of the inputs (arms: {sorted(set(arms))})")
        return baseline
    return "mlx-lm" if "mlx-lm" in arms else (arms[0] if arms else "")


# -------------------------------------------------------------- the view


def build_view(inputs: list[Input], baseline: Optional[str] = None) -> dict[str, Any]:
    runs = [i for i in inputs if i.kind == report_inputs.RUN]
    baseline = _choose_baseline(runs, baseline)
    machines: dict[str, list[dict]] = {}
    headline, curves, identity, failures, requests, quality = [], [], [], [], [], []
    for inp in runs:
        for model in inp.run["models"]:
            where = _where(inp, model)
            verdicts = (model.get("parity") or {}).get("verdicts", {})
            for arm in model["arms"]:
                cells = [_cell_view(c, inp.run["settings"].get("workload") or {}) for c in arm["cells"]]
                for c in cells:
                    v = verdicts.get(arm["arm"])
                    if c["phase"] == "probe" and v is not None:
                        c["flags"].insert(0, "parity probe: " + ("same output" if v["match"] else "OUTPUT DIFFERS"))
                memory = arm.get("device_memory") or {}
                machines.setdefault(machine(inp.run), []).append({
                    "where": where, "arm": arm["arm"], "arm_status": arm["status"], "arm_error": arm.get("error"),
                    "load_to_ready_s": arm.get("load_to_ready_s"), "peak_rss_mib": (arm.get("peak_rss_bytes") or 0) / 2**20,
                    "device_peak_mib": memory["peak_bytes"] / 2**20 if memory.get("peak_bytes") else None,
                    "device_active_mib": memory["active_bytes"] / 2**20 if memory.get("active_bytes") else None,
                    "cells": cells, "diagnostic": inp.run["diagnostic"],
                })  # fmt: skip
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
            if inp.run["kind"] != "trials":
                headline.append(_headline(inp, model, runs, baseline))
            if model["block"] == min(m["block"] for m in inp.run["models"] if m["model"] == model["model"]):
                curves.append(_curves(inp, model))  # trials: the first block's
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
    paired = _paired(runs, baseline)
    for inp in runs:
        if inp.run["kind"] == "trials":
            headline += _trials_headline(inp, paired)
    others = [i for i in inputs if i.kind != report_inputs.RUN]
    return {
        "title": "harness report: " + ", ".join(i.path.name for i in inputs),
        "baseline": baseline,
        "provenance": [_provenance(i) for i in runs],
        "headline": headline,
        "curves": curves,
        "machines": matrix,
        "latency_headers": LATENCY_HEADERS,
        "latency": [{"run": i.run["run_id"], "rows": latency_rows(i.run)} for i in runs],
        "paired": paired,
        "identity": identity,
        "quality": quality,
        "native": [row for i in others if i.kind == report_inputs.NATIVE for row in report_inputs.native_view(i.path.name, i.run)],
        "spec": [report_inputs.spec_view(i.path.name, i.run) for i in others if i.kind == report_inputs.SPEC],
        "quality_files": [t for i in others if i.kind == report_inputs.QUALITY
                          for t in report_inputs.quality_view(i.path.name, i.run)],
        "failures": failures,
        "flagged": [f"{i.run['run_id']} / {line}" for i in runs for line in anomalies.flagged_lines(i.run)],
        "requests": requests,
        "statuses": [MEASURED, RECOVERED, FAILED, NOT_MEASURED, "unsupported"],
        "single_run_threshold": stats.SINGLE_RUN_THRESHOLD,
        "cv_flag": CV_FLAG,
    }


# ------------------------------------------------------------- renderers


def render_html(view: dict) -> str:
    loader = FunctionLoader(lambda name: (TEMPLATES / name).read_text(encoding="utf-8"))
    env = Environment(loader=loader, autoescape=select_autoescape(["html", "j2"], default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip
    return env.get_template("report.html.j2").render(**view)


def render_json(view: dict) -> str:
    return json.dumps(view, indent=1, default=str)
