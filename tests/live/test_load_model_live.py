"""`harness run all`'s load model end to end on a tiny model: a server started by hand measured through --arm,
a rate sweep, a shared-prefix cell, counters from /metrics, the vLLM export."""

import json
import subprocess
import sys

import pytest
from live_server import LiveServer
from processes import leftovers, new_tag, tagged_env

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def run(tiny_path, tmp_path_factory):
    tiny_path(MODEL)
    hand = LiveServer("--model", MODEL)  # started by hand: the harness neither starts nor stops it
    out = tmp_path_factory.mktemp("load")
    cmd = [sys.executable, "-m", "harness", "run", "all", "--models", MODEL, "--arms", "engine-serial",
           "--arm", f"hand={hand.url}", "--tokens", "8", "--skip-context", "--concurrency", "2", "--decode-samples",
           "2", "--rates", "sweep:4", "--rate-requests", "8", "--prefix-groups", "1", "--prefix-group-size", "3",
           "--prefix-tokens", "64", "--chats", "2", "--turns", "2", "--goodput", "ttft:60000", "--quality-tokens",
           "0", "--diagnostic",
           "--export", "vllm", "--out", str(out / "run.json"), "--db", str(out / "runs.sqlite")]  # fmt: skip
    run_tag = new_tag()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=tagged_env(run_tag))
    still_up = hand.client.get("/health").status_code
    assert hand.stop()[0] == 0
    return proc, out, run_tag, still_up


def test_the_server_started_by_hand_is_measured_and_left_running(run):
    proc, out, run_tag, still_up = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert still_up == 200 and not leftovers(run_tag)
    record = json.loads((out / "run.json").read_text())
    arms = {a["arm"]: a for a in record["models"][0]["arms"]}
    hand = arms["hand"]
    assert hand["command"][0] == "(external)" and hand["endpoint"]["model_id"] == MODEL
    assert hand["status"] == "measured" and hand["load_to_ready_s"] is None and hand["peak_rss_bytes"] is None
    for arm in arms.values():  # what each server counted during the decode cell (/metrics)
        decode = next(c for c in arm["cells"] if c["phase"] == "decode")
        tokens = {k: v for k, v in decode["metrics"]["server_counters"].items() if k.startswith("vllm:generation_tokens")}
        assert list(tokens.values()) == [16.0], decode["metrics"]["server_counters"]


def test_the_rate_sweep_and_the_shared_prefix_cell(run):
    _, out, _, _ = run
    record = json.loads((out / "run.json").read_text())
    for arm in record["models"][0]["arms"]:
        rates = [c for c in arm["cells"] if c["phase"].startswith("rate-")]
        assert rates[0]["phase"] == "rate-4" and len(rates) == 8  # 4, 8, ... 512: measured, or past saturation
        for c in rates:
            if c["status"] == "measured":
                assert c["metrics"]["measured_requests"] == [1, 7] and c["metrics"]["offered_rate"] > 0
            else:
                assert c["status"] == "not_measured" and c["reason"].startswith("past the saturation point")
        prefix = next(c for c in arm["cells"] if c["phase"] == "prefix")
        cached = prefix["metrics"]["cached_tokens"]
        assert cached[0] == 0 and all(x >= 64 for x in cached[1:])  # the others start from the group's prompt
        chat = next(c for c in arm["cells"] if c["phase"] == "multiturn")["metrics"]  # through the chat endpoint
        # turn 1: at most the chat template's opening tokens; turn 2: turn 1's prompt up to where the template
        # renders the reply otherwise than it opened the answer
        first, second = chat["turn_cached_tokens"]
        assert first < 8 and chat["turn_prompt_tokens"][0] * 0.8 < second < chat["turn_prompt_tokens"][1]
    md = (out / "run.md").read_text()
    assert "offered -&gt; achieved: 4 -&gt;" in md and "highest rate with SLO attainment &gt;= 90%" in md
    assert "/ prefix: a group&#x27;s first request TTFT" in md and "/ multiturn (median TTFT over the chats): turn 1:" in md


def test_the_vllm_export_lists_every_timed_cell(run):
    _, out, _, _ = run
    results = json.loads((out / "run.vllm.json").read_text())
    phases = {(r["harness"]["arm"], r["harness"]["phase"]) for r in results}
    assert {("hand", "decode"), ("engine-serial", "rate-4"), ("hand", "prefix")} <= phases
    rate = next(r for r in results if r["harness"]["phase"] == "rate-4")
    assert rate["request_rate"] == 4.0 and rate["num_prompts"] == 6 and rate["completed"] == 6
