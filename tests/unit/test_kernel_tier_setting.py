"""The kernel tier as a setting: CLI flags, Engine.load, the harness arms and records that name it."""

import json

import pytest

from engine.cli import build_parser
from engine.cli import main as engine_main
from engine.engine import Engine, kernels_notice
from engine.kernels import AUTO, EXACT, FAST, KernelSet, on_cuda
from harness.cli import main as harness_main
from harness.report.db_export import export_run
from harness.run.arms import standard_arms
from harness.run.records import ArmRun, ModelRun, db_arm, open_db
from harness.run.summary import rows

MODEL = "tiny-qwen3"
RAN = FAST if on_cuda() else EXACT  # what asking for the fast tier gives on this machine


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def make_arm_record(name: str = "engine-fast", kernels=None) -> dict:
    return {
        "arm": name,
        "status": "measured",
        "cells": [],
        "peak_rss_bytes": None,
        "load_to_ready_s": 1.0,
        "kernels": kernels,
    }


def make_run(*arms: dict) -> dict:
    model = {"model": MODEL, "model_dir": "/nonexistent", "block": 0, "parity": {}, "arms": list(arms)}
    return {"provenance": {}, "models": [model]}


# ------------------------------------------------------------------- CLI


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_kernels_flag_defaults_to_auto_and_takes_every_tier(command):
    base = [command, "--model", MODEL] + (["--prompt", "x"] if command == "generate" else [])
    assert parse(*base).kernels == AUTO
    assert parse(*base, "--kernels", "fast").kernels == FAST
    assert parse(*base, "--kernels", "exact").kernels == EXACT


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_tier_is_an_argparse_error(command, capsys):
    extra = ["--prompt", "x"] if command == "generate" else []
    with pytest.raises(SystemExit) as e:
        engine_main([command, "--model", MODEL, *extra, "--kernels", "turbo"])
    assert e.value.code == 2
    assert "invalid choice: 'turbo'" in capsys.readouterr().err


def test_force_is_not_a_cli_setting(capsys):
    # install(force=True) exists for tests only; no command line can force the fast tier off CUDA.
    for flag in ("--force", "--kernels-force", "--force-kernels"):
        with pytest.raises(SystemExit) as e:
            engine_main(["serve", "--model", MODEL, "--kernels", "fast", flag])
        assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_serve_help_explains_both_tiers(capsys):
    with pytest.raises(SystemExit):
        engine_main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "bit-exact with mlx-lm" in text and "CUDA" in text and "reason is printed" in text


def test_generate_names_the_tier_that_ran(capsys, tiny_path):
    tiny_path(MODEL)
    assert engine_main(["generate", "--model", MODEL, "--prompt", "Hi", "--max-tokens", "3", "--kernels", "fast"]) == 0
    err = capsys.readouterr().err
    assert f"kernels {RAN}," in err.splitlines()[-1]
    assert ("kernels: fast requested, running exact" in err) == (RAN == EXACT)


# ---------------------------------------------------------------- Engine


def test_engine_load_fast_off_cuda_keeps_exact_with_the_reason(tiny_path):
    eng = Engine.load(model_path=tiny_path("tiny-qwen35"), kernels="fast")
    assert (eng.kernels.tier, eng.kernels.requested) == (RAN, FAST)
    if RAN == EXACT:
        assert "CUDA" in eng.kernels.reason and eng.kernels.chunked_delta_layers == 0
        assert kernels_notice(eng.kernels).startswith("kernels: fast requested, running exact: ")
    assert list(eng.generate([1, 2, 3], max_tokens=2, ignore_eos=True))  # it still generates


def test_engine_load_defaults_to_auto(tiny_path):
    kernels = Engine.load(model_path=tiny_path(MODEL), with_tokenizer=False).kernels
    assert kernels.requested == AUTO and kernels.tier in (EXACT, FAST) and kernels.reason.startswith("auto: ")
    assert kernels_notice(kernels) == f"kernels: {kernels.reason}"
    assert kernels_notice(KernelSet(EXACT, EXACT)) is None


def test_auto_runs_the_fast_tier_only_for_families_whose_gate_passed():
    from engine.kernels import GATE_PASSED, KernelConfig, resolve_tier

    anywhere = KernelConfig(AUTO, force=True)  # as on CUDA
    passed = {"qwen3_5": "qwen27b at 1 and 8 rows"}
    assert resolve_tier(anywhere, "qwen3_5", passed) == (
        FAST,
        "auto: fast, its numerics gate passed for qwen3_5 (qwen27b at 1 and 8 rows)",
    )
    tier, reason = resolve_tier(anywhere, "llama", passed)
    assert tier == EXACT and "no fast-tier numerics gate has passed for llama" in reason
    if not on_cuda():
        tier, reason = resolve_tier(KernelConfig(AUTO), "qwen3_5", passed)
        assert tier == EXACT and reason.startswith("auto: exact, the fast tier needs MLX's CUDA backend")
    assert resolve_tier(KernelConfig(EXACT), "qwen3_5", passed) == (EXACT, "")
    assert all(isinstance(v, str) and v for v in GATE_PASSED.values())  # each names the run that shows it


def test_an_unknown_tier_is_refused_before_loading():
    with pytest.raises(ValueError, match="unknown kernel tier 'turbo'"):
        Engine.load("no-such-model", kernels="turbo")  # the tier is checked first: no UnknownModelError


# --------------------------------------------------------------- harness


def test_native_records_the_engine_tier(tmp_path, tiny_path, capsys):
    tiny_path(MODEL)
    out = tmp_path / "native.json"
    rc = harness_main(
        [
            "native",
            "--models",
            MODEL,
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "3",
            "--samples",
            "1",
            "--warmup",
            "0",
            "--kernels",
            "fast",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    (rec,) = json.loads(out.read_text())
    assert rec["kernels"]["tier"] == RAN and rec["kernels"]["requested"] == FAST
    assert set(rec["kernels"]) == {
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
    assert "kernels" in capsys.readouterr().out  # the table's column
    assert set(rec["machine"]) == {"before", "after"}  # the host's load around the samples
    assert all(snap["cpu_count"] > 0 and isinstance(snap["problems"], list) for snap in rec["machine"].values())
    for arm in ("engine", "mlx_lm"):  # each sample's median and slowest gap between tokens
        median, slowest = rec[arm]["samples_median_step_ms"], rec[arm]["samples_slowest_step_ms"]
        assert len(median) == len(slowest) == 1 and 0 < median[0] <= slowest[0]


def test_native_rejects_a_bad_tier():
    with pytest.raises(SystemExit) as e:
        harness_main(["native", "--models", MODEL, "--kernels", "turbo"])
    assert e.value.code == 2


def test_native_needs_two_decode_tokens_for_a_rate():
    with pytest.raises(SystemExit) as e:
        harness_main(["native", "--models", MODEL, "--decode-tokens", "1"])
    assert e.value.code == 2


def test_the_engine_arms_include_one_per_tier():
    arms = standard_arms()
    for tier in (EXACT, FAST):
        arm = arms[f"engine-{tier}"]
        cmd = arm.command("/m", 1234)
        assert cmd[cmd.index("--kernels") + 1] == tier and arm.is_engine and arm.returns_token_ids
    assert "--kernels" not in arms["engine"].command("/m", 1234) and arms["engine"].is_engine
    assert not arms["mlx-lm"].is_engine
    spec = arms["engine-spec"].command("/m", 1234)
    assert spec[spec.index("--draft-kind") + 1] == "ngram" and "--spec-batch" in spec


def test_arm_args_append_server_options_to_one_arm():
    from harness.run.arms import parse_arm_options, resolve_arms

    options = parse_arm_options(["engine=--batch 64 --prefill-chunk '512'"])
    assert options == {"engine": ["--batch", "64", "--prefill-chunk", "512"]}
    engine, serial = resolve_arms(["engine", "engine-serial"], options=options)
    assert engine.command("/m", 1234)[-4:] == ["--batch", "64", "--prefill-chunk", "512"]
    assert serial.command("/m", 1234) == standard_arms()["engine-serial"].command("/m", 1234)
    for bad, match in (
        (["engine"], "ARM=OPTIONS"),
        (["=--batch 2"], "ARM=OPTIONS"),
        (["engine=--batch 2", "engine=--batch 3"], "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_arm_options(bad)
    with pytest.raises(ValueError, match="does not run"):
        resolve_arms(["engine"], options={"mlx-lm": ["--x"]})


def test_run_all_takes_arm_args_in_its_plan(capsys):
    assert (
        harness_main(
            ["run", "all", "--models", MODEL, "--arms", "engine", "--arm-args", "engine=--batch 64", "--dry-run"]
        )
        == 0
    )
    assert "--batch 64" in capsys.readouterr().out


def test_the_arm_record_keeps_the_reported_kernels_through_the_database(tmp_path):
    db = open_db(tmp_path / "runs.sqlite")
    reported = KernelSet(EXACT, FAST, reason="the fast tier needs MLX's CUDA backend").as_record()
    model = ModelRun(MODEL, "/m", "m" * 64, "w" * 64, None)
    db_arm(db, "run1", model, ArmRun("engine-fast", ["engine", "serve"], {}, status="measured", kernels=reported))
    db_arm(db, "run1", model, ArmRun("mlx-lm", ["mlx_lm.server"], {}, status="measured"))
    db["runs"].insert({"run_id": "run1", "kind": "trials"})
    arms = export_run(db, "run1")["models"][0]["arms"]
    assert arms[0]["kernels"] == reported and arms[1]["kernels"] is None


def test_the_summary_shows_the_reported_tier_not_the_arm_name():
    run = make_run(make_arm_record("engine-fast", {"tier": EXACT, "requested": FAST}), make_arm_record("mlx-lm"))
    assert [r["kernels"] for r in rows(run)] == [EXACT, None]


def test_a_probe_that_differs_on_the_fast_tier_is_named_rounding_not_a_failure():
    from harness.run.summary import FAST_TIER_PROBE, Notes, table_cells

    run = make_run(
        make_arm_record("engine", {"tier": FAST, "requested": AUTO}),
        make_arm_record("engine-exact", {"tier": EXACT, "requested": EXACT}),
        make_arm_record("mlx-lm"),
    )
    run["models"][0]["parity"] = {
        "reference": "engine",
        "verdicts": {"engine": {"match": True}, "engine-exact": {"match": False}, "mlx-lm": {"match": False}},
    }
    notes = Notes()
    assert [table_cells(r, [], notes)[-2] for r in rows(run)] == ["same", "differs [1]", "differs [1]"]
    assert notes.lines() == [f"[1] {FAST_TIER_PROBE}"] and "fast tier rounds" in FAST_TIER_PROBE
    run["models"][0]["arms"][0]["kernels"]["tier"] = EXACT  # exact arms that differ: a parity failure
    assert [table_cells(r, [], Notes())[-2] for r in rows(run)][1:] == ["DIFFERS", "DIFFERS"]
