"""`engine serve --kernels`: the tier that runs shows in usage, /stats, the ready line and the run records."""

import json
import sqlite3

import pytest
from live_server import LiveServer, stream

from engine.kernels import EXACT, FAST, fast_refusal, on_cuda
from harness.run.arms import standard_arms
from harness.run.runner import Block, Runner, RunSettings
from harness.run.servers import tail
from harness.run.workloads import WorkloadSettings

MODEL = "tiny-llama"  # not the model test_run_all watches for leftover processes
RAN = FAST if on_cuda() else EXACT  # what asking for the fast tier gives on this machine


@pytest.fixture(scope="module")
def fast_server(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--kernels", "fast")
    yield srv
    assert srv.stop()[0] == 0


def test_usage_says_which_tier_ran(fast_server):
    r = fast_server.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["engine"]["kernels"] == RAN
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]  # the OpenAI fields stay
    events, done = stream(
        fast_server.client,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream_options": {"include_usage": True}},
    )
    assert done and events[-1]["choices"] == [] and events[-1]["usage"]["engine"]["kernels"] == RAN


def test_stats_carry_the_kernel_set(fast_server):
    stats = fast_server.stats()
    k = stats["kernels"]
    assert (k["tier"], k["requested"]) == (RAN, FAST)
    assert set(k) == {
        "tier",
        "requested",
        "quantized_linears",
        "dense_prefill_linears",
        "chunked_delta_layers",
        "step_kernel_layers",
        "attention_step_layers",
        "attention_kernel_layers",
        "prefill_attention_layers",
        "fused_stages",
        "reason",
        "settings",
    }
    assert ("CUDA" in k["reason"]) == (RAN == EXACT)
    assert {"batch", "prompt_cache", "totals"} <= set(stats)  # the rest of /stats is unchanged


def test_startup_says_the_tier_and_why_it_fell_back(fast_server):
    out, err = tail(fast_server.server.stdout_path), tail(fast_server.server.stderr_path, 100_000)
    assert f"kernels {RAN} (fast)," in out.splitlines()[0]
    fallbacks = [line for line in err.splitlines() if line.startswith("kernels: fast requested")]
    assert fallbacks == ([f"kernels: fast requested, running exact: {fast_refusal()}"] if RAN == EXACT else [])


def test_a_run_records_the_tier_the_server_reported(tiny_path, tmp_path):
    settings = RunSettings(
        tokens=3,
        decode_samples=1,
        workload=WorkloadSettings(
            cold_prompt_tokens=32, decode_prompt_tokens=16, concurrent_prompt_tokens=16, concurrency=(2,)
        ),
    )
    runner = Runner(settings, tmp_path / "run.json", tmp_path / "runs.sqlite", log=lambda m: None)
    arms = standard_arms()
    record = runner.run([(MODEL, tiny_path(MODEL))], [Block(0, (arms["engine-fast"], arms["engine-exact"]))])
    fast, exact = record.models[0].arms
    assert fast.status == exact.status == "measured"
    assert (fast.kernels["tier"], fast.kernels["requested"]) == (RAN, FAST)  # from /stats, not from the arm's flag
    assert (exact.kernels["tier"], exact.kernels["requested"]) == (EXACT, EXACT)
    saved = json.loads((tmp_path / "run.json").read_text())["models"][0]["arms"]
    assert [a["kernels"]["tier"] for a in saved] == [RAN, EXACT]
    probe = next(c for c in saved[0]["cells"] if c["phase"] == "probe")
    assert probe["attempts"][0]["requests"][0]["usage"]["engine"]["kernels"] == RAN
    # each engine cell records what the server first ran and compiled meanwhile (on the CPU: nothing compiles)
    measured = [c for c in saved[0]["cells"] if c.get("metrics")]
    assert measured and all(
        c["metrics"]["compiled_modules"] == 0 and isinstance(c["metrics"]["new_shapes"], int) for c in measured
    )
    db = sqlite3.connect(tmp_path / "runs.sqlite")
    stored = dict(db.execute("select arm, kernels from arms").fetchall())
    assert json.loads(stored["engine-fast"])["tier"] == RAN and json.loads(stored["engine-exact"])["tier"] == EXACT
