"""An engine arm's held-out perplexity is scored once its server has stopped, in a child process: on one GPU the
server's memory and a second copy of the model in the harness do not both fit (qwen27b on an 80 GB card ran out
of memory there), and what the score took must not stay in the harness while the next arm's server runs."""

import os
from pathlib import Path

from harness.gates.quality import held_out_score
from harness.run import runner as runner_module
from harness.run.arms import standard_arms
from harness.run.records import MEASURED
from harness.run.runner import Block, Runner, RunSettings
from harness.run.workloads import WorkloadSettings

SETTINGS = RunSettings(
    tokens=4,
    decode_samples=1,
    quality_tokens=16,
    workload=WorkloadSettings(
        cold_prompt_tokens=32, decode_prompt_tokens=16, concurrent_prompt_tokens=16, concurrency=(2,)
    ),
)


class StandIn:
    """A started server, as far as the runner's arm loop sees one: it records when it is stopped."""

    def __init__(self, events: list[str]):
        self.events, self.load_to_ready_s, self.stderr_path = events, 0.0, Path(os.devnull)

    def stop(self, grace_s: float = 20) -> None:
        self.events.append("stop")


def test_the_score_follows_the_servers_stop_and_runs_in_a_child(tiny_path, tmp_path, monkeypatch):
    model = tiny_path("tiny-qwen3")
    events: list[str] = []
    monkeypatch.setattr(runner_module, "start_server", lambda *a, **k: StandIn(events))

    def measure(self, mrun, arm, spec, server, workload, phases):
        arm.kernels = {"tier": "exact"}  # as the server's /stats says

    monkeypatch.setattr(Runner, "_measure", measure)
    runner = Runner(
        SETTINGS,
        tmp_path / "run.json",
        tmp_path / "runs.sqlite",
        log=lambda m: None,
        on_phase=lambda phase: events.append("score" if phase.endswith("held-out perplexity") else phase),
    )
    record = runner.run([("tiny-qwen3", model)], [Block(0, (standard_arms()["engine"],))])
    arm = record.models[0].arms[0]
    assert arm.status == MEASURED
    assert events == ["stop", "score", "stop"]  # the arm's end stops it again: a no-op
    assert arm.quality == held_out_score(model, "exact", 16)  # the child's score is the in-process one


def test_a_score_that_fails_in_the_child_is_its_last_error_line(tmp_path):
    got = runner_module._score_apart(tmp_path / "no-model", "exact", 16)
    assert set(got) == {"error"} and "no-model" in got["error"], got
