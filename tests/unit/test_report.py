"""`harness report` from fixture JSON: statuses, withheld ratios, hostile strings, no external references,
and the page in a real headless Chromium."""

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import report

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"
HOSTILE = '<script>alert("x")</script>'


def hostile_run() -> dict:
    """The real tiny run, edited into every case the report must handle."""
    run = json.loads(FIXTURE.read_text())
    run["run_id"], run["label"] = "hostile0001", HOSTILE
    model = run["models"][0]
    model["model"] = '<img src="http://evil.example/x.png" onerror="alert(1)">'
    engine, mlx = model["arms"]
    cells = {c["phase"]: c for c in engine["cells"]}
    failed = cells["cold"]
    failed["status"], failed["reason"] = "failed", f"1 of 1 requests failed: {HOSTILE} https://evil.example/"
    failed["attempts"] = [{**failed["attempts"][0], "ok": False, "error": HOSTILE}, {**failed["attempts"][0], "attempt": 1, "ok": False, "error": "again"}]
    retried = cells["warm"]
    first = copy.deepcopy(retried["attempts"][0])
    first["ok"], first["error"] = False, "HTTP 500: engine hiccup"
    retried["attempts"] = [first, {**retried["attempts"][0], "attempt": 1}]
    retried["status"], retried["reason"] = "recovered", "first attempt failed: HTTP 500: engine hiccup"
    for r in next(c for c in mlx["cells"] if c["phase"] == "decode")["attempts"][0]["requests"]:
        r["output_tokens"] -= 1  # the mismatched pair: mlx-lm stopped one token short
    engine["status"], engine["error"] = "failed", "the server exited (status 3) during phase cold"
    engine["stderr_tail"] = f"Traceback ...\n</pre>{HOSTILE}<pre>"
    run["commands"]["engine"] = ["engine", "serve", "--model-path", "<b>dir</b>"]
    return run


@pytest.fixture
def view(tmp_path):
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(hostile_run()))
    return report.build_view(report.load([path, FIXTURE]))


def test_every_cell_has_a_status_and_failures_are_listed(view):
    rows = [r for m in view["machines"].values() for r in m["rows"]]
    statuses = {(r["where"].split(" / ")[0], r["arm"], c["phase"]): c["status"] for r in rows for c in r["cells"]}
    hostile_id = "hostile0001"
    assert statuses[(hostile_id, "engine", "cold")] == "failed"
    assert statuses[(hostile_id, "engine", "warm")] == "recovered"
    assert all(s in view["statuses"] for s in statuses.values())
    probe = next(c for r in rows if r["arm"] == "mlx-lm" for c in r["cells"] if c["phase"] == "probe")
    assert probe["flags"][0] == "parity probe: same output"
    whats = {f["what"] for f in view["failures"]}
    assert {"server", "cold (failed)", "warm (recovered)"} <= whats


def test_the_ratio_is_withheld_for_the_mismatched_pair(view):
    hostile = view["ratios"][0]["rows"]
    decode = next(r for r in hostile if r["phase"] == "decode")
    assert decode["ratio"] is None and decode["withheld"] == "different output counts"
    clean = next(r for r in view["ratios"][1]["rows"] if r["phase"] == "decode")
    assert clean["ratio"] is not None and clean["withheld"] is None


def test_html_escapes_hostile_strings_and_references_nothing_outside(view):
    html = report.render_html(view)
    assert "<script" not in html.lower() and "onerror=" not in html.replace("onerror=&#34;", "")
    assert "&lt;script&gt;" in html
    assert not re.search(r"""(src|href|action|poster|data)\s*=\s*["']?\s*(https?:|//)""", html, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:|//)", html, re.I)
    assert not re.search(r"<(img|link|iframe|object|embed|script)\b", html, re.I)
    assert "Content-Security-Policy" in html


def test_markdown_and_json_formats(view):
    md = report.render_markdown(view)
    assert "## Serving matrix" in md and "withheld: different output counts" in md
    again = json.loads(report.render_json(view))
    assert again["baseline"] == "mlx-lm" and len(again["requests"]) == len(view["requests"])


def test_the_engine_arms_held_out_perplexity_is_listed_with_its_size(tmp_path):
    run = json.loads(FIXTURE.read_text())
    engine, mlx = run["models"][0]["arms"]
    engine["quality"] = {"tokens": 512, "tier": "exact", "nll": 2.0, "perplexity": 7.389}
    mlx["quality"] = None
    path = tmp_path / "q.json"
    path.write_text(json.dumps(run))
    view = report.build_view(report.load([path]))
    (row,) = view["quality"]
    assert (row["arm"], row["tier"], row["tokens"], row["perplexity"]) == (engine["arm"], "exact", 512, 7.389)
    assert "7.389" in report.render_html(view) and "| exact | 512 | 7.389 |" in report.render_markdown(view)
    assert "No arm measured its held-out perplexity" in report.render_html(report.build_view(report.load([FIXTURE])))


def test_a_baseline_that_is_not_there_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="baseline arm"):
        report.build_view(report.load([FIXTURE]), baseline="nope")


def test_inputs_that_are_not_run_records_are_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a harness run record"):
        report.load([bad])
    with pytest.raises(ValueError, match="cannot read"):
        report.load([tmp_path / "missing.json"])


def test_trials_get_paired_verdicts(tmp_path):
    base = json.loads(FIXTURE.read_text())
    base["kind"] = "trials"
    blocks = []
    for i in range(5):  # five seeds; engine decode 10% faster in every block
        m = copy.deepcopy(base["models"][0])
        m["block"], m["workload_seed"] = i, i
        for arm in m["arms"]:
            d = next(c for c in arm["cells"] if c["phase"] == "decode")
            d["metrics"]["median_decode_tps"] = (110.0 if arm["arm"] == "engine" else 100.0) * (1 + 0.001 * i)
        blocks.append(m)
    base["models"] = blocks
    path = tmp_path / "trials.json"
    path.write_text(json.dumps(base))
    view = report.build_view(report.load([path]))
    decode = next(p for p in view["paired"] if p["metric"].startswith("decode"))
    assert decode["blocks"] == 5 and decode["verdict"] == "faster" and abs(decode["geomean"] - 1.1) < 1e-9
    assert "Paired blocks" in report.render_html(view)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_BROWSER = CHROMIUM is None and os.environ.get("CI") != "true"  # CI installs it and must run this


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert CHROMIUM, "chromium is missing: .ci/run should have installed it"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--enable-logging=stderr", "--v=0", f"--user-data-dir={cwd / 'profile'}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.skipif(NO_BROWSER, reason="no chromium here (.ci/run installs Debian's: apt-get install chromium)")
def test_the_report_renders_in_chromium(tmp_path):
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(hostile_run()))
    page = tmp_path / "compare.html"
    page.write_text(report.render_html(report.build_view(report.load([hostile, FIXTURE]))))
    shot = tmp_path / "compare.png"
    run = chromium(f"--screenshot={shot}", "--window-size=1400,2000", page.as_uri(), cwd=tmp_path)
    assert shot.exists() and shot.stat().st_size > 20_000, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Refused to" in line]
    assert not console, console
    dom = chromium("--dump-dom", page.as_uri(), cwd=tmp_path).stdout
    assert dom.count("<table") >= 6 and "Serving matrix" in dom and "withheld: different output counts" in dom
    assert "<script" not in dom.lower()


def test_a_stream_whose_tokens_arrive_together_is_flagged():
    cell = {"phase": "decode", "status": "measured", "reason": None, "metrics": {"median_decode_tps": 9e4},
            "attempts": [{"attempt": 0, "ok": True, "error": None, "requests": [
                {"event_ms": [100.0, 100.01, 100.02, 100.03], "itl_ms": [0.01, 0.01, 0.01], "output_tokens": 4}]}]}  # fmt: skip
    assert any(f.startswith("bursty stream: 3 of 3") for f in report._cell_view(cell)["flags"])
    cell["attempts"][0]["requests"][0]["itl_ms"] = [30.0, 30.0, 30.0]
    assert not any(f.startswith("bursty") for f in report._cell_view(cell)["flags"])
