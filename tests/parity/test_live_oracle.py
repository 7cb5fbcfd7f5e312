"""The live oracle gate: our engine against mlx-lm's generate_step, bit for bit.

Every tiny family (dense llama, qwen2, qwen3; hybrid qwen3_5; sliding-window
gemma3) in f32, bf16 and 4-bit, at prompt lengths 1, 7, 300 and 2,100 (past
the 2,048 prefill chunk), 64 decode steps. For gemma3 (window 64) the 300 and
2,100 prompts wrap the rotating cache during prefill and the 7-token prompt
wraps it during decode. Every forward's float32 logits and the final cache
arrays must be identical: max |difference| == 0.
"""

import pytest

from engine.registry import base_names
from harness.gates.parity import ParityCase, cases, run_case

pytestmark = pytest.mark.parity

CASES = cases(base_names("tiny"))


def _check(case):
    r = run_case(case)
    assert r.passed, (
        f"{case.label}: max|diff|={r.max_abs_diff} first differing forward={r.first_diff_step} "
        f"tokens_equal={r.tokens_equal} cache max|diff|={r.cache_max_abs_diff}"
    )
    assert r.compared_steps == case.steps + 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label.replace(" ", "-"))
def test_b1_logits_and_cache_match_mlx_lm(case):
    _check(case)


@pytest.mark.parametrize("model", ["tiny-llama-f32", "tiny-qwen35", "tiny-qwen3-4bit"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_cache_matches_mlx_lm(model, bits):
    # mlx-lm quantizes growing KV caches once they hold quantized_kv_start tokens; start=0 quantizes at once.
    _check(ParityCase(model, 300, 16, kv_bits=bits, kv_group_size=32))


@pytest.mark.parametrize("model", ["tiny-llama-8bit", "tiny-qwen35-4bit-g32", "tiny-gemma3-8bit"])
def test_8bit_and_group_32_weights_match_mlx_lm(model):
    _check(ParityCase(model, 300, 16))
