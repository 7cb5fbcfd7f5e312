"""The gate's greedy agreement on trained models (harness.kernels.greedy_gate): the fast tier, off CUDA the chunked delta
rule and compiled steps with a GEMV stand-in, against the exact tier's greedy paths from held-out text."""

import argparse
import json
from functools import partial

import mlx.core as mx

from engine import env
from engine.kernels import FAST, KernelConfig
from engine.kernels.quantized_gemv import Fusion
from harness.cli import main as harness_main
from harness.kernels.greedy_gate import GreedyResult, agreed_steps, run_greedy_gate, text_prompts

DRAFT = env.trained_dir() / "trained-qwen3-draft-4bit"


def _short_launch(x, layers, **stages):
    # A GEMV that leaves the last group of 64 inputs out of every sum: a kernel with a wrong k-tail.
    x = mx.concatenate([x[..., :-64], mx.zeros_like(x[..., -64:])], axis=-1)
    return tuple(
        mx.quantized_matmul(
            x, q["weight"], q["scales"], q["biases"], transpose=True, group_size=q.group_size, bits=q.bits
        )
        for q in layers
    )


def test_agreed_steps_count_the_steps_whose_greedy_token_is_the_paths():
    logits = mx.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert agreed_steps([1, 0, 2], logits) == 3
    assert agreed_steps([1, 1, 2], logits) == 2


def test_prompts_are_consecutive_held_out_slices():
    from engine.engine import Engine

    tok = Engine.load(None, DRAFT, kernels="exact").tokenizer
    prompts = text_prompts(tok, 5, lengths=(3, 4))
    assert [len(p) for p in prompts] == [3, 4, 3, 4, 3]
    joined = [t for p in prompts for t in p]
    assert joined == text_prompts(tok, 1, lengths=(17,))[0]


def test_a_right_fast_tier_keeps_the_exact_greedy_path():
    results = run_greedy_gate(
        "trained-qwen3-draft-4bit",
        DRAFT,
        rows=(1, 3),
        steps=16,
        paths=4,
        lengths=(16, 32),
        fast=KernelConfig(FAST, force=True),
    )
    assert [(r.rows, len(r.agreed)) for r in results] == [(1, 4), (3, 6)]
    assert all(r.mean == 16 for r in results), results  # off CUDA the fast tier's products are MLX's
    assert all(r.passed and r.fast_tier == FAST for r in results), results


def test_a_perturbed_kernel_parts_from_it():
    perturbed = KernelConfig(FAST, force=True, gemv_stand_in=_short_launch, fusion=Fusion(), gemv_min_outputs=0)
    (result,) = run_greedy_gate("trained-qwen3-draft-4bit", DRAFT, rows=(1,), paths=8, lengths=(16, 32), fast=perturbed)
    assert not result.passed and result.mean < 48, result


def test_the_bound_scales_with_the_steps():
    assert GreedyResult("m", 1, 16, (15, 15), "fast").passed
    assert not GreedyResult("m", 1, 16, (14, 14), "fast").passed


def test_the_gate_cli_adds_the_greedy_table_and_refuses_untrained_models(tiny_path, tmp_path, capsys, monkeypatch):
    import harness.kernels.greedy_gate as greedy_gate

    monkeypatch.setattr(greedy_gate, "run_greedy_gate", partial(run_greedy_gate, paths=2, lengths=(16,)))
    tiny_path("tiny-qwen3-4bit")
    out = tmp_path / "gate.json"
    code = harness_main(
        [
            "kernels",
            "--gate-model",
            "tiny-qwen3-4bit",
            "--gate-steps",
            "8",
            "--force",
            "--gate-greedy",
            "trained-qwen3-draft-4bit",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())["gate"]
    assert [g["model"] for g in record["greedy"]] == ["trained-qwen3-draft-4bit"] and record["passed"]
    assert "greedy agreement on trained models" in capsys.readouterr().out
    assert harness_main(["kernels", "--gate-model", "tiny-qwen3-4bit", "--gate-greedy", "tiny-qwen3"]) == 2
    assert "takes trained models" in capsys.readouterr().err


def test_an_empty_gate_greedy_list_means_no_greedy_part():
    from harness.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["kernels", "--gate-model", "qwen27b", "--gate-greedy", ""]).gate_greedy == []
    assert parse(["kernels", "--gate-model", "qwen27b", "--gate-greedy", "a,b"]).gate_greedy == ["a", "b"]
    assert parse(["kernels", "--gate-model", "qwen27b"]).gate_greedy is None


def test_the_gate_says_when_no_trained_model_is_there_for_the_greedy_part(capsys, monkeypatch):
    import harness.kernels.cli as kernels_cli

    monkeypatch.setattr(kernels_cli, "is_cached", lambda name: False)
    args = argparse.Namespace(gate_greedy=None, gate_rows=(1,), gate_steps=8)
    assert kernels_cli._greedy_gate(args, fast=None) == []
    assert "greedy agreement: not run" in capsys.readouterr().out
