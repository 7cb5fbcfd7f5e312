"""A server the harness did not start, measured alone and run after run: each run opens the prompts it sends there
with a nonce of its own, so that no run finds an earlier one's prompts in the server's prompt cache; given an
earlier run's nonce, a run sends its prompts again, and the cache that then serves them withholds the cells'
ratios. Against tests/live/fake_server.py, which reports the prefix each prompt shares with an earlier one as
cached, as a prompt cache would."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.cli import build_parser
from harness.run import anomalies, comparable
from harness.run.arms import external_arm
from harness.run.cli import _run_plan
from harness.run.client import RequestRecord, prompt_sha256
from harness.run.measured import run_nonce
from harness.run.records import MEASURED, ArmRun, Attempt, Cell, ModelRun
from harness.run.runner import Block, Runner, RunSettings, probe_parity
from harness.run.servers import free_port, start_server
from harness.run.workloads import CHAT, WorkloadSettings, load_or_build

FAKE = Path(__file__).resolve().parents[1] / "live" / "fake_server.py"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run_tiny.json"
MODEL = "tiny-qwen3"
SETTINGS = RunSettings(
    tokens=4,
    decode_samples=2,
    quality_tokens=0,
    workload=WorkloadSettings(
        cold_prompt_tokens=64, decode_prompt_tokens=32, concurrent_prompt_tokens=32, concurrency=(2,)
    ),
)
FIRST_DECODE_REQUEST = 5  # after the warm-up's 3 requests and the probe


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = start_server(
        [sys.executable, str(FAKE), "--port", str(port), "--prompt-cache", "--stall", f"{FIRST_DECODE_REQUEST}:1.2"],
        port,
        timeout_s=60,
    )
    yield srv
    srv.stop()


def measure(tmp_path: Path, url: str, model_dir: Path, **settings) -> dict:
    out = tmp_path / "run.json"
    runner = Runner(replace(SETTINGS, **settings), out, tmp_path / "runs.sqlite", log=lambda m: None)
    runner.run([(MODEL, model_dir)], [Block(0, (external_arm(f"ext={url}"),))])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def first(server, tiny_path, tmp_path_factory) -> dict:
    """The first run against the server (its decode cell's first request stalls)."""
    return measure(tmp_path_factory.mktemp("first"), server.url, tiny_path(MODEL))


def cell(run: dict, phase: str) -> dict:
    (arm,) = run["models"][0]["arms"]
    return next(c for c in arm["cells"] if c["phase"] == phase)


def first_request(run: dict, phase: str) -> dict:
    return cell(run, phase)["attempts"][0]["requests"][0]


def test_each_run_sends_a_server_it_did_not_start_prompts_of_its_own(tmp_path, tiny_path, server, first):
    model_dir = tiny_path(MODEL)
    second = measure(tmp_path, server.url, model_dir)
    assert first["settings"]["run_nonce"] != second["settings"]["run_nonce"]
    for run in (first, second):
        (arm,) = run["models"][0]["arms"]
        assert arm["status"] == "measured" and run_nonce(arm) == run["settings"]["run_nonce"]
        assert arm["endpoint"]["workload_sha256"] != run["models"][0]["workload_sha256"]  # not the frozen prompts
    assert first_request(first, "cold")["prompt_sha256"] != first_request(second, "cold")["prompt_sha256"]
    assert first_request(second, "cold")["cached_tokens"] <= 2  # at most a nonce's first hex token
    assert first_request(second, "warm")["cached_tokens"] == 63  # the run's own cold prompt again
    frozen, _ = load_or_build(MODEL, model_dir, SETTINGS.workload)
    for run in (first, second):  # the probe stays the frozen one, compared with the arms the harness starts
        assert first_request(run, "probe")["prompt_sha256"] == prompt_sha256(frozen.prompts("probe", 0)[0])
    assert anomalies.flagged_lines(second) == []
    stall = [line for line in anomalies.flagged_lines(first) if "stall: a 1.2 s gap" in line]
    assert stall == [f"{MODEL} / ext / decode: " + anomalies.stall(cell(first, "decode"))]


def test_an_earlier_runs_nonce_sends_its_prompts_again_and_the_cache_withholds_the_ratios(
    tmp_path, tiny_path, server, first
):
    again = measure(tmp_path, server.url, tiny_path(MODEL), run_nonce=first["settings"]["run_nonce"])
    assert first_request(again, "cold")["prompt_sha256"] == first_request(first, "cold")["prompt_sha256"]
    assert first_request(again, "cold")["cached_tokens"] == 63
    why = comparable.cell_reason(cell(again, "cold"), again["settings"]["workload"])
    assert why.startswith("cached tokens the workload does not explain: 1 of 1 requests (request 0: 63 of 64")
    assert f"{MODEL} / ext / concurrency-2: cached tokens the workload does not explain" in "\n".join(
        anomalies.flagged_lines(again)
    )


def test_an_arm_sent_the_run_nonces_prompts_is_compared_by_prompt_lengths():
    run = json.loads(FIXTURE.read_text())
    run["diagnostic"] = False
    engine, mlx = run["models"][0]["arms"]
    for arm in (engine, mlx):
        for i, r in enumerate(next(c for c in arm["cells"] if c["phase"] == "cold")["attempts"][0]["requests"]):
            r["prompt_sha256"] = f"{arm['arm']}{i}"
    assert comparable.withheld(run, engine, run, mlx, "cold") == "different requests (prompt hashes)"
    engine["endpoint"] = {"url": "http://127.0.0.1:9", "model_id": "m", "run_nonce": "ab12"}
    assert comparable.withheld(run, engine, run, mlx, "cold") is None  # the same lengths: the same work


def test_the_chat_probe_leaves_out_an_arm_whose_chats_open_with_the_run_nonce():
    def arm(name: str, text: str, nonce: str = "") -> ArmRun:
        reply = RequestRecord(CHAT, 0, 0, 0, ok=True, text=text, prompt_tokens=30)
        return ArmRun(
            name,
            [],
            {},
            endpoint={"run_nonce": nonce} if nonce else None,
            cells=[Cell(CHAT, MEASURED, attempts=[Attempt(0, True, None, 1.0, [reply])])],
        )

    mrun = ModelRun(
        "m", "/m", "x", "y", None, arms=[arm("engine", " a b"), arm("ext", " c d", "ab12"), arm("e2", " a b")]
    )
    verdicts = probe_parity(mrun, CHAT)["verdicts"]
    assert verdicts["engine"]["match"] and verdicts["e2"]["match"]
    assert verdicts["ext"]["match"] is None and verdicts["ext"]["compared"].startswith("not compared")


def test_the_nonce_option_reaches_the_run_settings(capsys):
    plan = ["run", "all", "--models", MODEL, "--arms", "", "--arm", "ext=http://127.0.0.1:9", "--dry-run"]
    assert _run_plan(build_parser().parse_args([*plan, "--nonce", "AB12"]))[1].run_nonce == "ab12"
    assert _run_plan(build_parser().parse_args(plan))[1].run_nonce is None  # the Runner draws one
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*plan, "--nonce", "xyz"])
    assert exited.value.code == 2 and "hex digits" in capsys.readouterr().err
