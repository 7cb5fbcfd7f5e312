"""The speculative oracle gate: our draft-model speculation against mlx-lm's
`speculative_generate_step`, on the same target/draft pair, greedy.

Dense targets (mlx-lm refuses hybrid ones). Same prompt ids, same draft
count and prefill chunk: the generated tokens must be identical, and so must
the acceptance trace (which tokens came from the draft). The pairs cover an
early-exit draft (the target's first layer, so drafts are often right), a
draft of another family with the same vocabulary, an unrelated draft
(another seed: almost never right), the target drafting for itself, and the
trained target with its trained draft.
"""

import random

import pytest

from engine.loading import load_model as load_ours
from engine.request import SpecStats, StopCriteria
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.verifier import speculative_generate
from engine.synth import ensure_model
from oracles import reference

pytestmark = pytest.mark.parity

STEPS = 48
PAIRS = [
    (("tiny-qwen3", 0), ("tiny-qwen3-draft", 0)),
    (("tiny-qwen3-f32", 0), ("tiny-qwen3-draft-f32", 0)),
    (("tiny-qwen3-4bit", 0), ("tiny-qwen3-draft-4bit", 0)),
    (("tiny-qwen2", 0), ("tiny-qwen3-draft", 0)),
    (("tiny-llama", 0), ("tiny-llama", 1)),
    (("tiny-llama", 0), ("tiny-llama", 0)),
    (("trained-qwen3", 0), ("trained-qwen3-draft", 0)),  # a trained pair: most rounds accept some drafts
]
# (prompt length, drafts per round, prefill chunk): chunking past 512 as mlx-lm's default spec prefill does.
CASES = [(1, 1, 2048), (7, 3, 2048), (300, 2, 2048), (700, 4, 512), (40, 6, 2048)]


class _Traced(DraftModelSource):
    """Records, per emitted token, whether it was a draft the target accepted (mlx-lm's third field)."""

    def __init__(self, model, chunk):
        super().__init__(model, chunk)
        self.from_draft = []

    def commit(self, result):
        super().commit(result)
        self.from_draft += [True] * result.accepted + [False]


def _label(pair):
    (t, ts), (d, ds) = pair
    return f"{t}-s{ts}+{d}-s{ds}"


@pytest.mark.parametrize("pair", PAIRS, ids=_label)
def test_draft_model_speculation_matches_mlx_lm(pair):
    (t, ts), (d, ds) = pair
    t_path, d_path = ensure_model(t, ts), ensure_model(d, ds)
    ref_target, ref_draft = reference.load_model(t_path), reference.load_model(d_path)
    target, _ = load_ours(t_path)
    draft, _ = load_ours(d_path)
    rng = random.Random(7)
    accepted = 0
    for length, num_draft, chunk in CASES:
        prompt = [rng.randrange(300, 4000) for _ in range(length)]
        ref = reference.speculative(ref_target, ref_draft, prompt, STEPS, num_draft, chunk)
        stats = SpecStats("draft", num_draft)
        source = _Traced(draft, chunk)
        ours = speculative_generate(
            target,
            source,
            prompt,
            num_draft=num_draft,
            stop=StopCriteria(max_tokens=STEPS),
            stats=stats,
            prefill_step_size=chunk,
        )
        tokens = [tok.token_id for tok in ours]
        case = f"prompt {length}, {num_draft} drafts, chunk {chunk}"
        assert tokens == ref.tokens, case
        assert source.from_draft[:STEPS] == ref.from_draft, case
        accepted += stats.accepted
    if pair[1] != (d, 1):  # all but the unrelated draft agree with their target some of the time
        assert accepted > 0
    if t.startswith("trained"):
        assert accepted >= sum(STEPS // 4 for _ in CASES), accepted
