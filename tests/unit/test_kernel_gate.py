"""The fast tier's numerics gate against the float32 reference (CPU: the fast tier there is the chunked delta
rule and the compiled decode steps; the GEMV kernel's stand-in shows the gate can fail)."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from tf32 import rerun_without_tf32

from engine.kernels import FAST, KernelConfig
from engine.kernels.quantized_gemv import Fusion
from engine.loading import load_model
from harness.cli import main as harness_main
from harness.kernels.float_reference import Float32Linear, dequantize_f32, forward_logits, reference_logits, to_float32
from harness.kernels.gate import Prefilled, TierScore, decode, forced, gate_prompts, greedy, run_gate, score

FAST_ANYWHERE = KernelConfig(FAST, force=True)
FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen35", "tiny-gemma3")


@pytest.mark.parametrize("dtype", ["f32", "bf16", "4bit"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fast_tier_passes_the_gate_on_every_tiny_family(tiny_path, family, dtype):
    gate = run_gate(tiny_path(f"{family}-{dtype}"), rows=1, fast=FAST_ANYWHERE)
    assert gate.fast_kernels["tier"] == FAST and gate.exact.positions == gate.fast.positions == 4 * 64
    assert gate.passed, gate.as_record()


def test_batched_rows_pass_the_gate_each_against_its_own_reference(tiny_path):
    gate = run_gate(tiny_path("tiny-qwen35-4bit"), rows=3, fast=FAST_ANYWHERE)
    assert [(p.prompt_len, p.seed) for p in gate.prompts] == [(1, 0), (7, 0), (300, 0), (2100, 0), (1, 1), (7, 1)]
    assert gate.passed, gate.as_record()


def _scaled_launch(x, layers, **stages):
    # A GEMV whose scales are off by 2^-6: every product 1.6% too large, as a kernel with a wrong constant
    # would give. Stages are not taken (no launch asks for them off CUDA below the kernel's minimum rows).
    assert not stages
    return tuple(
        mx.quantized_matmul(
            x, q["weight"], q["scales"] * (1 + 2**-6), q["biases"], transpose=True, group_size=q.group_size, bits=q.bits
        )
        for q in layers
    )


def test_a_perturbed_kernel_fails_the_gate(tiny_path):
    perturbed = KernelConfig(FAST, force=True, gemv_stand_in=_scaled_launch, fusion=Fusion(), gemv_min_outputs=0)
    gate = run_gate(tiny_path("tiny-qwen3-4bit"), rows=1, lengths=(7, 300), fast=perturbed)
    assert not gate.passed and not gate.kl_passed
    assert gate.fast.mean_kl > 2 * gate.exact.mean_kl


def test_scores_measure_against_the_reference():
    ref = mx.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    same = score(ref, ref)
    assert same.mean_kl == pytest.approx(0, abs=1e-7) and same.top1_agreement == 1 and same.max_abs_logit_diff == 0
    shifted = score(ref, ref + 5.0)  # a constant shift is the same distribution
    assert shifted.mean_kl == pytest.approx(0, abs=1e-6) and shifted.max_abs_logit_diff == 5
    flipped = score(ref, mx.array([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]]))
    assert flipped.top1_agreement == 0.5 and flipped.mean_kl > 0 and flipped.positions == 2
    pooled = TierScore.pooled([TierScore(1.0, 2.0, 0.5, 3.0, 2), TierScore(4.0, 5.0, 1.0, 1.0, 1)])
    assert pooled == TierScore(2.0, 5.0, 2 / 3, 3.0, 3)


def test_gate_prompts_fill_whole_batches():
    assert gate_prompts(1, 100) == [(1, 0), (7, 0), (300, 0), (2100, 0)]
    assert gate_prompts(8, 100) == [(n, s) for s in (0, 1) for n in (1, 7, 300, 2100)]
    assert len(gate_prompts(3, 100)) == 6 and len(gate_prompts(32, 100)) == 32


def test_the_reference_is_the_model_in_float32(tiny_path):
    path = tiny_path("tiny-qwen3-4bit")
    model, _ = load_model(path)
    to_float32(model)
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    wrapped = [m for _, m in model.named_modules() if isinstance(m, Float32Linear)]
    assert norms and wrapped and all(m.weight.dtype == mx.float32 for m in norms)
    q = wrapped[0].layer
    x = mx.random.normal((2, q["weight"].shape[1] * 32 // q.bits))
    want = (
        x
        @ mx.dequantize(
            q["weight"],
            q["scales"].astype(mx.float32),
            q["biases"].astype(mx.float32),
            group_size=q.group_size,
            bits=q.bits,
        ).T
    )
    assert wrapped[0](x.astype(mx.bfloat16)).dtype == mx.float32
    assert mx.allclose(wrapped[0](x), want, atol=1e-5).item()
    logits = forward_logits(model, list(range(5, 25)), 10, 6)  # the positions predicting tokens 10..15
    assert logits.shape[0] == 6 and logits.dtype == mx.float32


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_the_reference_dequantizes_as_mlx_does_in_float32(bits, group):
    layer = nn.Linear(256, 40)
    layer.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
    want = mx.dequantize(
        q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32), group_size=group, bits=bits
    )
    assert mx.array_equal(dequantize_f32(q.weight, q.scales, q.biases, group, bits), want).item()


def test_a_float32_model_is_its_own_reference(tiny_path):
    # An f32 artifact runs the exact tier in float32 already: the reference differs by summation order only.
    if rerun_without_tf32(__file__, "test_a_float32_model_is_its_own_reference"):
        return  # under TF32 (CUDA) this process's float32 forward is the less exact side: 0.066 apart on an H200
    path = tiny_path("tiny-llama-f32")
    model, _ = load_model(path)
    seq = list(range(3, 40))
    want = model(mx.array([seq]))[0, 19:29]
    (got,) = reference_logits(path, [seq], [20], 10)
    # measured: equal on the CPU; on an H200 without TF32 1.8e-4 apart, 9e-7 of the largest |logit| (196)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_the_child_process_computes_the_same_reference(tiny_path):
    # On CUDA the reference runs in a child started without TF32; here both ways run on the CPU.
    path = tiny_path("tiny-qwen35-4bit")
    seqs, starts = [list(range(3, 30)), list(range(9, 20))], [20, 5]
    here = reference_logits(path, seqs, starts, 4)
    child = reference_logits(path, seqs, starts, 4, child=True)
    assert all(mx.array_equal(a, b).item() for a, b in zip(here, child))


def test_the_reference_is_a_file_a_sequence_read_when_used(tiny_path, tmp_path):
    # A long gate's references (1 GB a sequence on qwen27b at 1,024 steps) stay on disk until scored.
    from harness.kernels.float_reference import load_reference, reference_files

    path = tiny_path("tiny-qwen35-4bit")
    seqs, starts = [list(range(3, 30)), list(range(9, 20))], [20, 5]
    files = reference_files(path, seqs, starts, 4, tmp_path, child=False)
    assert files == [tmp_path / "r0.safetensors", tmp_path / "r1.safetensors"] and all(f.exists() for f in files)
    for f, got in zip(files, reference_logits(path, seqs, starts, 4)):
        assert mx.array_equal(load_reference(f), got).item()


def test_the_command_writes_the_gate_record_and_exits_by_its_verdict(tiny_path, tmp_path, capsys):
    # the command's wiring, without the greedy part (test_greedy_gate.py runs that small; the full one is slow)
    tiny_path("tiny-qwen3")
    out = tmp_path / "gate.json"
    rc = harness_main(
        [
            "kernels",
            "--gate-model",
            "tiny-qwen3",
            "--gate-steps",
            "4",
            "--gate-rows",
            "1,2",
            "--force",
            "--gate-greedy",
            "",
            "--json",
            str(out),
        ]
    )
    record = json.loads(out.read_text())["gate"]
    assert rc == (0 if record["passed"] else 1) and record["model"] == "tiny-qwen3"
    assert [r["rows"] for r in record["results"]] == [1, 2] and record["results"][0]["fast"]["positions"] == 16
    assert "each tier against the float32 reference" in capsys.readouterr().out


@pytest.mark.slow
def test_the_full_gate_with_the_greedy_part_over_every_trained_model(tiny_path, tmp_path):
    """`harness kernels --gate-model tiny-qwen3` as documented: the greedy part decodes every committed trained
    model (about 19 minutes on 2 cores)."""
    tiny_path("tiny-qwen3")
    out = tmp_path / "gate.json"
    rc = harness_main(["kernels", "--gate-model", "tiny-qwen3", "--gate-rows", "1,2", "--force", "--json", str(out)])
    gate = json.loads(out.read_text())["gate"]
    assert rc == (0 if gate["passed"] else 1) and gate["greedy"]


def test_sequences_of_one_length_share_a_reference_forward(tiny_path, monkeypatch):
    # Batched by length and start (here two at a time), each row's reference is its own forward's.
    from harness.kernels import float_reference

    path = tiny_path("tiny-qwen35-4bit")
    seqs = [list(range(3 + i, 30 + i)) for i in range(3)] + [list(range(9, 20))]
    starts = [20, 20, 20, 5]
    monkeypatch.setattr(float_reference, "BATCH_TOKENS", 2 * 27)
    assert float_reference.batches(seqs, starts) == [[0, 1], [2], [3]]
    batched = float_reference.reference_logits(path, seqs, starts, 4, child=False)
    model, _ = load_model(path)
    to_float32(model)
    for seq, start, got in zip(seqs, starts, batched):
        want = forward_logits(model, seq, start, 4)
        assert got.shape == want.shape
        # measured: equal on the CPU
        assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_forced_runs_from_kept_prefills_give_the_same_logits(tiny_path):
    # The exact tier's prompts prefilled once for its greedy run serve its forced runs at many rows: each use
    # decodes on a copy, the same logits as prompts prefilled anew, bit for bit, and a second use as the first.
    model, _ = load_model(tiny_path("tiny-qwen35-4bit"))
    prompts = [list(range(3, 30)), list(range(9, 20))]
    starts = [Prefilled.of(model, p) for p in prompts]
    tokens = [greedy(model, p, 5, s.copy())[0] for p, s in zip(prompts, starts)]
    assert tokens[0] == greedy(model, prompts[0], 5)[0]
    anew = forced(model, prompts, tokens)
    for _ in range(2):
        kept = forced(model, prompts, tokens, [s.copy() for s in starts])
        assert all(mx.array_equal(a, b).item() for a, b in zip(anew, kept))


def test_a_greedy_batch_is_its_rows_forced_run(tiny_path):
    # The gate takes the exact tier's greedy batch at the widest row count as that count's forced run: the rows'
    # own greedy tokens fed back give the same logits, bit for bit.
    model, _ = load_model(tiny_path("tiny-qwen35-4bit"))
    prompts = [list(range(3, 30)), list(range(9, 20)), list(range(40, 47))]
    chosen, logits = decode(model, prompts, 5)
    assert all(mx.array_equal(a, b).item() for a, b in zip(logits, forced(model, prompts, chosen)))
