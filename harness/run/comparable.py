"""When two arms' numbers for one phase may be set against each other, and why not.

A ratio of two measurements means something only when both measured the same
thing the same way:

- a quiet machine: not a diagnostic run, no problem found by the preflight check
  run again after the cell (`Runner(recheck=...)`), the source tree the same at
  the end of the run as at its start;
- long enough to time a rate: a decode cell with enough timed tokens
  (`measured.too_short`), a decode or concurrency cell at least MIN_CELL_MS long
  (a TTFT is a latency, timed however short);
- the same work (`measured.same_work`): attempt, requests, output counts, finish
  reasons, cached tokens;
- no more cached tokens than the workload explains (`anomalies.unexplained_cache`):
  a server that kept an earlier run's prompts times its cache.

`withheld` gives the first reason that applies, or None.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.run import stats
from harness.run.anomalies import unexplained_cache
from harness.run.measured import cell_of, geomean, ok_requests, run_nonce, same_work, too_short
from harness.run.measured import metric as metric_of
from harness.run.repetitions import is_load_phase

MIN_CELL_MS = 50.0  # a cell shorter than this times the client and the clock, not the server


def run_reason(run: dict) -> str | None:
    """Why no ratio of this run means anything, or None."""
    if run.get("diagnostic"):
        return "diagnostic run (measured on a busy machine)"
    p = run.get("provenance") or {}
    end = p.get("source_tree_sha256_end")
    if end and end != p.get("source_tree_sha256"):
        return "the source tree changed during the run"
    return None


def cell_reason(cell: dict, load: dict | None = None) -> str | None:
    """Why this measured cell's numbers should not be compared, or None; `load`: the run's workload settings."""
    cached = unexplained_cache(cell, load or {})
    if cached:
        return cached
    problems = ((cell.get("metrics") or {}).get("preflight") or {}).get("problems")
    if problems:
        return f"the machine was busy after the cell ({problems[0]})"
    if cell["phase"] == "decode":
        short = too_short(cell)
        if short:
            return short
    walls = [t["wall_s"] for t in cell["attempts"] if t["ok"] and t.get("wall_s") is not None]
    rate = cell["phase"] == "decode" or cell["phase"].startswith("concurrency-")
    if rate and walls and walls[-1] * 1e3 < MIN_CELL_MS:
        return f"too short: the cell took {walls[-1] * 1e3:.0f} ms (< {MIN_CELL_MS:g} ms)"
    return None


def withheld(run_a: dict, arm_a: dict, run_b: dict, arm_b: dict, phase: str) -> str | None:
    """Why arm_a's and arm_b's `phase` should not be compared (the first reason), or None when they may be."""
    for run in (run_a, run_b):
        why = run_reason(run)
        if why:
            return why
    for run, arm in ((run_a, arm_a), (run_b, arm_b)):
        cell = cell_of(arm, phase)
        if cell is None:
            return "not measured on both"
        why = cell_reason(cell, (run.get("settings") or {}).get("workload"))
        if why:
            return f"{arm['arm']}: {why}"
    return same_work(arm_a, arm_b, phase)


# The per-request samples behind each compared median (requests paired by index; `stats.sample_ratio`): a decode
# rate, a prefill rate and a TTFT are medians of their requests. A load cell's aggregate is not (`compare`).
def request_samples(cell: dict, phase: str, key: str = "median_ttft_ms") -> list[float]:
    """A cell's successful requests' values of the median `key` (a rate cell's measured window only)."""
    reqs = ok_requests(cell)
    window = (cell.get("metrics") or {}).get("measured_requests")  # a rate cell: its warm-up and cool-down left out
    if window:
        reqs = reqs[window[0] : window[1]]
    if key == "median_decode_tps":
        return [1e3 / r["tpot_ms"] for r in reqs if r.get("tpot_ms")]
    if key == "median_prefill_tps":  # prompt tokens not from a cache per second of TTFT (run_all.prefill_rate)
        return [
            ((r.get("prompt_tokens") or r.get("prompt_tokens_sent") or 0) - (r.get("cached_tokens") or 0))
            / (r["ttft_ms"] / 1e3)
            for r in reqs
            if r.get("ttft_ms")
        ]
    if key != "median_ttft_ms":
        raise ValueError(f"no per-request samples for {key}")
    return [r["ttft_ms"] for r in reqs if r.get("ttft_ms") is not None]


def compare(
    run_a: dict,
    arm_a: dict,
    run_b: dict,
    arm_b: dict,
    phase: str,
    metric: str,
    key: str,
    higher_is_better: bool,
    repeats: Sequence[tuple[dict, dict]] = (),
) -> dict:
    """arm_a against arm_b on one phase: both values (the cells' `key`), the ratio with its interval and verdict,
    or the reason it is withheld. A median's ratio resamples the paired requests (`stats.sample_ratio`); a load
    cell's aggregate (`repetitions`) comes from the cell's repetitions, `repeats` being the (arm_a, arm_b) records of
    the run's repetition blocks (`stats.repeated`), and from one burst is unknown."""

    a, b = metric_of(arm_a, phase, key), metric_of(arm_b, phase, key)
    row = {
        "arm": arm_a["arm"],
        "baseline_arm": arm_b["arm"],
        "phase": phase,
        "metric": metric,
        "value": a,
        "baseline": b,
        "higher_is_better": higher_is_better,
        "ratio": None,
        "ci_low": None,
        "ci_high": None,
        "verdict": None,
        "note": "",
        "samples": 0,
        "withheld": None,
        "outputs": "",
    }
    why = withheld(run_a, arm_a, run_b, arm_b, phase)
    if why is None and not (a and b):
        why = "no value on one side"
    if why:
        return row | {"withheld": why}
    # token ids' hashes, where both servers returned them (mlx_lm.server returns text only) for the same prompts
    outputs = [
        [r.get("output_sha256") if r.get("token_ids") is not None else None for r in ok_requests(cell_of(arm, phase))]
        for arm in (arm_a, arm_b)
    ]
    if run_nonce(arm_a) == run_nonce(arm_b) and None not in outputs[0] + outputs[1] and outputs[0] != outputs[1]:
        row["outputs"] = f"outputs differ in {sum(x != y for x, y in zip(*outputs))} of {len(outputs[0])} requests"
    if is_load_phase(phase):
        return row | _repeated(run_a, run_b, [(arm_a, arm_b), *repeats], phase, metric, key, higher_is_better)
    sa = request_samples(cell_of(arm_a, phase), phase, key)
    sb = request_samples(cell_of(arm_b, phase), phase, key)
    if len(sa) != len(sb) or not sa:
        return row | {"ratio": a / b, "verdict": stats.UNKNOWN, "note": "no paired request timings"}
    r = stats.sample_ratio(metric, sa, sb, higher_is_better=higher_is_better)
    if r.ratio is None:
        return row | {"withheld": r.note}
    return row | {
        "ratio": r.ratio,
        "ci_low": r.ci_low,
        "ci_high": r.ci_high,
        "verdict": r.verdict,
        "note": r.note,
        "samples": r.samples,
    }


def _repeated(
    run_a: dict, run_b: dict, pairs: list[tuple[dict, dict]], phase: str, metric: str, key: str, higher_is_better: bool
) -> dict:
    """The compared row's numbers from a load cell's repetitions: the geometric means of each side's values over
    the repetitions both may be compared in, their ratio's interval and verdict (`stats.repeated`)."""

    kept, left_out = [], []
    for arm, base in pairs:
        a, b = metric_of(arm, phase, key), metric_of(base, phase, key)
        why = withheld(run_a, arm, run_b, base, phase) or (None if a and b else "no value on one side")
        if why:
            left_out.append(why)
        else:
            kept.append((a, b))
    r = stats.repeated(metric, [a / b for a, b in kept], higher_is_better=higher_is_better)
    note = (
        r.note
        if len(pairs) == 1
        else "; ".join(
            filter(
                None,
                [
                    f"{r.repetitions} repetitions"
                    + (f" ({len(left_out)} left out: {left_out[0]})" if left_out else ""),
                    r.note,
                ],
            )
        )
    )
    return {
        "value": geomean([a for a, _ in kept]),
        "baseline": geomean([b for _, b in kept]),
        "ratio": r.geomean,
        "ci_low": r.ci_low,
        "ci_high": r.ci_high,
        "verdict": r.verdict,
        "note": note,
        "samples": r.repetitions,
    }
