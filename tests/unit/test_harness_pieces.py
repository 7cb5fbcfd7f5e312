"""Small harness pieces: the machine-load verdict and the vLLM-named metrics."""

from collections import namedtuple

from harness.run import preflight
from harness.run.client import RequestRecord
from harness.run.metrics import summarize

Mem = namedtuple("Mem", "total available")
Swap = namedtuple("Swap", "used")


def test_preflight_names_every_problem(monkeypatch):
    monkeypatch.setattr(preflight, "_own_cpu_percent", lambda interval_s: (80.0, 10.0))
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: Mem(16 << 30, 1 << 30))
    monkeypatch.setattr(preflight.psutil, "swap_memory", lambda: Swap(2 << 30))
    p = preflight.check(interval_s=0)
    assert not p.ok and p.other_cpu_percent == 70.0 and len(p.problems) == 3
    assert "70%" in p.problems[0] and "GiB" in p.problems[1] and "swap" in p.problems[2]


def test_a_quiet_machine_passes(monkeypatch):
    monkeypatch.setattr(preflight, "_own_cpu_percent", lambda interval_s: (12.0, 10.0))
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: Mem(16 << 30, 12 << 30))
    monkeypatch.setattr(preflight.psutil, "swap_memory", lambda: Swap(0))
    assert preflight.check(interval_s=0).ok


def record(ttft, e2el, tokens, events):
    r = RequestRecord(
        "decode",
        0,
        0,
        10,
        ok=True,
        ttft_ms=ttft,
        e2el_ms=e2el,
        output_tokens=tokens,
        prompt_tokens=10,
        event_ms=events,
        finish_reason="length",
    )
    return r


def test_metrics_follow_the_vllm_definitions():
    reqs = [
        record(100.0, 1000.0, 10, [100.0 + 100 * i for i in range(10)]),
        record(200.0, 2000.0, 10, [200.0 + 200 * i for i in range(10)]),
    ]
    m = summarize(reqs, wall_s=2.0, slo_ms={"ttft": 150.0})
    assert m["median_ttft_ms"] == 150.0 and m["p99_ttft_ms"] > 190
    assert m["mean_tpot_ms"] == (900 / 9 + 1800 / 9) / 2  # (E2EL - TTFT) / (tokens - 1)
    assert m["median_itl_ms"] == 150.0 and m["output_throughput"] == 10.0  # 20 tokens / 2 s
    assert m["total_token_throughput"] == 20.0 and m["request_goodput"] == 0.5  # one request meets the SLO
    assert m["slo_attainment"] == 0.5 and summarize(reqs, wall_s=2.0)["slo_attainment"] is None
    assert m["decode_tps_samples"] == [10.0, 5.0] and m["median_decode_tps"] == 7.5


def test_an_slo_on_an_unknown_metric_is_refused():
    import pytest

    with pytest.raises(ValueError, match="not itl"):
        summarize([], wall_s=1.0, slo_ms={"itl": 5.0})


def test_goodput_slos_parse_and_a_bad_one_is_refused(capsys):
    import pytest

    from harness.cli import build_parser

    args = build_parser().parse_args(["run", "all", "--goodput", "ttft:2000", "e2el:9000.5"])
    assert args.goodput == [("ttft", 2000.0), ("e2el", 9000.5)]
    for bad in ("itl:5", "ttft:0", "ttft"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "all", "--goodput", bad])
        assert "give METRIC:MS" in capsys.readouterr().err


def test_the_source_tree_hash_leaves_out_a_runs_own_outputs(monkeypatch, tmp_path):
    # A run writing its record over a tracked file (reports/cpu-small-qwen3.json) must not find its tree changed.
    from pathlib import Path

    from harness.run import provenance

    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "run.json").write_text("{}")
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    monkeypatch.setattr(provenance, "_run", lambda cmd: "code.py\nrun.json")
    outputs = [tmp_path / "run.json"]
    start = provenance.source_tree_sha256(outputs)
    (tmp_path / "run.json").write_text('{"written": "during the run"}')
    assert provenance.source_tree_sha256(outputs) == start != provenance.source_tree_sha256()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.source_tree_sha256(outputs) != start and isinstance(Path(outputs[0]), Path)
