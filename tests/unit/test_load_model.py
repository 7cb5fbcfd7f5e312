"""The benchmark's load model: arrivals, measured windows, saturation, workloads, external arms, the vLLM export."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main as harness_main
from harness.run import arrivals, counters, vllm_export
from harness.run.arms import external_arm, parse_arm_options, resolve_arms
from harness.run.workloads import PREFIX, WorkloadSettings, build, phase_names

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "run_tiny.json"


def test_arrivals_are_frozen_by_their_seed_and_average_the_rate():
    a = arrivals.offsets(4.0, 400, seed=3)
    assert a == arrivals.offsets(4.0, 400, seed=3) and a != arrivals.offsets(4.0, 400, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.25) < 0.03  # 1 / rate
    bursty = np.diff(arrivals.offsets(4.0, 400, burstiness=0.25, seed=3))
    even = np.diff(arrivals.offsets(4.0, 400, burstiness=8.0, seed=3))
    assert even.std() < gaps.std() < bursty.std()  # gamma shape: below 1 burstier, above 1 more even
    with pytest.raises(ValueError):
        arrivals.offsets(math.inf, 4)


def test_a_rate_cell_leaves_its_warm_up_and_cool_down_out():
    assert arrivals.measured(32) == slice(4, 28) and arrivals.measured(10) == slice(1, 9)
    assert arrivals.measured(2) == slice(0, 2)  # too few to leave any out


def test_a_sweep_is_saturated_when_throughput_stops_rising_while_ttft_climbs():
    assert not arrivals.saturated([10.0], [50.0])
    assert not arrivals.saturated([10.0, 19.0], [50.0, 60.0])  # still rising
    assert not arrivals.saturated([10.0, 10.2], [50.0, 70.0])  # flat, but TTFT has not doubled
    assert arrivals.saturated([10.0, 19.0, 19.5], [50.0, 60.0, 400.0])
    assert (
        arrivals.sweep_rates(0.25)[:4] == [0.25, 0.5, 1.0, 2.0] and len(arrivals.sweep_rates()) == arrivals.SWEEP_CELLS
    )


def test_rate_and_shared_prefix_cells_leave_the_other_prompts_as_they_were():
    encode = lambda s: [ord(c) % 500 + 3 for c in s]  # noqa: E731 - a stand-in tokenizer
    plain = build("m", encode, "sha", WorkloadSettings(concurrency=(2,)))
    settings = WorkloadSettings(
        concurrency=(2,), rates=(1.0, 4.0), rate_requests=6, prefix_groups=2, prefix_group_size=3, prefix_tokens=40
    )
    loaded = build("m", encode, "sha", settings)
    assert phase_names(settings)[-3:] == [PREFIX, "rate-1", "rate-4"]
    for phase in plain.phases:
        assert loaded.phases[phase] == plain.phases[phase], phase
    assert [len(p) for p in loaded.prompts("rate-4", 0)] == [128] * 6
    group = loaded.prompts(PREFIX, 0)
    assert len(group) == 6 and group[0][:40] == group[2][:40] != group[3][:40]  # a system prompt a group
    assert group[0] != group[1] and settings.covers(settings) and not plain.settings.covers(settings)


def test_chats_replay_the_same_conversation_on_every_arm():
    encode = lambda s: [ord(c) % 500 + 3 for c in s]  # noqa: E731
    settings = WorkloadSettings(concurrency=(2,), chats=2, turns=3, turn_chars=80)
    w = build("m", encode, "sha", settings)
    turns = w.prompts("multiturn", 0)
    assert [len(t["messages"]) for t in turns] == [2, 4, 6, 2, 4, 6]  # system, then user / canned assistant pairs
    assert turns[2]["messages"][:4] == turns[1]["messages"]  # each turn the conversation so far and a new message
    assert [m["role"] for m in turns[2]["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert turns[0]["messages"][0] != turns[3]["messages"][0]  # a system message a chat
    assert build("m", encode, "sha", settings).phases == w.phases and w.prompts("multiturn", 1) != turns


def test_counters_keep_what_changed_during_a_cell():
    text = (
        '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name="m"} 10.0\n'
        'vllm:prompt_tokens_created{model_name="m"} 1.7e9\n'
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
    )

    class Client:
        def __init__(self, body):
            self.body = body

        def get(self, path):
            return type("R", (), {"status_code": 200, "text": self.body})()

    before = counters.read(Client(text))
    assert before == {
        "vllm:prompt_tokens_total{model_name=m}": 10.0,
        "vllm:time_to_first_token_seconds_count{model_name=m}": 4.0,
        "vllm:time_to_first_token_seconds_sum{model_name=m}": 0.5,
    }
    after = counters.read(Client(text.replace('_total{model_name="m"} 10.0', '_total{model_name="m"} 74.0')))
    assert counters.delta(before, after) == {"vllm:prompt_tokens_total{model_name=m}": 64.0}
    assert counters.delta(None, after) is None


def test_arms_from_urls_and_engine_variants():
    ext = external_arm("vllm=http://127.0.0.1:8000")
    assert ext.url == "http://127.0.0.1:8000" and ext.command(Path("x"), 0) == ["(external)", "http://127.0.0.1:8000"]
    for bad in ("vllm", "vllm=localhost:8000", "mlx-lm=http://h:1", "engine-x=http://h:1"):
        with pytest.raises(ValueError):
            external_arm(bad)
    arms = resolve_arms(
        ["engine", "engine-ngram"], options=parse_arm_options(["engine-ngram=--draft-kind ngram"]), external=[ext]
    )
    assert [a.name for a in arms] == ["engine", "engine-ngram", "vllm"]
    assert arms[1].command(Path("/m"), 9)[-2:] == ["--draft-kind", "ngram"] and arms[1].is_engine
    with pytest.raises(ValueError, match="engine-NAME needs --arm-args"):
        resolve_arms(["engine-ngram"])


def test_a_server_the_harness_did_not_start_is_measured_alone(capsys):
    ext = external_arm("ext=http://127.0.0.1:9")
    assert [a.name for a in resolve_arms([], external=[ext])] == ["ext"]
    assert [a.name for a in resolve_arms(["ext", "engine"], external=[ext])] == ["ext", "engine"]  # --arms places it
    with pytest.raises(ValueError, match="takes no server options"):
        resolve_arms(["ext"], options={"ext": ["--batch", "4"]}, external=[ext])
    for arms in ("", "ext"):
        assert (
            harness_main(
                ["run", "all", "--models", "tiny-qwen3", "--arms", arms, "--arm", "ext=http://127.0.0.1:9", "--dry-run"]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "arms in order ['ext']" in out and "(external) http://127.0.0.1:9" in out
    assert harness_main(["run", "all", "--arms", "", "--dry-run"]) == 2
    assert "no arms" in capsys.readouterr().err


# vLLM 0.31's `vllm bench serve --save-result` keys (vllm/benchmarks/serve.py), the percentiles at their default (99)
VLLM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
}


def test_the_vllm_export_has_vllms_result_keys():
    run = json.loads(FIXTURE.read_text())
    results = vllm_export.export(run)
    phases = [(r["harness"]["arm"], r["harness"]["phase"]) for r in results]
    assert (
        ("engine", "decode") in phases and ("mlx-lm", "concurrency-2") in phases and ("engine", "warmup") not in phases
    )
    for r in results:
        assert set(r) - {"harness"} == VLLM_KEYS
        assert r["completed"] == r["num_prompts"] == len(r["ttfts"]) and all(t < 10 for t in r["ttfts"])  # seconds
    conc = next(r for r in results if r["harness"]["phase"] == "concurrency-2")
    assert conc["request_rate"] == "inf" and conc["max_concurrency"] == 2


@pytest.mark.parametrize(
    "value, message", [("0,2", "finite requests/s above 0"), ("inf", "--concurrency N"), ("sweep:x", "sweep:START")]
)
def test_bad_rates_are_refused(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        harness_main(["run", "all", "--rates", value, "--dry-run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_cell_whose_arrivals_fit_in_one_request_is_a_burst():
    assert arrivals.is_burst([100.0, 100.5, 101.0], median_e2el_ms=1500)  # all in before a request's time
    assert not arrivals.is_burst([100.0, 101.0, 102.0], median_e2el_ms=1500)
    assert not arrivals.is_burst([100.0], median_e2el_ms=1500) and not arrivals.is_burst([1.0, 9.0], None)
