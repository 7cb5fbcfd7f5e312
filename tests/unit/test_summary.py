"""The summary at the end of `harness run all`: narrow tables, withheld reasons as numbered notes, verdict lines."""

import json
from pathlib import Path
from types import SimpleNamespace

from harness.run import summary
from harness.run.cli import SUMMARY_COLUMNS, _print_summary

CPU_RUN = Path(__file__).resolve().parents[2] / "reports" / "cpu-small-qwen3.json"


def printed(run: dict, tmp_path, capsys) -> str:
    record = SimpleNamespace(to_json=lambda: run, kind=run["kind"], run_id=run["run_id"], diagnostic=run["diagnostic"])
    _print_summary(record, tmp_path / "run.json", tmp_path / "runs.sqlite")
    return capsys.readouterr().out


def cpu_run_with_a_short_decode() -> dict:
    """The committed CPU run, engine-serial's decode cell cut to 30 ms of decode: too short to time, its ratio
    withheld with a reason that once wrapped a narrow column over 16 lines."""
    run = json.loads(CPU_RUN.read_text())
    serial = next(a for a in run["models"][0]["arms"] if a["arm"] == "engine-serial")
    decode = next(c for c in serial["cells"] if c["phase"] == "decode")
    for r in decode["attempts"][0]["requests"]:
        r["e2el_ms"] = r["ttft_ms"] + 30.0
    return run


def test_a_cpu_run_with_a_withheld_ratio_fits_100_columns(tmp_path, capsys):
    out = printed(cpu_run_with_a_short_decode(), tmp_path, capsys)
    lines = [line for line in out.splitlines() if not line.startswith("JSON: ")]  # paths are as long as they are
    assert max(map(len, lines)) <= SUMMARY_COLUMNS == 100
    why = "engine-serial: too short: 30.0 ms of decode (< 50 ms)"
    assert f"[1] {why}" in out and out.count(why) == 1  # one note, referred to by the cell and the ratio
    assert "too short [1]" in out and "engine-serial: decode withheld [1]" in out
    text = " ".join(out.split())
    assert "engine: decode 1.05x [1.04, 1.10] unknown" in text and "agg@8 1.01x unknown (one burst)" in text


def test_the_markdown_summary_says_the_same(tmp_path):
    md = summary.markdown(cpu_run_with_a_short_decode())
    assert "- engine-serial: decode withheld [1]" in md and "- [1] engine-serial: too short: 30.0 ms" in md
    assert "agg@8 0.50x unknown (one burst)" in md  # one burst's aggregate: no interval, no verdict


def test_a_random_weight_models_perplexity_says_what_it_is_worth():
    (line, _) = summary.quality_lines(json.loads(CPU_RUN.read_text()))
    assert (
        "held-out perplexity 50524.1" in line and "worse than a uniform guess over the 32,768-token vocabulary" in line
    )
    assert summary.perplexity_note({"perplexity": 8.2, "vocab_size": 4096}, "trained-qwen3") == ""


def test_the_staggered_line_says_how_far_the_rare_token_gap_is_from_the_usual():
    assert summary._itl_spread({"median_itl_ms": 12.0, "p99_itl_ms": 30.0}) == " (2.5x p50)"
    assert summary._itl_spread({"median_itl_ms": None, "p99_itl_ms": 30.0}) == ""
