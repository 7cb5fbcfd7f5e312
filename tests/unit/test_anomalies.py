"""Cells whose requests show what their workload does not explain: cached tokens no earlier request of the run
left (the ratios withheld), a stall between two tokens (flagged); in the summary, the report and its ratios."""

import json
from pathlib import Path
from types import SimpleNamespace

from harness.report import page as report
from harness.run import anomalies, summary
from harness.run.cli import _print_summary

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"


def timed_run() -> dict:
    """The tiny run, not diagnostic, every request 64 tokens at 5 ms a token (long enough to time)."""
    run = json.loads(FIXTURE.read_text())
    run["diagnostic"] = False
    for arm in run["models"][0]["arms"]:
        for cell in arm["cells"]:
            for attempt in cell["attempts"]:
                attempt["wall_s"] = max(attempt["wall_s"], 1.0)
                for r in attempt["requests"]:
                    r["output_tokens"], r["tpot_ms"], r["itl_ms"] = 64, 5.0, [5.0] * 63
                    r["e2el_ms"] = r["ttft_ms"] + 63 * 5.0
    return run


def cells_of(run: dict, arm: int = 0) -> dict:
    return {c["phase"]: c for c in run["models"][0]["arms"][arm]["cells"]}


def rendered(tmp_path, run: dict) -> tuple[dict, str, str]:
    """(the report's view, its Markdown, its HTML) of `run`."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    view = report.build_view(report.load([path]))
    return view, report.render_markdown(view), report.render_html(view)


def headline(view: dict, phase: str) -> dict:
    return next(r for r in view["headline"][0]["rows"] if r["phase"] == phase)


def test_a_stall_far_past_the_median_gap_is_flagged_in_the_summary_and_the_report(tmp_path, capsys):
    run = timed_run()
    decode = cells_of(run)["decode"]
    decode["attempts"][0]["requests"][0]["itl_ms"][30] = 30_100.0  # the server stopped for 30 s
    flag = "stall: a 30.1 s gap between two tokens, 6,020x the median gap (5.0 ms)"
    assert anomalies.stall(decode) == flag
    record = SimpleNamespace(to_json=lambda: run, kind="run", run_id=run["run_id"], diagnostic=False)
    _print_summary(record, tmp_path / "run.json", tmp_path / "runs.sqlite")
    assert f"FLAGGED tiny-qwen3 / engine / decode: {flag}" in " ".join(capsys.readouterr().out.split())  # wrapped
    assert f"tiny-qwen3 / engine / decode: {flag}" in (tmp_path / "run.md").read_text()
    view, md, html = rendered(tmp_path, run)
    assert flag in md.split("## Flagged cells")[1] and html.count(flag) == 2  # the list and the matrix cell
    assert headline(view, "decode")["withheld"] is None  # a flag, not a withheld ratio


def test_a_gap_under_a_second_or_under_twenty_medians_is_no_stall():
    run = timed_run()
    decode = cells_of(run)["decode"]
    gaps = decode["attempts"][0]["requests"][0]["itl_ms"]
    gaps[30] = 900.0  # 180x the median, under 1 s
    assert anomalies.stall(decode) is None
    for r in decode["attempts"][0]["requests"]:
        r["itl_ms"] = [100.0] * 63
    decode["attempts"][0]["requests"][0]["itl_ms"][30] = 1_900.0  # over 1 s, 19x the median
    assert anomalies.stall(decode) is None
    assert anomalies.flagged_lines(run) == []


def test_cached_tokens_the_workload_does_not_explain_withhold_the_ratios(tmp_path):
    run = timed_run()
    for arm in (0, 1):  # both arms' servers kept an earlier run's cold prompt: the same work, both cached
        cells_of(run, arm)["cold"]["attempts"][0]["requests"][0]["cached_tokens"] = 63
    view, md, html = rendered(tmp_path, run)
    why = (
        "cached tokens the workload does not explain: 1 of 1 requests (request 0: 63 of 64 prompt tokens cached, "
        "at most 0 expected"
    )
    assert headline(view, "cold")["withheld"].startswith(f"engine: {why}")
    assert f"withheld: engine: {why}" in md and why in md.split("## Flagged cells")[1]
    assert f"tiny-qwen3 / mlx-lm / cold: {why}" in summary.markdown(run)
    assert headline(view, "decode")["withheld"] is None


def test_what_the_workload_caches_itself_is_not_flagged():
    run = timed_run()
    cells = cells_of(run)
    cells["warm"]["attempts"][0]["requests"][0]["cached_tokens"] = 63  # the cold prompt again
    cells["decode"]["attempts"][0]["requests"][1]["cached_tokens"] = 23  # the decode prompt again
    cells["cold"]["attempts"][0]["requests"][0]["cached_tokens"] = 2  # a nonce's first hex token
    assert anomalies.flagged_lines(run) == []
    cells["decode"]["attempts"][0]["requests"][0]["cached_tokens"] = 23  # the first decode request: nothing before it
    assert anomalies.flagged_lines(run) == [
        "tiny-qwen3 / engine / decode: cached tokens the workload does not explain: 1 of 2 requests (request 0: 23 "
        "of 24 prompt tokens cached, at most 0 expected; a cache an earlier run filled?)"
    ]


def test_shared_prefix_and_multiturn_cells_expect_their_own_prefixes():
    load = {"prefix_group_size": 3, "prefix_tokens": 40, "turns": 2}

    def cell(phase: str, cached: list[int], prompts: list[int]) -> dict:
        reqs = [{"prompt_tokens_sent": p, "prompt_tokens": p, "cached_tokens": c} for c, p in zip(cached, prompts)]
        return {"phase": phase, "status": "measured", "attempts": [{"ok": True, "requests": reqs}]}

    assert anomalies.unexplained_cache(cell("prefix", [0, 41, 40, 0, 40, 40], [60] * 6), load) is None
    assert "request 3: 40 of 60" in anomalies.unexplained_cache(cell("prefix", [0, 40, 40, 40], [60] * 4), load)
    assert anomalies.unexplained_cache(cell("multiturn", [0, 90, 0, 95], [100, 200, 100, 210]), load) is None
    assert "request 1: 150 of 200" in anomalies.unexplained_cache(cell("multiturn", [0, 150], [100, 200]), load)
