"""`harness run all`'s load model end to end on a tiny model: a server started by hand measured through --arm,
a rate sweep, a shared-prefix cell, the chat and staggered cells, counters from /metrics, the vLLM export."""

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
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "all",
        "--models",
        MODEL,
        "--arms",
        "engine-serial",
        "--arm",
        f"hand={hand.url}",
        "--tokens",
        "8",
        "--skip-context",
        "--concurrency",
        "2",
        "--decode-samples",
        "2",
        "--rates",
        "sweep:4",
        "--rate-requests",
        "8",
        "--prefix-groups",
        "1",
        "--prefix-group-size",
        "3",
        "--prefix-tokens",
        "64",
        "--chats",
        "2",
        "--turns",
        "2",
        "--chat-requests",
        "2",
        "--staggered",
        "2",
        "--staggered-tokens",
        "96",
        "--stagger",
        "0.5",
        "--goodput",
        "ttft:60000",
        "--quality-tokens",
        "0",
        "--diagnostic",
        "--export",
        "vllm",
        "--out",
        str(out / "run.json"),
        "--db",
        str(out / "runs.sqlite"),
    ]
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
        tokens = {
            k: v for k, v in decode["metrics"]["server_counters"].items() if k.startswith("vllm:generation_tokens")
        }
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
                assert c["status"] == "not_measured" and c["reason"].startswith("past the sweep's end")
        prefix = next(c for c in arm["cells"] if c["phase"] == "prefix")
        cached = prefix["metrics"]["cached_tokens"]
        # the others start from the group's prompt; the first shares at most its nonce's first hex token or two
        assert cached[0] <= 2 and all(x >= 64 for x in cached[1:])
        chat = next(c for c in arm["cells"] if c["phase"] == "multiturn")["metrics"]  # through the chat endpoint
        # turn 1: at most the chat template's opening tokens; turn 2: turn 1's prompt up to where the template
        # renders the reply otherwise than it opened the answer
        first, second = chat["turn_cached_tokens"]
        assert first < 8 and chat["turn_prompt_tokens"][0] * 0.8 < second < chat["turn_prompt_tokens"][1]
    md = (out / "run.md").read_text()
    assert "offered -&gt; achieved: 4 -&gt;" in md and "highest rate with SLO attainment &gt;= 90%" in md
    assert (
        "/ prefix: a group&#x27;s first request TTFT" in md
        and "/ multiturn (median TTFT over the chats): turn 1:" in md
    )


def test_the_vllm_export_lists_every_timed_cell(run):
    _, out, _, _ = run
    results = json.loads((out / "run.vllm.json").read_text())
    phases = {(r["harness"]["arm"], r["harness"]["phase"]) for r in results}
    assert {("hand", "decode"), ("engine-serial", "rate-4"), ("hand", "prefix")} <= phases
    rate = next(r for r in results if r["harness"]["phase"] == "rate-4")
    assert rate["request_rate"] == 4.0 and rate["num_prompts"] == 6 and rate["completed"] == 6


def test_the_chat_cell_and_its_probe_and_the_staggered_cell(run):
    _, out, _, _ = run
    record = json.loads((out / "run.json").read_text())
    model = record["models"][0]
    chat_probe = model["parity"]["chat"]
    assert chat_probe["reference"] == "engine-serial" and set(chat_probe["verdicts"]) == {"engine-serial", "hand"}
    serial, hand = chat_probe["verdicts"]["engine-serial"], chat_probe["verdicts"]["hand"]
    assert serial["match"] and serial["same_prompt_tokens"] and serial["prompt_tokens"] > 20
    assert hand["match"] is None and hand["compared"].startswith("not compared")  # its chats open with the run nonce
    assert model["parity"]["verdicts"]["hand"]["match"]  # the probe is the frozen one on every arm
    for arm in model["arms"]:
        phases = [c["phase"] for c in arm["cells"]]
        assert phases.index("chat") == phases.index("decode") + 1 and phases[-1] == "staggered"
        chat = next(c for c in arm["cells"] if c["phase"] == "chat")
        assert chat["status"] == "measured" and chat["metrics"]["completed"] == 2
        assert all(r["output_tokens"] == 8 for r in chat["attempts"][0]["requests"])
        staggered = next(c for c in arm["cells"] if c["phase"] == "staggered")
        sent = [r["sent_at"] for r in staggered["attempts"][0]["requests"]]
        assert sent[1] - sent[0] >= 0.45  # the second arrived a stagger after the first
        assert staggered["metrics"]["median_prefill_tps"] > 0
        cold = next(c for c in arm["cells"] if c["phase"] == "cold")
        assert cold["metrics"]["median_prefill_tps"] > 0
    md = (out / "run.md").read_text()
    assert "/ chat probe (first chat reply and prompt tokens against engine-serial): engine-serial: same" in md
    assert "/ staggered: prefill " in md and "prompt tok/s (median over 2)" in md and ", ITL p50 " in md
