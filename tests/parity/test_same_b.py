"""The same-B gate: our continuous batcher against mlx-lm's BatchGenerator, bit for bit.

Every tiny family (dense llama/qwen2/qwen3, hybrid qwen3_5, sliding-window
gemma3) in f32, bf16 and 4-bit; B = 2, 3, 4, 8 simultaneous arrivals with
unequal prompt lengths (37, 300, 5, 120, 1, 64, 250, 17: gemma3's window is
64, so several rows wrap), a late join after 6 emitted tokens, a row
retiring while others continue, and a join after a retirement. Every row's
float32 logits at every forward and every generated id must be identical.
"""

import mlx.core as mx
import numpy as np
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.generate import generate
from engine.kernels import on_cuda
from engine.loading import load_model
from engine.registry import base_names
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink
from harness.gates.batch_parity import run_batch_case, scenario_cases
from oracles.cases import DTYPES, frozen_prompt_ids, model_name

pytestmark = pytest.mark.parity

CASES = [c for base in base_names("tiny") for d in DTYPES for c in scenario_cases(model_name(base, d))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label.replace(" ", "-"))
def test_rows_match_batch_generator(case):
    r = run_batch_case(case)
    assert r.passed, f"{case.label}: max|diff|={r.max_abs_diff} at {r.first_diff}, tokens_equal={r.tokens_equal}"


# The batch lane runs mlx-lm's batched graph even for a lone row (explicit boolean
# mask, per-row RoPE offset arrays), because that is what the same-B gate compares
# against. On the CPU that graph gives the serial graph's bits exactly; on CUDA the
# masked attention kernel rounds differently (measured on the H200, MLX 0.32.4:
# 1-ULP logit differences for the bf16 models but tiny-qwen3 and for qwen3_5 in f32;
# the others matched), and mlx-lm's own BatchGenerator differs from its generate_step
# there in the same way. So on CUDA exactly those cases are expected failures, strict
# (the same inputs give the same kernels and bits every run), and the f32 cases that
# matched must still match. CI runs on the CPU, where every case must pass.
_DIFFERS_ON_CUDA = pytest.mark.xfail(
    on_cuda(), reason="CUDA: mlx-lm's batched graph rounds this model 1 ULP away from its serial graph", strict=True
)


def _lone_cases():
    for dtype in ("f32", "bf16"):
        for base in base_names("tiny"):
            differs = (dtype == "bf16" and base != "tiny-qwen3") or base == "tiny-qwen35"
            yield pytest.param(base, dtype, marks=[_DIFFERS_ON_CUDA] if differs else [], id=f"{dtype}-{base}")


@pytest.mark.parametrize(("base", "dtype"), _lone_cases())
def test_a_lone_request_in_the_batcher_equals_the_serial_path(base, dtype, tiny_path):
    """Our --batch 8 with a single request is our serial B=1 output, bit for bit (on the CPU)."""
    model = load_model(tiny_path(model_name(base, dtype)))[0]
    prompt = frozen_prompt_ids(300, 4096, seed=9)
    stop = StopCriteria(max_tokens=40, ignore_eos=True)
    serial_logits, batch_logits = [], []
    serial = [t.token_id for t in generate(model, prompt, stop=stop, tap=lambda s: serial_logits.append(s.logits))]
    batcher = ContinuousBatcher(model, SchedulerConfig(max_rows=8), tap=lambda _id, x: batch_logits.append(x))
    sink = CollectingSink()
    batcher.submit(GenerationRequest("solo", tuple(prompt), stop=stop), sink)
    batcher.run_until_idle()
    assert sink.token_ids == serial
    # the batch makes one forward more (it launches the step after the last token, like mlx-lm)
    assert len(batch_logits) == len(serial_logits) + 1
    for a, b in zip(serial_logits, batch_logits):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
