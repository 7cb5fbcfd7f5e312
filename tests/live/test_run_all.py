"""`harness run all` end to end on a tiny model: records, parity probe, a server that dies, no leftovers."""

import json
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from processes import TAG, leftovers, new_tag, tagged_env

from engine.kernels import AUTO
from harness.run.arms import ArmSpec, standard_arms
from harness.run.runner import Block, Runner, RunSettings
from harness.run.workloads import WorkloadSettings, phase_names

MODEL = "tiny-qwen3"
FAKE = Path(__file__).with_name("fake_server.py")
# the fault tests' run: two 4-token decode samples, short prompts, one concurrency cell
FAULTS = RunSettings(
    tokens=4,
    decode_samples=2,
    workload=WorkloadSettings(
        cold_prompt_tokens=64, decode_prompt_tokens=32, concurrent_prompt_tokens=32, concurrency=(2,)
    ),
)


@pytest.fixture
def tag(monkeypatch) -> str:
    """This test's tag, in the environment its servers inherit (`processes.leftovers`)."""
    value = new_tag()
    monkeypatch.setenv(TAG, value)
    return value


@pytest.fixture(scope="module")
def cli_run(tiny_path, tmp_path_factory):
    tiny_path(MODEL)  # synthesized before the harness looks for it
    out = tmp_path_factory.mktemp("run")
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "all",
        "--models",
        MODEL,
        "--arms",
        "engine,engine-serial,mlx-lm",
        "--tokens",
        "8",
        "--skip-context",
        "--concurrency",
        "2",
        "--decode-samples",
        "2",
        "--diagnostic",
        "--goodput",
        "ttft:600000",
        "tpot:60000",
        "--quality-tokens",
        "64",
        "--out",
        str(out / "run.json"),
        "--db",
        str(out / "runs.sqlite"),
    ]
    run_tag = new_tag()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=tagged_env(run_tag))
    return proc, out, run_tag


def test_the_run_completes_with_all_three_arms(cli_run):
    proc, out, run_tag = cli_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (out / "run.md").read_text()
    for arm in ("engine", "engine-serial", "mlx-lm"):
        assert f"\n| {arm} | " in md  # its row, no status beside the name: measured
        assert f"- {MODEL} / {arm} / concurrency-2: goodput " in md and "attainment 100% of 2" in md
    assert "Goodput (requests meeting every SLO: ttft &lt;= 600000 ms, tpot &lt;= 60000 ms):" in md
    for arm in ("engine", "engine-serial"):
        assert f"- {MODEL} / {arm}: held-out perplexity " in md and "over 64 tokens (exact tier)" in md
    assert f"{MODEL} / mlx-lm: held-out" not in md
    assert not leftovers(run_tag)


def test_the_json_follows_the_schema(cli_run):
    _, out, _ = cli_run
    run = json.loads((out / "run.json").read_text())
    assert run["schema_version"] == 1 and run["finished"] and run["diagnostic"] and run["kind"] == "run"
    for key in ("host", "os", "cpu", "python", "mlx", "mlx_lm", "git_commit", "source_tree_sha256", "environment"):
        assert key in run["provenance"], key
    assert {"other_cpu_percent", "memory_available_bytes", "swap_used_bytes"} <= set(run["preflight"])
    (model,) = run["models"]
    assert len(model["workload_sha256"]) == 64 and len(model["manifest_sha256"]) == 64
    assert [a["arm"] for a in model["arms"]] == ["engine", "engine-serial", "mlx-lm"]
    assert "oracles.mlx_lm_server" in " ".join(run["commands"]["mlx-lm"])
    assert [(a["kernels"] or {}).get("requested") for a in model["arms"]] == [AUTO, AUTO, None]
    phases = ["warmup", "probe", "decode", "cold", "warm", "concurrency-2"]
    for arm in model["arms"]:
        assert arm["status"] == "measured" and arm["load_to_ready_s"] > 0 and arm["peak_rss_bytes"] > 0
        assert [c["phase"] for c in arm["cells"]] == phases
        for cell in arm["cells"]:
            assert cell["status"] == "measured", (arm["arm"], cell)
            (attempt,) = cell["attempts"]
            want = {"warmup": 8, "probe": 64, "cold": 16, "warm": 16}.get(cell["phase"], 8)
            assert cell["metrics"]["requested_output_tokens"] == want and cell["metrics"]["short_outputs"] == 0
            for r in attempt["requests"]:
                assert r["ok"] and r["output_tokens"] == want and r["finish_reason"] == "length"
                assert 0 < r["headers_ms"] <= r["ttft_ms"] <= r["e2el_ms"]
                assert r["event_ms"] == sorted(r["event_ms"]) and len(r["output_sha256"]) == 64
                assert r["tpot_ms"] is not None and r["usage"]["completion_tokens"] == want
        decode = next(c for c in arm["cells"] if c["phase"] == "decode")
        assert len(decode["metrics"]["decode_tps_samples"]) == 2
        for key in ("median_ttft_ms", "p99_itl_ms", "mean_e2el_ms", "output_throughput", "total_token_throughput"):
            assert decode["metrics"][key] is not None, key
    quality = {a["arm"]: a["quality"] for a in model["arms"]}
    assert quality["mlx-lm"] is None and quality["engine"] == quality["engine-serial"]  # one artifact, one tier
    assert quality["engine"]["tokens"] == 64 and quality["engine"]["perplexity"] > 1
    warm = {a["arm"]: next(c for c in a["cells"] if c["phase"] == "warm") for a in model["arms"]}
    assert warm["engine"]["metrics"]["cached_tokens"][0] > 0  # the cold prompt, served from the prefix cache
    # stability: the preflight check after every cell and at the end, the source tree at both ends, each request's
    # prompt hash (the same on every arm), an engine server's MLX memory
    assert {"other_cpu_percent", "problems"} <= set(run["preflight_end"])
    assert run["provenance"]["source_tree_sha256_end"] == run["provenance"]["source_tree_sha256"]
    hashes = {
        a["arm"]: [r["prompt_sha256"] for c in a["cells"] for r in c["attempts"][0]["requests"]] for a in model["arms"]
    }
    assert hashes["engine"] == hashes["mlx-lm"] and all(len(h) == 64 for h in hashes["engine"])
    for arm in model["arms"]:
        assert all("other_cpu_percent" in c["metrics"]["preflight"] for c in arm["cells"])
        memory = arm["device_memory"]
        assert memory is None if arm["arm"] == "mlx-lm" else memory["peak_bytes"] >= memory["active_bytes"] > 0


def test_the_parity_probe_agrees_across_arms(cli_run):
    _, out, _ = cli_run
    parity = json.loads((out / "run.json").read_text())["models"][0]["parity"]
    assert parity["reference"] == "engine"
    assert parity["verdicts"]["engine-serial"] == {"match": True, "compared": "token ids", "output_tokens": 64}
    assert parity["verdicts"]["mlx-lm"]["match"] and parity["verdicts"]["mlx-lm"]["compared"] == "text"


def test_the_database_indexes_the_run(cli_run):
    _, out, _ = cli_run
    db = sqlite3.connect(out / "runs.sqlite")
    (run_id,) = db.execute("select run_id from runs").fetchone()
    assert db.execute("select count(*) from arms where run_id = ?", (run_id,)).fetchone()[0] == 3
    assert db.execute("select count(*) from cells where status = 'measured'").fetchone()[0] == 3 * 6
    n_requests = db.execute("select count(*) from requests where ok = 1").fetchone()[0]
    assert n_requests == 3 * ((1 + 2) + 1 + 2 + 1 + 1 + 2)  # warmup: one alone, then one per stream
    assert db.execute("select count(*) from samples").fetchone()[0] > 0
    assert [r[0] for r in db.execute("select version from _migrations")] == [1, 2, 3, 4, 5, 6]
    assert db.execute("select count(*) from arms where json_extract(quality, '$.tokens') = 64").fetchone()[0] == 2
    tiers = dict(db.execute("select arm, json_extract(kernels, '$.requested') from arms").fetchall())
    assert tiers == {"engine": AUTO, "engine-serial": AUTO, "mlx-lm": None}


def test_a_server_that_dies_mid_phase_is_recorded_and_the_run_goes_on(tiny_path, tmp_path, tag):
    model_dir = tiny_path(MODEL)
    crasher = ArmSpec("crasher", lambda d, port: [sys.executable, str(FAKE), "--port", str(port), "--exit-after", "5"])
    runner = Runner(FAULTS, tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None)
    record = runner.run([(MODEL, model_dir)], [Block(0, (crasher, standard_arms()["engine-serial"]))])
    dead, alive = record.models[0].arms
    statuses = {c.phase: c.status for c in dead.cells}
    # warmup (3 requests) and probe answer; the fifth request (the first decode sample) kills the server
    assert statuses["warmup"] == statuses["probe"] == "measured" and statuses["decode"] == "failed"
    assert all(statuses[p] == "not_measured" for p in phase_names(FAULTS.workload)[3:])
    assert dead.status == "failed" and "exited (status 3) during phase decode" in dead.error
    assert "fake server: exiting on purpose" in dead.stderr_tail
    decode = next(c for c in dead.cells if c.phase == "decode")
    assert len(decode.attempts) == 1 and "exited" in decode.reason  # no retry against a dead server
    assert alive.status == "measured" and all(c.status == "measured" for c in alive.cells)
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["models"][0]["arms"][0]["status"] == "failed" and saved["finished"]
    assert not leftovers(tag)


def test_a_server_that_breaks_but_stays_up_has_its_first_logged_error_in_the_failed_cells(tiny_path, tmp_path):
    # as mlx-lm's server whose generation thread died (out of device memory): every later request answered 404,
    # its log's tail nothing but access lines; the failed cells' reason carries what the log said first
    model_dir = tiny_path(MODEL)
    breaks = ArmSpec("breaks", lambda d, port: [sys.executable, str(FAKE), "--port", str(port), "--break-after", "5"])
    runner = Runner(
        replace(FAULTS, quality_tokens=0), tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None
    )
    (arm,) = runner.run([(MODEL, model_dir)], [Block(0, (breaks,))]).models[0].arms
    failed = [c for c in arm.cells if c.status == "failed"]
    assert failed and failed[0].phase == "decode"
    for cell in failed:
        assert "HTTP 404" in cell.reason and cell.reason.endswith(
            "; the server's log first said: RuntimeError: out of memory (the fake server breaks on purpose)"
        ), cell.reason


def test_trials_alternate_the_arm_order_with_one_seed_per_block(tiny_path, tmp_path, tag):
    tiny_path(MODEL)  # synthesized before the harness looks for it
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "trials",
        "--models",
        MODEL,
        "--arms",
        "engine,engine-serial",
        "--seeds",
        "2",
        "--tokens",
        "4",
        "--skip-context",
        "--concurrency",
        "2",
        "--decode-samples",
        "1",
        "--diagnostic",
        "--out",
        str(tmp_path / "trials.json"),
        "--db",
        str(tmp_path / "runs.sqlite"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((tmp_path / "trials.json").read_text())
    assert run["kind"] == "trials"
    blocks = run["models"]
    assert [b["block"] for b in blocks] == [0, 1] and [b["workload_seed"] for b in blocks] == [0, 1]
    assert [b["arm_order"] for b in blocks] == [["engine", "engine-serial"], ["engine-serial", "engine"]]
    assert blocks[0]["workload_sha256"] != blocks[1]["workload_sha256"]
    assert all(a["status"] == "measured" for b in blocks for a in b["arms"])
    assert not leftovers(tag)


def test_db_export_feeds_the_report(cli_run):
    _, out, _ = cli_run
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    harness = [sys.executable, "-m", "harness"]
    listed = subprocess.run([*harness, "db", "list", "--db", str(out / "runs.sqlite")], capture_output=True, text=True)
    assert listed.returncode == 0 and run_id in listed.stdout
    exported = out / "exported.json"
    ex = subprocess.run(
        [*harness, "db", "export", run_id, "--db", str(out / "runs.sqlite"), "--out", str(exported)],
        capture_output=True,
        text=True,
    )
    assert ex.returncode == 0, ex.stderr
    html = out / "from-db.html"
    rep = subprocess.run(
        [*harness, "report", str(exported), str(out / "run.json"), "--out", str(html)], capture_output=True, text=True
    )
    assert rep.returncode == 0, rep.stderr
    text = html.read_text()
    assert text.count(">engine-serial<") >= 2 and "Serving matrix" in text
    missing = subprocess.run(
        [*harness, "db", "export", "nope", "--db", str(out / "runs.sqlite")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_an_arm_that_never_starts_is_recorded_with_its_error(tiny_path, tmp_path):
    broken = ArmSpec(
        "broken",
        lambda d, port: [sys.executable, "-c", "import sys; print('no such model', file=sys.stderr); sys.exit(2)"],
    )
    settings = RunSettings(
        tokens=4,
        decode_samples=1,
        workload=WorkloadSettings(
            cold_prompt_tokens=32, decode_prompt_tokens=16, concurrent_prompt_tokens=16, concurrency=(2,)
        ),
    )
    runner = Runner(settings, tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None)
    (arm,) = runner.run([(MODEL, tiny_path(MODEL))], [Block(0, (broken,))]).models[0].arms
    assert arm.status == "failed" and "did not start" in arm.error and "no such model" in arm.stderr_tail
    assert {c.status for c in arm.cells} == {"not_measured"}
    db = sqlite3.connect(tmp_path / "runs.sqlite")
    assert db.execute("select count(*) from cells where status = 'not_measured'").fetchone()[0] == len(arm.cells)


def test_repeated_cells_run_in_alternating_blocks_and_give_the_aggregate_an_interval(tiny_path, tmp_path, tag):
    from harness.report import page as report
    from harness.run.runner import blocks_of, progress_steps

    fake = [ArmSpec(name, lambda d, port: [sys.executable, str(FAKE), "--port", str(port)]) for name in ("a", "b")]
    settings = RunSettings(
        tokens=64,
        decode_samples=1,
        quality_tokens=0,
        cell_repeats=3,
        workload=WorkloadSettings(
            cold_prompt_tokens=32,
            decode_prompt_tokens=16,
            concurrent_prompt_tokens=16,
            concurrency=(2,),
            rates=(50.0,),
            rate_requests=10,
        ),
    )
    blocks = blocks_of("run", [0], fake, settings.cell_repeats)
    steps = []
    runner = Runner(
        settings, tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None, on_phase=steps.append
    )
    record = runner.run([(MODEL, tiny_path(MODEL))], blocks)
    assert len(steps) == progress_steps(settings, blocks, 1) == 2 * 7 + 2 * (2 * 3)  # the counter ends at its total
    models = record.models
    assert [m.block for m in models] == [0, 1, 2] and {m.workload_seed for m in models} == {0}
    assert [m.arm_order for m in models] == [["a", "b"], ["b", "a"], ["a", "b"]]
    for m in models[1:]:  # a repetition: every server again, its warm-up and the load cells only
        assert all([c.phase for c in arm.cells] == ["warmup", "concurrency-2", "rate-50"] for arm in m.arms)
        assert all(c.status == "measured" for arm in m.arms for c in arm.cells)
    view = report.build_view(report.load([tmp_path / "run.json"]))
    (group,) = view["headline"]
    for phase in ("concurrency-2", "rate-50"):
        row = next(r for r in group["rows"] if r["phase"] == phase)
        assert row["withheld"] is None and row["samples"] == 3 and row["note"].startswith("3 repetitions"), row
        assert row["ci_low"] < row["ratio"] < row["ci_high"]
    assert view["curves"][0]["repetitions"] == 3
    assert not leftovers(tag)
