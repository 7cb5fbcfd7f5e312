"""`harness report`'s inputs besides run records: what each JSON file is, and its section of the report.

    run / trials   `harness run all`, `harness trials` (schema_version): the serving report
    native         `harness native --json`: in-process prefill and decode, engine against mlx-lm
    spec           `harness spec --json`: speculative against plain decoding on one target
    quality        `harness quality --json`: held-out perplexity and KL per variant

Each in-process file compares its own arms, measured in one process; the report shows them as they are,
with the verdicts their paired samples give (`stats.paired`), and never divides one file's numbers by
another's.
"""

from __future__ import annotations

from typing import Any

from harness.run import stats
from harness.run.records import SCHEMA_VERSION

RUN, NATIVE, SPEC, QUALITY = "run", "native", "spec", "quality"


def kind_of(data: Any) -> str | None:
    """Which harness command wrote `data` (None: none of them)."""
    if isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION and "models" in data:
        return RUN
    if isinstance(data, dict) and {"model", "arms", "config"} <= set(data) and isinstance(data["arms"], list):
        return SPEC
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        if all({"engine", "mlx_lm", "decode_ratio"} <= set(x) for x in data):
            return NATIVE
        if all({"model", "rows", "settings"} <= set(x) for x in data):
            return QUALITY
    return None


def _paired(metric: str, ratios: list, higher_is_better: bool = True) -> dict | None:
    """The verdict of alternating samples' ratios (one a sample, each its own block)."""
    ratios = [r for r in ratios or [] if r and r > 0]
    if not ratios:
        return None
    return stats.paired(metric, ratios, list(range(len(ratios))), higher_is_better=higher_is_better).as_record()


def native_view(file: str, data: list[dict]) -> list[dict]:
    """One row per model of a `harness native` file."""
    rows = []
    for x in data:
        e, m = x["engine"], x["mlx_lm"]
        rows.append(
            {
                "file": file,
                "model": x["model"],
                "device": x.get("device"),
                "machine": x.get("machine"),
                "prompt_tokens": x.get("prompt_tokens"),
                "decode_tokens": x.get("decode_tokens"),
                "tier": (x.get("kernels") or {}).get("tier"),
                "tokens_identical": x.get("tokens_identical"),
                "engine": e,
                "mlx_lm": m,
                "decode": _paired("decode tok/s", x.get("paired_decode_ratios")),
                "prefill": _paired("prefill tok/s", x.get("paired_prefill_ratios")),
            }
        )
    return rows


def spec_view(file: str, data: dict) -> dict:
    """A `harness spec` file: its arms against plain decoding."""
    return {
        "file": file,
        "model": data["model"],
        "device": data.get("device"),
        "config": data.get("config") or {},
        "arms": [
            {
                "arm": a["arm"],
                "draft": a.get("draft"),
                "decode_tps": a.get("median_decode_tps"),
                "ttft_ms": a.get("median_ttft_ms"),
                "ratio": a.get("decode_ratio_vs_plain"),
                "paired": a.get("paired"),
                "acceptance": (a.get("spec") or {}).get("acceptance"),
                "tokens_per_forward": (a.get("spec") or {}).get("tokens_per_target_forward"),
                "same_tokens": all(a.get("same_tokens") or [True]),
            }
            for a in data["arms"]
        ],
    }


def quality_view(file: str, data: list[dict]) -> list[dict]:
    """One table per model of a `harness quality` file: each variant's perplexity, KL and top-1."""
    return [{"file": file, "model": x["model"], "tokens": x.get("tokens"), "rows": x["rows"]} for x in data]
