"""The speculative oracle gate: our draft-model speculation against mlx-lm's
`speculative_generate_step`, on the same target/draft pair, greedy.

Dense targets (mlx-lm refuses hybrid ones). Same prompt ids, same draft
count and prefill chunk: the generated tokens must be identical, and so must
the acceptance trace (which tokens came from the draft). The pairs cover an
early-exit draft (the target's first layer, so drafts are often right), a
draft of another family with the same vocabulary, an unrelated draft
(another seed: almost never right), the target drafting for itself, and the
trained target with its trained draft.

A draft-model spec row in the continuous batch (`engine serve --spec-batch`) is held to the same oracle: one
request through the gateway, the exact tier, drafts per round fixed (mlx-lm's rule), on a float32 target, and its
tokens must be identical. Its token 0 is made differently by design: the batch takes it from the joiner's L=1
forward over the prompt's last token (every joiner's token 0 is plain), where mlx-lm's first round drafts after
the prompt and verifies those drafts with it. Every round after it starts one token later than mlx-lm's, so its
acceptance trace is compared with mlx-lm's on the prompt followed by token 0, whose rounds start where the batch's
do: the same windows, the same drafts, the same tokens from the draft.
"""

import random

import pytest

from engine.gateway import Gateway, GatewayConfig
from engine.kernels import EXACT
from engine.loading import load_model as load_ours
from engine.request import FinishReason, GenerationRequest, Lane, SpecStats, StopCriteria
from engine.sinks import CollectingSink
from engine.speculative.config import SpecConfig, Speculation
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
BATCH_PAIRS = [
    (("tiny-qwen3-f32", 0), ("tiny-qwen3-draft-f32", 0)),  # an early-exit draft
    (("tiny-qwen3-f32", 0), ("tiny-qwen3-f32", 0)),  # the target drafting for itself: every draft accepted
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


def _cases(pair):
    """The pair loaded by mlx-lm and by us, then per case: both pairs, the prompt, drafts per round, prefill chunk
    and the case's name."""
    (t, ts), (d, ds) = pair
    t_path, d_path = ensure_model(t, ts), ensure_model(d, ds)
    ref = reference.load_model(t_path), reference.load_model(d_path)
    ours = load_ours(t_path)[0], load_ours(d_path)[0]
    rng = random.Random(7)
    for length, num_draft, chunk in CASES:
        prompt = [rng.randrange(300, 4000) for _ in range(length)]
        yield ref, ours, prompt, num_draft, chunk, f"prompt {length}, {num_draft} drafts, chunk {chunk}"


@pytest.mark.parametrize("pair", PAIRS, ids=_label)
def test_draft_model_speculation_matches_mlx_lm(pair):
    (t, _), (d, _) = pair
    accepted = 0
    for ref_pair, (target, draft), prompt, num_draft, chunk, case in _cases(pair):
        ref = reference.speculative(*ref_pair, prompt, STEPS, num_draft, chunk)
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
        assert tokens == ref.tokens, case
        assert source.from_draft[:STEPS] == ref.from_draft, case
        accepted += stats.accepted
    if pair[1] != (d, 1):  # all but the unrelated draft agree with their target some of the time
        assert accepted > 0
    if t.startswith("trained"):
        assert accepted >= sum(STEPS // 4 for _ in CASES), accepted


def _spec_row(target, draft, prompt, num_draft, chunk):
    """One request as a spec row: its tokens, and per token after token 0 whether it was an accepted draft."""
    setup = Speculation(SpecConfig("draft", num_draft, policy="fixed"), target, draft, prefill_step_size=chunk)
    gateway = Gateway(target, GatewayConfig.for_tier(EXACT, batch=4, prefill_chunk=chunk, spec_batch=True), setup)
    batched = gateway.batcher.runner.spec.draft
    from_draft = []
    commit = batched.commit

    def traced(fed, accepted):  # one row: it fed fed[0] (pending + drafts) and kept accepted[0] drafts
        from_draft.extend([True] * accepted[0] + [False])
        commit(fed, accepted)

    batched.commit = traced
    sink = CollectingSink()
    request = GenerationRequest("r", tuple(prompt), stop=StopCriteria(max_tokens=STEPS, ignore_eos=True))
    placement = gateway.submit(request, sink)
    gateway.run_until_idle()
    assert placement.lane is Lane.CONTINUOUS and placement.spec, placement.reason
    assert sink.result.finish_reason is FinishReason.LENGTH and sink.result.spec.kind == "draft"
    return sink.token_ids, from_draft[: STEPS - 1]


@pytest.mark.parametrize("pair", BATCH_PAIRS, ids=_label)
def test_a_draft_model_spec_row_in_the_batch_matches_mlx_lm(pair):
    accepted = 0
    for ref_pair, (target, draft), prompt, num_draft, chunk, case in _cases(pair):
        tokens, from_draft = _spec_row(target, draft, prompt, num_draft, chunk)
        assert tokens == reference.speculative(*ref_pair, prompt, STEPS, num_draft, chunk).tokens, case
        after = reference.speculative(*ref_pair, [*prompt, tokens[0]], STEPS - 1, num_draft, chunk)
        assert tokens[1:] == after.tokens, case
        assert from_draft == after.from_draft, case
        if pair[0] == pair[1]:  # every round accepts all its drafts (the last may stop at max_tokens)
            assert from_draft == (([True] * num_draft + [False]) * STEPS)[: STEPS - 1], case
        accepted += sum(from_draft)
    assert accepted > 0
