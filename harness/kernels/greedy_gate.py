"""The fast tier's greedy agreement on trained models: of each held-out text prompt's greedy steps on the exact
tier, how many the fast tier would have chosen too, fed the same path.

On random weights next-token distributions are near-flat, so the float32-reference gate (`harness.kernels.gate`)
judges those models by KL alone. A trained model's distributions are peaked enough for greedy choices to carry
information. The exact tier decodes each prompt greedily at one row; the fast tier is fed that path (`rows` rows
a batch, as the continuous batcher runs them) and its greedy token at every step is compared with the path's.
Teacher-forced rather than free-running: once two free-running paths part, the steps after say nothing, and on
these small models a valid reordering of sums parts them after ~31-36 of 64 steps on average, which is no
different from a broken kernel's count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from engine.engine import Engine
from engine.kernels import EXACT, FAST, KernelConfig, install
from harness.gates.quality import held_out_ids
from harness.kernels.gate import GATE_STEPS, forced, greedy

# Mean steps agreed of GATE_STEPS. Measured on the CPU (16 prompts of 16 and 32 tokens) with stand-ins for the
# GEMV: computed in float32 from unrounded dequantized weights, as the fast tier's kernel does, the 4-bit trained
# models agree on 62.8 and 62.4 of 64; leaving the last 64 inputs out of every sum, on 29.3 and 6.9. A uniform
# output scale 1.6% off still agrees on 62.6 and 61.2 (the next RMS norm absorbs most of it): the KL part of the
# gate is the one that catches that.
GREEDY_MIN_STEPS = 60
PROMPT_TOKENS = (16, 64, 256, 512)  # the prompts' lengths, cycled
PROMPTS = 16  # at least this many paths a row count: one bad path moves the mean of 16 by at most 4 steps


@dataclass(frozen=True)
class GreedyResult:
    model: str
    rows: int
    steps: int
    agreed: tuple[int, ...]  # per prompt: steps whose fast-tier greedy token is the exact tier's
    fast_tier: str

    @property
    def mean(self) -> float:
        return sum(self.agreed) / len(self.agreed)

    @property
    def bound(self) -> float:
        return GREEDY_MIN_STEPS * self.steps / GATE_STEPS

    @property
    def passed(self) -> bool:
        return self.mean >= self.bound

    def as_record(self) -> dict:
        return {**asdict(self), "mean": self.mean, "bound": self.bound, "passed": self.passed}


def text_prompts(tokenizer, count: int, lengths: Sequence[int] = PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts cut one after another from the held-out text, their lengths `lengths` cycled."""
    sizes = [lengths[i % len(lengths)] for i in range(count)]
    ids = held_out_ids(tokenizer, sum(sizes))
    out, at = [], 0
    for n in sizes:
        out.append(ids[at : at + n])
        at += n
    return out


def agreed_steps(path: Sequence[int], logits: mx.array) -> int:
    """Steps at which the greedy token of `logits` [steps, V] is the path's."""
    return int((mx.argmax(logits, axis=-1) == mx.array(list(path))).sum().item())


def path_count(paths: int, rows: int) -> int:
    """At least `paths` prompts, and a whole number of batches of `rows`."""
    count = max(paths, rows)
    return count + -count % rows


def run_greedy_gate(
    name: str,
    path: Path,
    rows: Sequence[int] = (1,),
    steps: int = GATE_STEPS,
    fast: KernelConfig = KernelConfig(FAST),
    paths: int = PROMPTS,
    lengths: Sequence[int] = PROMPT_TOKENS,
    on_progress: Callable[[str], None] | None = None,
) -> list[GreedyResult]:
    """Greedy agreement of the fast tier with the exact tier on the model at `path`, at each row count (at
    least `paths` prompts of `lengths` cycled, a whole number of batches)."""
    say = on_progress or (lambda message: None)
    engine = Engine.load(None, path, kernels="exact")
    model, family = engine.model, engine.config.get("model_type")
    prompts = text_prompts(engine.tokenizer, max(path_count(paths, r) for r in rows), lengths)
    say(f"{name}: exact tier, {len(prompts)} greedy paths")
    install(model, KernelConfig(EXACT))
    tokens = [greedy(model, p, steps)[0] for p in prompts]
    fast_set = install(model, fast, family=family)
    results = []
    try:
        for r in rows:
            n = path_count(paths, r)
            say(f"{name}: fast tier fed them, {r} row{'s' * (r > 1)} a batch")
            agreed = []
            for b in range(0, n, r):
                logits = forced(model, prompts[b : b + r], tokens[b : b + r])
                agreed += [agreed_steps(t, lg) for t, lg in zip(tokens[b : b + r], logits)]
            results.append(GreedyResult(name, r, steps, tuple(agreed), fast_set.as_record()["tier"]))
    finally:
        install(model, KernelConfig(EXACT))
    return results
