"""The kinds of cell (harness/run/cells.py): one record a kind, found by its phase, read by the run's sending, the
verdict tables and the report."""

from dataclasses import asdict
from types import SimpleNamespace

from harness.cli import build_parser
from harness.run import cells
from harness.run.arrivals import offsets
from harness.run.cli import _run_plan
from harness.run.headline import RATIO_METRICS
from harness.run.runner import RunSettings
from harness.run.workloads import WorkloadSettings, phase_names


def test_every_phase_finds_its_kind():
    assert cells.kind_of("concurrency-8") is cells.CONCURRENCY
    assert cells.kind_of("rate-0.5") is cells.RATE
    assert cells.kind_of("staggered") is cells.STAGGERED
    assert cells.kind_of("concurrency") is None  # a family's prefix needs its level
    assert cells.kind_of("unknown") is None
    assert len({k.name for k in cells.KINDS}) == len(cells.KINDS)


def test_untimed_cells_are_the_warmup_and_the_probe():
    assert [k.name for k in cells.KINDS if not k.timed] == ["warmup", "probe"]
    assert cells.timed("decode") and cells.timed("an old phase")


def test_the_verdict_rows_come_from_the_kinds_in_order():
    rows = [(m.prefix, m.key) for m in RATIO_METRICS]
    assert rows == [
        ("decode", "median_decode_tps"),
        ("chat", "median_decode_tps"),
        ("cold", "median_ttft_ms"),
        ("cold", "median_prefill_tps"),
        ("warm", "median_ttft_ms"),
        ("long", "median_ttft_ms"),
        ("concurrency-", "output_throughput"),
        ("prefix", "median_ttft_ms"),
        ("multiturn", "median_ttft_ms"),
        ("staggered", "median_ttft_ms"),
        ("staggered", "median_prefill_tps"),
        ("rate-", "output_throughput"),
    ]
    assert RATIO_METRICS[6].matches("concurrency-4") and not RATIO_METRICS[6].matches("rate-4")


def test_open_loop_kinds_say_when_their_requests_arrive():
    settings = SimpleNamespace(stagger_s=2.0, burstiness=1.0, max_concurrency=3, workload=SimpleNamespace(seed=7))
    assert cells.STAGGERED.arrivals("staggered", 3, settings) == ([0.0, 2.0, 4.0], None)
    assert cells.RATE.arrivals("rate-4", 5, settings) == (offsets(4.0, 5, 1.0, 7), 3)
    assert {k.name for k in cells.KINDS if k.send == cells.OPEN_LOOP} == {"staggered", "rate-"}


def test_load_cells_repeat_and_rate_cells_are_trimmed():
    assert {k.name for k in cells.KINDS if k.repeated} == {"concurrency-", "rate-"}
    assert [k.name for k in cells.KINDS if k.trimmed] == ["rate-"]
    assert {k.name for k in cells.KINDS if k.prefill_rate} == {"cold", "long", "staggered"}
    assert {k.name for k in cells.KINDS if k.chat} == {"chat", "multiturn"}


def test_a_kind_declares_its_options_its_phases_and_its_prompts():
    assert [(o.flag, o.dest, o.scope) for o in cells.STAGGERED.options] == [
        ("--staggered", "staggered", cells.WORKLOAD),
        ("--staggered-tokens", "staggered_tokens", cells.WORKLOAD),
        ("--stagger", "stagger_s", cells.RUN),
    ]
    args = build_parser().parse_args(["run", "all", "--arms", "engine", "--staggered", "3", "--stagger", "0.5"])
    _, settings, _ = _run_plan(args)
    assert (settings.stagger_s, settings.workload.staggered, settings.workload.staggered_tokens) == (0.5, 3, 2048)
    saved = asdict(settings)  # the run's JSON keeps one flat key an option
    assert saved["stagger_s"] == 0.5
    assert (saved["workload"]["staggered"], saved["workload"]["staggered_tokens"]) == (3, 2048)
    assert (RunSettings().stagger_s, WorkloadSettings().staggered) == (2.0, 0)
    load = WorkloadSettings(staggered=2, staggered_tokens=5, rates=(1.0,), context_tokens=64)
    assert phase_names(load)[-3:] == ["rate-1", "staggered", "long"]  # after the other kinds' cells, before long
    assert phase_names(WorkloadSettings()) == phase_names(WorkloadSettings(staggered_tokens=5))
    asked = cells.STAGGERED.prompts(lambda *request: request, load, 1)  # (phase, attempt, index, length)
    assert asked == [("staggered", 1, 0, 5), ("staggered", 1, 1, 5)]
