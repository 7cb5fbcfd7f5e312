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
from dataclasses import asdict, dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from jinja2 import Environment, FunctionLoader, StrictUndefined, select_autoescape

from harness.report import inputs as report_inputs
from harness.report import plots as report_plots
from harness.report.markdown import render_markdown  # noqa: F401 - the report's renderers are all here
from harness.run import anomalies, comparable, headline, stats
from harness.run.cells import ACHIEVED, DECODE_RATE, THROUGHPUT, TTFT, kind_of, timed
from harness.run.measured import cell_of, metric, ok_requests, too_short
from harness.run.records import FAILED, MEASURED, NOT_MEASURED, RECOVERED
from harness.run.repetitions import is_load_phase, is_repetition, repetitions
from harness.run.summary import LATENCY_HEADERS, latency_rows, perplexity_note


def templates() -> Traversable:
    """The folder holding report.html.j2: the package harness.templates, which pyproject.toml maps onto the
    repository's top-level templates/ (a wheel ships it as harness/templates/). setuptools' editable finder
    cannot import a package mapped onto a folder without __init__.py, so an editable install reads the
    checkout's folder directly."""
    try:
        return resources.files("harness.templates")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "templates"


TEMPLATES = templates()
BURST_GAP_MS = 0.1  # stream events closer than this arrived in one read

CV_FLAG = 0.10  # a cell whose requests' coefficient of variation passes this is flagged unstable


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
            raise ValueError(
                f"{path}: not a harness run record (harness run / trials) nor harness native, spec or quality JSON"
            )
        inputs.append(Input(path, hashlib.sha256(raw).hexdigest(), data, kind))
    return inputs


# ------------------------------------------------------------------ pieces


def _provenance(inp: Input) -> dict:
    run, p = inp.run, inp.run["provenance"]
    return {
        "file": inp.path.name,
        "sha256": inp.sha256,
        "run_id": run["run_id"],
        "kind": run["kind"],
        "created": run["created"],
        "label": run.get("label"),
        "diagnostic": run["diagnostic"],
        "finished": run.get("finished"),
        "status": run.get("status"),
        "error": run.get("error"),
        "host": p.get("host"),
        "machine": machine(run),
        "os": p.get("os"),
        "versions": f"Python {p.get('python')}, MLX {p.get('mlx')}, mlx-lm {p.get('mlx_lm')}",
        "commit": (p.get("git_commit") or "?")[:12] + (" (uncommitted changes)" if p.get("git_dirty") else ""),
        "source_tree_sha256": p.get("source_tree_sha256"),
        "environment": p.get("environment") or {},
        "commands": run.get("commands", {}),
        "seeds": sorted({m["workload_seed"] for m in run["models"]}),
        "workloads": sorted({m["workload_sha256"][:16] for m in run["models"]}),
        "preflight": run.get("preflight"),
        "stability": stability(run),
    }


def stability(run: dict) -> list[str]:
    """What marks a run as measured on an unquiet machine or a moving tree: the run-level reason, the preflight
    check at the end, the cells after which it found the machine busy."""
    out = [why] if (why := comparable.run_reason(run)) else []
    out += [f"at the end of the run: {p}" for p in (run.get("preflight_end") or {}).get("problems") or ()]
    busy = [
        f"{m['model']} / {a['arm']} / {c['phase']}"
        for m in run["models"]
        for a in m["arms"]
        for c in a["cells"]
        if ((c.get("metrics") or {}).get("preflight") or {}).get("problems")
    ]
    if busy:
        out.append(
            f"the machine was busy after {len(busy)} cells ({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})"
        )
    return out


def machine(run: dict) -> str:
    p = run["provenance"]
    return p.get("gpu") or f"{p.get('cpu')} ({p.get('cpu_count')} CPUs)"


def machine_name(run: dict) -> str:
    """The machine in a few words: 'NVIDIA H200', '2-core CPU (Intel Xeon Processor)'."""
    p = run["provenance"]
    if p.get("gpu"):
        return p["gpu"].split(",")[0]
    cpu = " ".join(w for w in str(p.get("cpu") or "").replace("(R)", "").replace("(TM)", "").split() if w != "None")
    return f"{p.get('cpu_count')}-core CPU" + (f" ({cpu})" if cpu else "")


def _cell_view(cell: dict, load: dict | None = None, on_gpu: bool = False) -> dict:
    """A serving-matrix cell: its status, its value and its flags; `load`: the run's workload settings; `on_gpu`: the
    run's machine has a GPU (a new forward shape compiles there)."""
    m = cell.get("metrics") or {}
    value = None
    if cell["status"] in (MEASURED, RECOVERED):
        kind = kind_of(cell["phase"])
        shows = kind.shows if kind else None
        if shows == DECODE_RATE:
            value = _fmt(m.get("median_decode_tps"), "tok/s")
        elif shows == TTFT:
            value = _fmt(m.get("median_ttft_ms"), "ms TTFT", 0)
            if value and m.get("median_prefill_tps") is not None:
                value += f", prefill {_fmt(m['median_prefill_tps'], 'tok/s', 0)}"
        elif shows == THROUGHPUT:
            value = _fmt(m.get("output_throughput"), "tok/s")
        elif shows == ACHIEVED:
            value = (
                f"{_fmt(m.get('output_throughput'), 'tok/s')}, {_fmt(m.get('request_throughput'), 'req/s', 2)} achieved"
            )
    flags = anomalies.cell_flags(cell, load or {})
    if cell["phase"] == "decode" and cell["status"] in (MEASURED, RECOVERED):
        short = too_short(cell)
        if short:
            flags.append(short + " (the rate means little)")
    if m.get("short_outputs"):
        flags.append(f"{m['short_outputs']} outputs shorter than {m.get('requested_output_tokens')} tokens")
    if m.get("new_shapes") and cell["phase"] != "warmup":
        flags.append(
            f"{m['new_shapes']} new forward shapes" + (" (compiled on CUDA during the cell)" if on_gpu else "")
        )
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
    cv, n = coefficient_of_variation(cell) if reqs and timed(cell["phase"]) else (None, 0)
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
    return {
        "phase": cell["phase"],
        "status": cell["status"],
        "value": value,
        "flags": flags,
        "reason": cell.get("reason"),
    }


def coefficient_of_variation(cell: dict) -> tuple[float | None, int]:
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


def _fmt(x: float | None, unit: str, digits: int = 1) -> str | None:
    return None if x is None else f"{x:,.{digits}f} {unit}"


def _phases(arm: dict) -> list[str]:
    return [c["phase"] for c in arm["cells"]]


def _baseline(inp: Input, model: dict, runs: list[Input], baseline: str) -> tuple[dict | None, dict | None, str]:
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
            differ = [
                what
                for what, x, y in (
                    ("host", other.run["provenance"].get("host"), host),
                    ("artifact", m["manifest_sha256"], model["manifest_sha256"]),
                    ("workload", m["workload_sha256"], model["workload_sha256"]),
                )
                if x != y
            ]
            if not differ:
                return other.run, arm, f"{baseline} from {other.path.name}"
            reasons.append(f"{baseline} is in {other.path.name} on another {' and '.join(differ)}")
    return None, None, "; ".join(reasons) + (": shown side by side, not divided" if reasons else "")


def _headline(inp: Input, model: dict, runs: list[Input], baseline: str) -> dict:
    """Each arm against the baseline (`headline.model_rows`), the verdict lines that sum them up and the withheld
    count; the table leaves out the ratios of cells measured on one side only (counted)."""
    base_run, base, note = _baseline(inp, model, runs, baseline)
    if base is not None and base["status"] != MEASURED:  # why its cells are missing: an arm that stopped early
        note = "; ".join(
            filter(None, [note, f"{baseline} {base['status']}" + (f": {base['error']}" if base.get("error") else "")])
        )
    rows = headline.model_rows(inp.run, model, base_run, base)
    return {
        "where": _where(inp, model),
        "title": f"{model['model']} on {machine_name(inp.run)}",
        "source": f"{inp.path.name}, run {inp.run['run_id']}",
        "baseline": baseline,
        "note": note,
        "rows": [r for r in rows if r["withheld"] != headline.NOT_ON_BOTH],
        "lines": _lines(rows),
        "withheld": headline.withheld_count(rows),
    }


def _lines(rows: list[dict]) -> list[dict]:
    return [asdict(line) for line in headline.verdict_lines(rows)]


def _where(inp: Input, model: dict) -> str:
    block = (
        f" / block {model['block']}"
        if inp.run["kind"] == "trials"
        else f" / repetition {model['block'] + 1}"
        if is_repetition(inp.run, model)
        else ""
    )
    return f"{inp.run['run_id']} / {model['model']}{block}"


def _curves(inp: Input, model: dict) -> dict:
    """The model's plots (`report_plots`): throughput and latency percentiles against concurrency and against the
    offered rate, each point with its values in every repetition of the cell (`repetitions`; a band where there is
    more than one), and the distributions of TTFT and TPOT over the concurrency cells' requests (the decode
    phase's where none)."""
    blocks = [model, *repetitions(inp.run, model)]
    pcts = [p for p, _ in report_plots.PERCENTILE_STYLES]
    aggregate, per_request, offered, cdf = {}, {}, {}, {}
    ttft, tpot, rate_ttft = ({p: {} for p in pcts} for _ in range(3))
    key = lambda pct, what: f"{pct}_{what}_ms" if pct != "p50" else f"median_{what}_ms"  # noqa: E731
    for arm in model["arms"]:
        name = arm["arm"]
        again = [a for m in blocks for a in m["arms"] if a["arm"] == name]  # the arm in block 0 and each repetition
        for phase in [c["phase"] for c in arm["cells"] if is_load_phase(c["phase"])]:
            cells = [c for c in (cell_of(a, phase) for a in again) if c is not None]
            if not cells:
                continue
            values = lambda k: [c["metrics"].get(k) for c in cells]  # noqa: E731
            if phase.startswith("concurrency-"):
                level = int(phase.split("-", 1)[1])
                aggregate.setdefault(name, []).append((level, values("output_throughput")))
                per_request.setdefault(name, []).append((level, values("median_decode_tps")))
                for pct in pcts:
                    ttft[pct].setdefault(name, []).append((level, values(key(pct, "ttft"))))
                    tpot[pct].setdefault(name, []).append((level, values(key(pct, "tpot"))))
            else:
                rate = cells[0]["metrics"]["offered_rate"]
                offered.setdefault(name, []).append((rate, values("output_throughput")))
                for pct in pcts:
                    rate_ttft[pct].setdefault(name, []).append((rate, values(key(pct, "ttft"))))
        conc = [
            c for c in arm["cells"] if c["phase"].startswith("concurrency-") and c["status"] in (MEASURED, RECOVERED)
        ]
        decode = cell_of(arm, "decode")
        pool = [r for c in conc or ([decode] if decode else []) for r in ok_requests(c)]
        cdf[name] = {"TTFT ms": [r["ttft_ms"] for r in pool], "TPOT ms": [r.get("tpot_ms") for r in pool]}
    return {
        "where": _where(inp, model),
        "repetitions": len(blocks),
        "throughput": report_plots.throughput(aggregate, per_request),
        "latency": report_plots.latency(ttft, tpot),
        "cdf": report_plots.cdf(cdf),
        "rates": report_plots.rates(offered, rate_ttft),
    }


def _requests(inp: Input, model: dict, arm: dict) -> list[dict]:
    rows = []
    for cell in arm["cells"]:
        for att in cell["attempts"]:
            for r in att["requests"]:
                rows.append(
                    {
                        "run": inp.run["run_id"],
                        "block": model["block"],
                        "model": model["model"],
                        "arm": arm["arm"],
                        "phase": cell["phase"],
                        "attempt": att["attempt"],
                        "idx": r["index"],
                        "ok": r["ok"],
                        "ttft_ms": r["ttft_ms"],
                        "tpot_ms": r["tpot_ms"],
                        "e2el_ms": r["e2el_ms"],
                        "output_tokens": r["output_tokens"],
                        "finish_reason": r["finish_reason"],
                        "cached_tokens": r["cached_tokens"],
                        "output_sha256": (r["output_sha256"] or "")[:12],
                        "error": r["error"],
                    }
                )
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
                for rm in headline.RATIO_METRICS:
                    phases = sorted(
                        {c["phase"] for b in blocks for a in b["arms"] for c in a["cells"] if rm.matches(c["phase"])}
                    )
                    for phase in phases:
                        if all(metric(a, phase, rm.key) is None for b in blocks for a in b["arms"]):
                            continue  # a metric these records do not hold (an older run's)
                        ratios, seeds, values, skipped = [], [], [], []
                        for b in blocks:
                            arm = next((a for a in b["arms"] if a["arm"] == arm_name), None)
                            base = next((a for a in b["arms"] if a["arm"] == baseline), None)
                            x, y = (
                                (metric(arm, phase, rm.key), metric(base, phase, rm.key))
                                if arm and base
                                else (None, None)
                            )
                            why = (
                                "not measured on both"
                                if arm is None or base is None
                                else comparable.withheld(inp.run, arm, inp.run, base, phase)
                                or (None if x and y else "no value on one side")
                            )
                            if why:
                                skipped.append(why)
                                continue
                            ratios.append(x / y)
                            seeds.append(b["workload_seed"])
                            values.append((x, y))
                        record = {
                            "run": inp.run["run_id"],
                            "model": name,
                            "arm": arm_name,
                            "baseline": baseline,
                            "skipped_blocks": len(skipped),
                            "phase": phase,
                            "label": rm.label + headline.level(phase),
                            "short": rm.short + headline.level(phase).replace(" @", "@"),
                            "unit": rm.unit,
                            "higher_is_better": rm.higher_is_better,
                            "withheld": None,
                        }
                        if not ratios:  # every block withheld: the first reason, for the headline
                            out.append(record | {"withheld": f"{skipped[0]} (all {len(skipped)} blocks)"})
                            continue
                        res = stats.paired(f"{rm.label} ({phase})", ratios, seeds, higher_is_better=rm.higher_is_better)
                        out.append(
                            record
                            | {
                                "arm_mean": _geomean(v[0] for v in values),
                                "baseline_mean": _geomean(v[1] for v in values),
                                **res.as_record(),
                            }
                        )
    return out


def _geomean(values) -> float | None:
    logs = [math.log(v) for v in values if v and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _trials_headline(inp: Input, paired: list[dict]) -> list[dict]:
    """A trials file's headline: per model, each arm's paired-block results (geometric means over blocks)."""
    groups: dict[str, list[dict]] = {}
    for p in paired:
        if p["run"] != inp.run["run_id"]:
            continue
        row = {
            "arm": p["arm"],
            "baseline_arm": p["baseline"],
            "phase": p["phase"],
            "metric": p["label"],
            "short": p["short"],
            "unit": p["unit"],
            "higher_is_better": p["higher_is_better"],
            "outputs": "",
            "withheld": p["withheld"],
            "value": None,
            "baseline": None,
            "ratio": None,
            "ci_low": None,
            "ci_high": None,
            "verdict": None,
            "samples": 0,
            "note": "",
        }
        if not p["withheld"]:
            row |= {
                "value": p["arm_mean"],
                "baseline": p["baseline_mean"],
                "ratio": p["geomean"],
                "ci_low": p["ci_low"],
                "ci_high": p["ci_high"],
                "verdict": p["verdict"],
                "samples": p["blocks"],
                "note": f"{p['blocks']} blocks" + (f"; {p['note']}" if p["note"] else ""),
            }
        groups.setdefault(p["model"], []).append(row)
    blocks = {m["model"]: sum(x["model"] == m["model"] for x in inp.run["models"]) for m in inp.run["models"]}
    return [
        {
            "where": f"{inp.run['run_id']} / {model} (trials: geometric means over paired blocks)",
            "title": f"{model} on {machine_name(inp.run)}, {blocks[model]} paired blocks",
            "source": f"{inp.path.name}, trials {inp.run['run_id']}",
            "baseline": paired[0]["baseline"],
            "note": "",
            "rows": rows,
            "lines": _lines(rows),
            "withheld": headline.withheld_count(rows),
        }
        for model, rows in groups.items()
    ]


def _native_verdicts(native: list[dict]) -> list[dict]:
    """A `harness native` file's verdicts in the first screen's words: decode and prefill, engine / mlx-lm."""
    groups = []
    for n in native:
        rows = [
            {
                "arm": "engine",
                "phase": what,
                "short": what,
                "higher_is_better": True,
                "ratio": p["geomean"],
                "ci_low": p["ci_low"],
                "ci_high": p["ci_high"],
                "verdict": p["verdict"],
                "note": p["note"],
                "withheld": None,
            }
            for what in ("decode", "prefill")
            if (p := n[what])
        ]
        device = str(n["device"] or "?").removeprefix("Device(").split(",")[0].upper()  # 'Device(gpu, 0)': GPU
        groups.append(
            {
                "title": f"{n['model']} in process ({device})",
                "source": f"{n['file']}, engine against mlx-lm, {n['tier'] or '?'} tier",
                "note": "",
                "lines": _lines(rows),
                "withheld": "",
            }
        )
    return groups


def _choose_baseline(inputs: list[Input], baseline: str | None) -> str:
    arms = [a["arm"] for inp in inputs for m in inp.run["models"] for a in m["arms"]]
    if baseline is not None:
        if baseline not in arms:
            raise ValueError(f"baseline arm {baseline!r} is in none of the inputs (arms: {sorted(set(arms))})")
        return baseline
    return "mlx-lm" if "mlx-lm" in arms else (arms[0] if arms else "")


# -------------------------------------------------------------- the view


def build_view(inputs: list[Input], baseline: str | None = None) -> dict[str, Any]:
    runs = [i for i in inputs if i.kind == report_inputs.RUN]
    baseline = _choose_baseline(runs, baseline)
    machines: dict[str, list[dict]] = {}
    headline, curves, identity, failures, requests, quality = [], [], [], [], [], []
    for inp in runs:
        for model in inp.run["models"]:
            where = _where(inp, model)
            verdicts = (model.get("parity") or {}).get("verdicts", {})
            for arm in model["arms"]:
                cells = [
                    _cell_view(c, inp.run["settings"].get("workload") or {}, bool(inp.run["provenance"].get("gpu")))
                    for c in arm["cells"]
                ]
                for c in cells:
                    v = verdicts.get(arm["arm"])
                    if c["phase"] == "probe" and v is not None:
                        c["flags"].insert(0, "parity probe: " + ("same output" if v["match"] else "OUTPUT DIFFERS"))
                memory = arm.get("device_memory") or {}
                machines.setdefault(machine(inp.run), []).append(
                    {
                        "where": where,
                        "arm": arm["arm"],
                        "arm_status": arm["status"],
                        "arm_error": arm.get("error"),
                        "load_to_ready_s": arm.get("load_to_ready_s"),
                        "peak_rss_mib": (arm.get("peak_rss_bytes") or 0) / 2**20,
                        "device_peak_mib": memory["peak_bytes"] / 2**20 if memory.get("peak_bytes") else None,
                        "device_active_mib": memory["active_bytes"] / 2**20 if memory.get("active_bytes") else None,
                        "cells": cells,
                        "diagnostic": inp.run["diagnostic"],
                        "is_repetition": is_repetition(inp.run, model),
                    }
                )
                if arm.get("quality"):
                    q = arm["quality"]
                    quality.append(
                        {
                            "where": where,
                            "arm": arm["arm"],
                            "tier": q.get("tier"),
                            "tokens": q.get("tokens"),
                            "note": perplexity_note(q, model["model"]) if q.get("perplexity") else "",
                            "perplexity": q.get("perplexity"),
                            "error": q.get("error"),
                            "peak_rss_mib": (arm.get("peak_rss_bytes") or 0) / 2**20 or None,
                        }
                    )
                if arm["status"] == FAILED or arm.get("error"):
                    what = "server" if arm["status"] == FAILED else arm["status"]  # interrupted, say
                    failures.append(
                        {
                            "where": where,
                            "arm": arm["arm"],
                            "what": what,
                            "error": arm.get("error"),
                            "stderr_tail": arm.get("stderr_tail", "")[-2000:],
                        }
                    )
                for c in arm["cells"]:
                    if c["status"] in (FAILED, RECOVERED):
                        errors = [a["error"] for a in c["attempts"] if a["error"]]
                        failures.append(
                            {
                                "where": where,
                                "arm": arm["arm"],
                                "what": f"{c['phase']} ({c['status']})",
                                "error": c.get("reason") or "; ".join(errors),
                                "stderr_tail": "",
                            }
                        )
                requests += _requests(inp, model, arm)
            if inp.run["kind"] != "trials" and not is_repetition(inp.run, model):
                headline.append(_headline(inp, model, runs, baseline))
            if model["block"] == min(m["block"] for m in inp.run["models"] if m["model"] == model["model"]):
                curves.append(_curves(inp, model))  # trials: the first block's; a run: block 0 with its repetitions
            if not is_repetition(inp.run, model):
                identity.append(
                    {
                        "where": where,
                        "reference": (model.get("parity") or {}).get("reference"),
                        "verdicts": (model.get("parity") or {}).get("verdicts", {}),
                        "arms": [a["arm"] for a in model["arms"]],
                    }
                )
    matrix = {}
    for mach, rows in machines.items():
        phases = list(dict.fromkeys(c["phase"] for r in rows for c in r["cells"]))
        for r in rows:
            by_phase = {c["phase"]: c for c in r["cells"]}
            why = "a repetition: the load cells only" if r["is_repetition"] else "not in this run"
            r["cells"] = [
                by_phase.get(p) or {"phase": p, "status": NOT_MEASURED, "value": None, "flags": [], "reason": why}
                for p in phases
            ]
        matrix[mach] = {"phases": phases, "rows": rows}
    paired = _paired(runs, baseline)
    for inp in runs:
        if inp.run["kind"] == "trials":
            headline += _trials_headline(inp, paired)
    others = [i for i in inputs if i.kind != report_inputs.RUN]
    native = [
        row for i in others if i.kind == report_inputs.NATIVE for row in report_inputs.native_view(i.path.name, i.run)
    ]
    return {
        "title": "harness report: " + ", ".join(i.path.name for i in inputs),
        "files": [i.path.name for i in inputs],
        "verdicts": headline + _native_verdicts(native),
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
        "native": native,
        "spec": [report_inputs.spec_view(i.path.name, i.run) for i in others if i.kind == report_inputs.SPEC],
        "quality_files": [
            t for i in others if i.kind == report_inputs.QUALITY for t in report_inputs.quality_view(i.path.name, i.run)
        ],
        "failures": failures,
        "flagged": [f"{i.run['run_id']} / {line}" for i in runs for line in anomalies.flagged_lines(i.run)],
        "requests": requests,
        "statuses": [MEASURED, RECOVERED, FAILED, NOT_MEASURED, "unsupported"],
        "single_run_threshold": stats.SINGLE_RUN_THRESHOLD,
        "trials_threshold": stats.NOISE_THRESHOLD,
        "cv_flag": CV_FLAG,
    }


# ------------------------------------------------------------- renderers


def render_html(view: dict) -> str:
    loader = FunctionLoader(lambda name: (TEMPLATES / name).read_text(encoding="utf-8"))
    env = Environment(
        loader=loader,
        autoescape=select_autoescape(["html", "j2"], default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals |= {"value_text": headline.value_text, "interval_text": headline.interval_text}
    return env.get_template("report.html.j2").render(**view)


def render_json(view: dict) -> str:
    return json.dumps(view, indent=1, default=str)
