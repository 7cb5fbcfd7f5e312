"""What a run record measured, read the same way by the summary, the comparisons and the exports: a phase's
cell of an arm, its metrics and its answered requests, whether a decode cell is long enough to time, and
whether two arms did the same work."""

from __future__ import annotations

import statistics

from harness.run import stats
from harness.run.records import MEASURED, RECOVERED

# A decode rate is timed over the tokens after the first, E2EL - TTFT. With few of them, or a few
# milliseconds, it measures how the server flushes its stream (mlx_lm.server can send a short output
# in one burst: 7 tokens "at" 18,814 tok/s) and the clock, not decoding.
MIN_TIMED_TOKENS = 16
MIN_DECODE_MS = 50.0


def cell_of(arm: dict, phase: str) -> dict | None:
    for c in arm["cells"]:
        if c["phase"] == phase and c["status"] in (MEASURED, RECOVERED):
            return c
    return None


def metric(arm: dict, phase: str, key: str) -> float | None:
    c = cell_of(arm, phase)
    return None if c is None else c["metrics"].get(key)


def ok_requests(cell: dict) -> list[dict]:
    return [r for att in cell["attempts"] if att["ok"] for r in att["requests"]]


def too_short(cell: dict) -> str | None:
    """Why a decode cell is too short to time, or None. The rule, on the cell's median request: fewer than
    MIN_TIMED_TOKENS tokens after the first, or under MIN_DECODE_MS between the first and the last."""
    spans = [
        (r["output_tokens"] - 1, r["e2el_ms"] - r["ttft_ms"])
        for r in ok_requests(cell)
        if r.get("output_tokens") and r.get("e2el_ms") is not None and r.get("ttft_ms") is not None
    ]
    if not spans:
        return "too short: no timed tokens"
    tokens, ms = statistics.median(t for t, _ in spans), statistics.median(m for _, m in spans)
    if tokens < MIN_TIMED_TOKENS:
        return f"too short: {tokens:g} timed tokens (< {MIN_TIMED_TOKENS})"
    if ms < MIN_DECODE_MS:
        return f"too short: {ms:.1f} ms of decode (< {MIN_DECODE_MS:g} ms)"
    return None


def decode_rate(arm: dict) -> tuple[float | None, str | None]:
    """The arm's median decode rate, or None and why it is withheld (too short to time)."""
    cell = cell_of(arm, "decode")
    if cell is None:
        return None, None
    short = too_short(cell)
    return (None, short) if short else (cell["metrics"].get("median_decode_tps"), None)


def run_nonce(arm: dict) -> str:
    """The run nonce that opened the arm's prompts (`workloads.with_run_nonce`: a server the harness did not
    start); "" for the frozen workload."""
    return (arm.get("endpoint") or {}).get("run_nonce") or ""


def same_work(a: dict, b: dict, phase: str) -> str | None:
    """None when both arms did the same work in `phase`: the same attempt (a retry sends other prompts), the
    same requests (prompt hashes where both records have them and one run nonce opened both arms' prompts, else
    prompt lengths), output counts, finish reasons and cached prompt tokens to within CACHED_SLACK of the
    prompts' (a server that reports none counts as 0); else why not."""
    ca, cb = cell_of(a, phase), cell_of(b, phase)
    if ca is None or cb is None:
        return "not measured on both"
    attempts = [[t["attempt"] for t in c["attempts"] if t["ok"]] for c in (ca, cb)]
    if attempts[0] != attempts[1]:
        return f"different attempts (measured on attempt {attempts[0][-1]} against {attempts[1][-1]})"
    ra, rb = ok_requests(ca), ok_requests(cb)
    hashes = [[r.get("prompt_sha256") for r in rs] for rs in (ra, rb)]
    if run_nonce(a) == run_nonce(b) and None not in hashes[0] + hashes[1] and hashes[0] != hashes[1]:
        return "different requests (prompt hashes)"
    if [r["prompt_tokens_sent"] for r in ra] != [r["prompt_tokens_sent"] for r in rb]:
        return "different prompts"
    if [r["output_tokens"] for r in ra] != [r["output_tokens"] for r in rb]:
        return "different output counts"
    if [r["finish_reason"] for r in ra] != [r["finish_reason"] for r in rb]:
        return "different finish reasons"
    cached = [sum(r.get("cached_tokens") or 0 for r in rs) for rs in (ra, rb)]
    if abs(cached[0] - cached[1]) > CACHED_SLACK * sum(r["prompt_tokens_sent"] for r in ra):
        return f"different cached tokens ({cached[0]} against {cached[1]})"
    return None


# Cached prompt tokens may differ by this share of the prompt tokens and still count as the same work: a few
# tokens a prompt shared with an earlier one change the prefill by as little.
CACHED_SLACK = 0.01


def geomean(values: list[float | None]) -> float | None:
    """The geometric mean of the positive values; None without one."""
    kept = [v for v in values if v is not None and v > 0]
    if len(kept) < 2:
        return kept[0] if kept else None
    return stats.geomean(kept)
