"""`harness report` from fixture JSON: statuses, withheld ratios, hostile strings, no external references,
and the page in a real headless Chromium."""

import copy
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.report import page as report

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"
HOSTILE = '<script>alert("x")</script>'


def clean_run() -> dict:
    """The real tiny run as a clean measurement: not diagnostic, and every request long enough to time a rate (the
    fixture's cells took 10-40 ms): 64 tokens at 5 ms a token, the engine's 1.3x slower."""
    run = json.loads(FIXTURE.read_text())
    run["diagnostic"] = False
    for arm in run["models"][0]["arms"]:
        for c in arm["cells"]:
            if c["phase"] == "decode":  # three requests: enough for an interval
                requests = c["attempts"][0]["requests"]
                requests.append({**requests[-1], "index": len(requests)})
            for t in c["attempts"]:
                t["wall_s"] = max(t["wall_s"], 1.0)
                for r in t["requests"]:  # each pair's ratio its own: no resample is the point itself
                    r["output_tokens"] = 64
                    slope = 0.002 if arm["arm"] == "engine" else 0.001
                    r["tpot_ms"] = 5.0 * (1.3 if arm["arm"] == "engine" else 1.0) * (1 + slope * r["index"])
                    r["e2el_ms"] = r["ttft_ms"] + 63 * r["tpot_ms"]
            if c["phase"] == "decode":
                c["metrics"]["median_decode_tps"] = 1e3 / (5.0 * (1.3 if arm["arm"] == "engine" else 1.0))
    return run


def hostile_run() -> dict:
    """The real tiny run, edited into every case the report must handle."""
    run = clean_run()
    run["run_id"], run["label"] = "hostile0001", HOSTILE
    model = run["models"][0]
    model["model"] = '<img src="http://evil.example/x.png" onerror="alert(1)">'
    engine, mlx = model["arms"]
    cells = {c["phase"]: c for c in engine["cells"]}
    failed = cells["cold"]
    failed["status"], failed["reason"] = "failed", f"1 of 1 requests failed: {HOSTILE} https://evil.example/"
    failed["attempts"] = [
        {**failed["attempts"][0], "ok": False, "error": HOSTILE},
        {**failed["attempts"][0], "attempt": 1, "ok": False, "error": "again"},
    ]
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


def write(tmp_path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def view(tmp_path):
    return report.build_view(
        report.load([write(tmp_path, "hostile.json", hostile_run()), write(tmp_path, "clean.json", clean_run())])
    )


def headline_row(view, group: int, phase: str, arm: str = "engine") -> dict:
    return next(r for r in view["headline"][group]["rows"] if r["phase"] == phase and r["arm"] == arm)


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
    decode = headline_row(view, 0, "decode")
    assert decode["ratio"] is None and decode["withheld"] == "different output counts"
    clean = headline_row(view, 1, "decode")
    assert clean["withheld"] is None and abs(clean["ratio"] - 1 / 1.3) < 0.01 and clean["verdict"] == "slower"
    assert clean["ci_low"] <= clean["ratio"] <= clean["ci_high"] < 0.95 and clean["samples"] == 3
    assert clean["outputs"] == ""  # the fixture's arms gave the same tokens
    cold = headline_row(view, 1, "cold")  # one request a side: a ratio, no interval
    assert (
        cold["ratio"] is not None
        and cold["ci_low"] is None
        and cold["verdict"] == "unknown"
        and "below 3" in cold["note"]
    )


def test_each_reason_withholds_the_ratio_and_says_so(tmp_path):
    def withheld(edit, phase="decode") -> str:
        run = clean_run()
        edit(run, {a["arm"]: {c["phase"]: c for c in a["cells"]} for a in run["models"][0]["arms"]})
        view = report.build_view(report.load([write(tmp_path, "r.json", run)]))
        return headline_row(view, 0, phase)["withheld"] or ""

    def busy(run, cells):
        cells["mlx-lm"]["decode"]["metrics"]["preflight"] = {"problems": ["other processes use 90% of the CPUs"]}

    def short(run, cells):
        for r in cells["engine"]["decode"]["attempts"][0]["requests"]:
            r["output_tokens"], r["e2el_ms"] = 8, r["ttft_ms"] + 7 * 5.0

    def retried(run, cells):
        c = cells["engine"]["cold"]
        c["attempts"] = [{**c["attempts"][0], "ok": False, "error": "HTTP 500"}, {**c["attempts"][0], "attempt": 1}]

    def cached(run, cells):
        cells["engine"]["warm"]["attempts"][0]["requests"][0]["cached_tokens"] = 60

    def other_prompts(run, cells):
        for name in ("engine", "mlx-lm"):
            for i, r in enumerate(cells[name]["decode"]["attempts"][0]["requests"]):
                r["prompt_sha256"] = f"{name}{i}"

    assert withheld(lambda run, cells: run.update(diagnostic=True)).startswith("diagnostic run")
    assert (
        withheld(lambda run, cells: run["provenance"].update(source_tree_sha256_end="x"))
        == "the source tree changed during the run"
    )
    assert withheld(busy) == "mlx-lm: the machine was busy after the cell (other processes use 90% of the CPUs)"
    assert withheld(short).startswith("engine: too short: 7 timed tokens")
    assert (
        withheld(
            lambda run, cells: cells["engine"]["concurrency-2"]["attempts"][0].update(wall_s=0.02), "concurrency-2"
        )
        == "engine: too short: the cell took 20 ms (< 50 ms)"
    )
    assert withheld(retried, "cold").startswith("different attempts")
    assert withheld(cached, "warm").startswith("different cached tokens (60 against")
    assert withheld(other_prompts) == "different requests (prompt hashes)"


def test_outputs_that_differ_do_not_withhold_the_ratio_but_are_named(tmp_path):
    run = clean_run()  # the fast tier rounds otherwise than mlx-lm: other tokens, the same work
    for arm in run["models"][0]["arms"]:  # both servers returned token ids (the engine's two lanes, say)
        for r in next(c for c in arm["cells"] if c["phase"] == "decode")["attempts"][0]["requests"]:
            r["token_ids"], r["output_sha256"] = [1, 2], "a" * 64
    decode = next(c for c in run["models"][0]["arms"][0]["cells"] if c["phase"] == "decode")
    decode["attempts"][0]["requests"][0]["output_sha256"] = "f" * 64
    row = headline_row(report.build_view(report.load([write(tmp_path, "r.json", run)])), 0, "decode")
    assert row["ratio"] is not None and row["outputs"] == "outputs differ in 1 of 3 requests"


def test_a_baseline_in_another_file_is_compared_only_on_the_same_host_artifact_and_workload(tmp_path):
    run = clean_run()
    engine_only, mlx_only = copy.deepcopy(run), copy.deepcopy(run)
    engine_only["models"][0]["arms"] = [run["models"][0]["arms"][0]]
    mlx_only["models"][0]["arms"] = [run["models"][0]["arms"][1]]
    mlx_only["run_id"] = "other0000001"
    a = write(tmp_path, "a.json", engine_only)
    view = report.build_view(report.load([a, write(tmp_path, "b.json", mlx_only)]), baseline="mlx-lm")
    assert view["headline"][0]["note"] == "mlx-lm from b.json" and headline_row(view, 0, "decode")["ratio"] is not None
    mlx_only["provenance"]["host"] = "elsewhere"
    view = report.build_view(report.load([a, write(tmp_path, "b.json", mlx_only)]), baseline="mlx-lm")
    assert view["headline"][0]["rows"] == []
    assert view["headline"][0]["note"] == "mlx-lm is in b.json on another host: shown side by side, not divided"
    assert "on another host" in report.render_html(view)


def test_in_process_files_get_sections_of_their_own(tmp_path):
    reports = Path(__file__).resolve().parents[2] / "reports"
    quality = [
        {
            "model": "tiny",
            "settings": {},
            "tokens": 64,
            "rows": [
                {
                    "variant": "bf16",
                    "weights": "bf16",
                    "kv_bits": None,
                    "tier": "exact",
                    "nll": 2.0,
                    "perplexity": 7.39,
                    "mean_kl": None,
                    "top1_agreement": None,
                },
                {
                    "variant": "4bit",
                    "weights": "4bit",
                    "kv_bits": None,
                    "tier": "exact",
                    "nll": 2.1,
                    "perplexity": 8.17,
                    "mean_kl": 0.05,
                    "top1_agreement": 0.9,
                },
            ],
        }
    ]
    inputs = report.load(
        [
            reports / "gpu" / "qwen27b-native.json",
            reports / "cpu-spec-small-qwen35.json",
            write(tmp_path, "quality.json", quality),
            write(tmp_path, "run.json", clean_run()),
        ]
    )
    assert [i.kind for i in inputs] == ["native", "spec", "quality", "run"]
    view = report.build_view(inputs)
    (native,) = view["native"]
    assert native["model"] == "qwen27b" and native["decode"]["verdict"] in ("faster", "slower", "same", "unknown")
    assert [a["arm"] for a in view["spec"][0]["arms"]][0] == "plain"
    assert view["quality_files"][0]["rows"][1]["perplexity"] == 8.17
    html = report.render_html(view)
    assert "harness native" in html and "Speculative decoding: small-qwen35" in html and "8.170" in html
    md = report.render_markdown(view)
    assert "## In process: qwen27b" in md and "| 4bit | 8.17 |" in md


def test_the_curves_are_inline_svg_that_fetch_nothing(tmp_path):
    run = clean_run()
    run["models"][0]["arms"][0]["arm"] = HOSTILE
    view = report.build_view(report.load([write(tmp_path, "r.json", run)]), baseline="mlx-lm")
    (curves,) = view["curves"]
    for key in ("throughput", "latency", "cdf"):
        svg = curves[key]
        assert svg.startswith("<svg") and "<script" not in svg.lower() and HOSTILE not in svg
        assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", svg)


def test_a_cell_whose_requests_spread_widely_is_flagged_unstable():
    run = clean_run()
    decode = next(c for c in run["models"][0]["arms"][0]["cells"] if c["phase"] == "decode")
    requests = decode["attempts"][0]["requests"]
    requests.append({**requests[0], "index": 2})
    for r, tpot in zip(requests, (5.0, 9.0, 5.5)):
        r["tpot_ms"] = tpot
    assert any(f.startswith("unstable: the requests' CV is") for f in report._cell_view(decode)["flags"])
    for r in requests:
        r["tpot_ms"] = 5.0
    assert not any(f.startswith("unstable") for f in report._cell_view(decode)["flags"])


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
    with pytest.raises(ValueError, match="not a harness run record .* nor harness native, spec or quality JSON"):
        report.load([bad])
    with pytest.raises(ValueError, match="cannot read"):
        report.load([tmp_path / "missing.json"])


def test_trials_get_paired_verdicts(tmp_path):
    base = clean_run()
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
    (group,) = view["headline"]  # one table over the blocks, not one a block
    row = next(r for r in group["rows"] if r["phase"] == "decode")
    assert row["verdict"] == "faster" and row["note"].startswith("5 blocks") and abs(row["ratio"] - 1.1) < 1e-9


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_BROWSER = CHROMIUM is None and os.environ.get("CI") != "true"  # CI installs it and must run this


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert CHROMIUM, "chromium is missing: .ci/run should have installed it"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={cwd / 'profile'}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.skipif(NO_BROWSER, reason="no chromium here (.ci/run installs Debian's: apt-get install chromium)")
def test_the_report_renders_in_chromium(tmp_path):
    hostile = write(tmp_path, "hostile.json", hostile_run())
    page = tmp_path / "compare.html"
    page.write_text(
        report.render_html(report.build_view(report.load([hostile, write(tmp_path, "c.json", clean_run())])))
    )
    shot = tmp_path / "compare.png"
    run = chromium(f"--screenshot={shot}", "--window-size=1400,2000", page.as_uri(), cwd=tmp_path)
    assert shot.exists() and shot.stat().st_size > 20_000, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Refused to" in line]
    assert not console, console
    dom = chromium("--dump-dom", page.as_uri(), cwd=tmp_path).stdout
    assert dom.count("<table") >= 6 and "Serving matrix" in dom and "withheld: different output counts" in dom
    assert dom.index("Headline") < dom.index("<svg") < dom.index("Serving matrix")  # the first screen: table, curves
    assert "<script" not in dom.lower()


def test_a_stream_whose_tokens_arrive_together_is_flagged():
    cell = {
        "phase": "decode",
        "status": "measured",
        "reason": None,
        "metrics": {"median_decode_tps": 9e4},
        "attempts": [
            {
                "attempt": 0,
                "ok": True,
                "error": None,
                "requests": [
                    {"event_ms": [100.0, 100.01, 100.02, 100.03], "itl_ms": [0.01, 0.01, 0.01], "output_tokens": 4}
                ],
            }
        ],
    }
    assert any(f.startswith("bursty stream: 3 of 3") for f in report._cell_view(cell)["flags"])
    cell["attempts"][0]["requests"][0]["itl_ms"] = [30.0, 30.0, 30.0]
    assert not any(f.startswith("bursty") for f in report._cell_view(cell)["flags"])


def test_rate_cells_get_a_headline_row_and_a_curve_against_the_offered_rate(tmp_path):
    run = clean_run()
    for arm in run["models"][0]["arms"]:
        conc = next(c for c in arm["cells"] if c["phase"] == "concurrency-2")
        for rate in (2.0, 8.0):
            cell = copy.deepcopy(conc)
            cell["phase"] = f"rate-{rate:g}"
            cell["metrics"] |= {"offered_rate": rate, "request_throughput": rate * 0.9, "measured_requests": [0, 2]}
            arm["cells"].append(cell)
    view = report.build_view(report.load([write(tmp_path, "r.json", run)]))
    row = headline_row(view, 0, "rate-8")
    assert row["metric"] == "aggregate tok/s @8 req/s" and row["withheld"] is None and row["ratio"] is not None
    assert view["curves"][0]["rates"].startswith("<svg")
    cells = {c["phase"]: c for m in view["machines"].values() for r in m["rows"] for c in r["cells"]}
    assert cells["rate-2"]["value"].endswith("1.80 req/s achieved")


# ------------------------------------------------- aggregate rates, repetitions


def with_repetitions(run: dict, engine_tps: list[float], mlx_tps: list[float]) -> dict:
    """`run` with its concurrency-2 cell measured len(engine_tps) times: block 0 and repetition blocks (the warm-up
    and the load cell again, `--cell-repeats`), each arm's aggregate tok/s as given."""
    model = run["models"][0]
    for b, (e, m) in enumerate(zip(engine_tps, mlx_tps)):
        block = model if b == 0 else copy.deepcopy({**model, "block": b, "parity": {}})
        for arm in block["arms"]:
            arm["cells"] = [c for c in arm["cells"] if b == 0 or c["phase"] in ("warmup", "concurrency-2")]
            conc = next(c for c in arm["cells"] if c["phase"] == "concurrency-2")
            conc["metrics"]["output_throughput"] = e if arm["arm"] == "engine" else m
        if b:
            run["models"].append(block)
    run["settings"]["cell_repeats"] = len(engine_tps)
    return run


def test_one_bursts_aggregate_ratio_is_unknown_without_an_interval(tmp_path):
    view = report.build_view(report.load([write(tmp_path, "one.json", clean_run())]))
    agg = headline_row(view, 0, "concurrency-2")
    assert agg["ratio"] == agg["value"] / agg["baseline"] and agg["ci_low"] is None and agg["ci_high"] is None
    assert agg["verdict"] == "unknown" and agg["note"] == "one burst"
    last = view["headline"][0]["lines"][0]["parts"][-1]
    assert last == {"text": "agg@2 1.43x unknown (one burst)", "verdict": "unknown", "withheld": ""}
    assert "One burst a point: no band" in report.render_html(view)


def test_a_repeated_cells_interval_holds_its_point_and_comes_from_the_repetitions(tmp_path):
    engine, mlx = [400.0, 420.0, 390.0, 410.0], [280.0, 282.0, 275.0, 290.0]
    view = report.build_view(report.load([write(tmp_path, "rep.json", with_repetitions(clean_run(), engine, mlx))]))
    assert len(view["headline"]) == 1  # one headline for the model: repetition blocks feed its load cells
    agg = headline_row(view, 0, "concurrency-2")
    ratios = [e / m for e, m in zip(engine, mlx)]
    assert abs(agg["ratio"] - math.exp(sum(map(math.log, ratios)) / 4)) < 1e-12 and agg["samples"] == 4
    assert agg["ci_low"] < agg["ratio"] < agg["ci_high"] and agg["note"].startswith("4 repetitions")
    assert agg["ci_low"] > min(ratios) * 0.9 and agg["ci_high"] < max(ratios) * 1.1  # from the repetitions' spread
    assert agg["verdict"] == "faster"
    curves = view["curves"][0]
    assert curves["repetitions"] == 4 and curves["throughput"].count("fill-opacity: 0.18") >= 2  # a band an arm
    matrix = next(iter(view["machines"].values()))["rows"]
    assert any(r["where"].endswith("/ repetition 4") for r in matrix)
    one = report.build_view(report.load([write(tmp_path, "one.json", clean_run())]))["curves"][0]
    assert "fill-opacity: 0.18" not in one["throughput"]  # one burst: a point, no band


def test_the_first_screen_names_each_models_verdicts_before_the_tables(tmp_path):
    view = report.build_view(report.load([write(tmp_path, "clean.json", clean_run())]))
    html = report.render_html(view)
    line = html[html.index("Verdicts: each arm against mlx-lm") : html.index("Headline: every ratio")]
    assert "tiny-qwen3 on 2-core CPU (AMD EPYC)" in line and "decode 0.77x [" in line and "slower" in line
    assert html.index("Headline: every ratio") < html.index("<svg")
    assert "<th>value</th><th>mlx-lm</th>" in html  # one column an arm, headed by what it holds
    md = report.render_markdown(view)
    assert "- engine: decode 0.77x [" in md and md.index("## Verdicts") < md.index("## Headline")


def test_cells_measured_on_one_side_are_counted_not_listed(tmp_path):
    run = clean_run()
    mlx = run["models"][0]["arms"][1]
    mlx["cells"] = [c for c in mlx["cells"] if c["phase"] != "concurrency-2"]
    mlx["status"], mlx["error"] = "interrupted", "the run was interrupted by SIGTERM during phase concurrency-2"
    view = report.build_view(report.load([write(tmp_path, "r.json", run)]))
    group = view["headline"][0]
    assert all(r["phase"] != "concurrency-2" for r in group["rows"])
    assert group["withheld"] == "withheld: 1 ratio (not measured on both 1)"
    assert group["note"] == f"mlx-lm interrupted: {mlx['error']}"  # why the baseline's cell is missing


def test_no_committed_report_draws_a_verdict_from_a_zero_width_or_one_sided_interval():
    from harness.run import headline
    from harness.run.repetitions import is_repetition

    reports = FIXTURE.parent.parent.parent / "reports"
    checked = repeated = 0
    for path in [*reports.glob("*.json"), *reports.glob("gpu/*.json")]:
        run = json.loads(path.read_text())
        if report.report_inputs.kind_of(run) != report.report_inputs.RUN or run["kind"] != "run":
            continue
        for model in (m for m in run["models"] if not is_repetition(run, m)):
            base = next((a for a in model["arms"] if a["arm"] == "mlx-lm"), None)
            for r in headline.model_rows(run, model, run, base):
                checked += 1
                if r["ci_low"] is not None:
                    assert r["ci_low"] < r["ratio"] < r["ci_high"] or r["verdict"] == "unknown", (path.name, r)
                if r["phase"].startswith(("concurrency-", "rate-")) and r["withheld"] is None:
                    one_burst = r["verdict"] == "unknown" and r["note"] == "one burst" and r["ci_low"] is None
                    assert one_burst or r["note"].startswith(f"{r['samples']} repetitions"), (path.name, r)
                    repeated += not one_burst
    assert checked > 50 and repeated >= 2  # cpu-repeats-tiny-qwen3.json's
