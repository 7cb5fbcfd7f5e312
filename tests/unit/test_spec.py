"""Speculative decoding on our own models: every source gives plain greedy's tokens.

mlx-lm refuses speculation on models whose caches cannot be trimmed (the
hybrid Qwen3.5), so there the oracle is our own plain greedy generation.
A verify forward computes a window of positions in one matmul where plain
decoding computes one; the logits can differ in the last bits, so the gate
is token identity on tie-free prompts: prompts whose plain greedy run never
has its top two logits closer than TIE_MARGIN. The prompts are chosen by that
rule, never by whether speculation happened to agree. The models are the f32
variants: in bf16 the top two logits of these models are often exactly
equal (bf16 resolves ~0.06 at their magnitude), so no bf16 prompt of 48
steps is tie-free; f32 margins are 1e-3 and up, against verify-vs-plain
differences in the last f32 bits.
"""

import copy
import random

import mlx.core as mx
import pytest

from engine.cache import KVCache, RecurrentCache
from engine.engine import Engine
from engine.errors import DraftMismatchError
from engine.generate import generate
from engine.request import SamplingParams, SpecStats, StopCriteria
from engine.speculative.config import SpecConfig, Speculation, load_speculation
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.mtp import MTPSource
from engine.speculative.ngram import NgramSource
from engine.speculative.rollback import checkpoint, rewind
from engine.speculative.source import Round
from engine.speculative.verifier import speculative_generate

TIE_MARGIN = 1e-3  # between the best and second-best logit at every plain greedy step (f32)
STEPS = 48


@pytest.fixture(scope="module")
def hybrid():
    return Engine.load("tiny-qwen35-f32")


@pytest.fixture(scope="module")
def hybrid_draft():
    return Engine.load("tiny-qwen35-draft-f32").model


def plain(model, prompt, steps=STEPS, **stop):
    return [t.token_id for t in generate(model, prompt, stop=StopCriteria(max_tokens=steps, **stop))]


def min_margin(model, prompt, steps=STEPS) -> float:
    margins = []

    def tap(step):
        top = mx.sort(step.logits[0].astype(mx.float32))[-2:]
        margins.append((top[1] - top[0]).item())

    list(generate(model, prompt, stop=StopCriteria(max_tokens=steps), tap=tap))
    return min(margins)


def spec(model, source, prompt, num_draft=3, steps=STEPS, rollback="trace", **stop):
    stats = SpecStats(source.kind, num_draft)
    out = speculative_generate(
        model,
        source,
        prompt,
        num_draft=num_draft,
        stop=StopCriteria(max_tokens=steps, **stop),
        stats=stats,
        rollback=rollback,
    )
    return [t.token_id for t in out], stats


def tie_free_prompts(model, n, seed=0, length=24):
    """Random prompts, plus each repeated with the plain continuation inside (so prompt lookup finds matches)."""
    rng = random.Random(seed)
    found = []
    while len(found) < n:
        base = [rng.randrange(300, 4000) for _ in range(length)]
        prompt = base + plain(model, base, 12) + base
        if min_margin(model, prompt) >= TIE_MARGIN:
            found.append(prompt)
    return found


@pytest.fixture(scope="module")
def prompts(hybrid):
    return tie_free_prompts(hybrid.model, 3)


@pytest.mark.parametrize("rollback", ["trace", "replay"])
def test_draft_model_on_a_hybrid_target_matches_plain_greedy_with_rollbacks(hybrid, hybrid_draft, prompts, rollback):
    total = SpecStats("draft", 3)
    for prompt in prompts:
        for num_draft in (1, 3, 5):
            source = DraftModelSource(hybrid_draft, 2048, trace=rollback == "trace")
            got, stats = spec(hybrid.model, source, prompt, num_draft, rollback=rollback)
            assert got == plain(hybrid.model, prompt), f"num_draft {num_draft}"
            if num_draft == 3:
                total.add(stats)
    # Both kinds of round happened; rejections rewound the DeltaNet state of the target (and of the
    # draft, which is hybrid too): from the recorded trace, or by replaying the kept tokens.
    assert total.accepted > 0 and total.rejected > 0 and total.rewinds > 0
    assert (total.replays > 0) == (rollback == "replay")
    assert total.emitted == len(prompts) * STEPS


def test_prompt_lookup_on_a_hybrid_target_matches_plain_greedy(hybrid, prompts):
    total = SpecStats("ngram", 4)
    for prompt in prompts:
        got, stats = spec(hybrid.model, NgramSource(2, 4), prompt, 4)
        assert got == plain(hybrid.model, prompt)
        total.add(stats)
    assert total.accepted > 0 and total.rejected > 0 and total.rewinds > 0


def test_mtp_head_matches_plain_greedy(hybrid, prompts):
    for prompt in prompts:
        got, stats = spec(hybrid.model, MTPSource(hybrid.model), prompt, 3)
        assert got == plain(hybrid.model, prompt)
        assert stats.drafted > 0  # random head weights: it rarely agrees, but it drafts every round


class _Steered(MTPSource):
    """The MTP source with its drafts replaced by the known continuation for the first few positions.

    The head still runs (its cache fills and is trimmed as usual); only the
    proposed ids change, so rounds accept 0..limit drafts and commit
    exercises every kept length.
    """

    def __init__(self, model, truth):
        super().__init__(model)
        self.truth, self.rounds, self.emitted = truth, 0, 0

    def propose(self, pending, limit):
        drafts = super().propose(pending, limit)
        good = self.rounds % (limit + 1)
        self.rounds += 1
        right = self.truth[self.emitted : self.emitted + good]  # pending is truth[emitted - 1]
        return right + drafts[len(right) :]

    def begin(self, prompt_ids):
        super().begin(prompt_ids)
        self.emitted = 0

    def commit(self, result):
        super().commit(result)
        self.emitted += result.accepted + 1


def test_mtp_cache_holds_exactly_the_target_pairs_after_accepted_rounds():
    eng = Engine.load("tiny-qwen35-f32")
    model = eng.model
    prompt = random.Random(3).sample(range(300, 4000), 30)
    truth = plain(model, prompt, 40)
    source = _Steered(model, truth)
    got, stats = spec(model, source, prompt, 3, steps=40)
    assert got == truth
    assert stats.accepted > 0 and stats.rejected > 0
    # After the run the head's cache holds pairs (target hidden at i, token i + 1) for i < offset,
    # the same as one pass of the head over the whole sequence's target hidden states.
    seq = prompt + truth
    offset = source.cache[0].offset
    hidden = model.hidden(mx.array(seq)[None])
    text = model.language_model
    fresh = [KVCache() for _ in text.mtp.layers]
    text.mtp(hidden[:, :offset], text.model.embed_tokens(mx.array(seq[1 : offset + 1])[None]), fresh)
    assert offset >= len(seq) - 8  # all but the last round's pairs, which wait for the next proposal
    # The same math in f32, but one forward over the sequence against the prefill plus one forward
    # per round: kernels differ with the row count. On the CPU that moves the last bits (1e-4 holds);
    # CUDA's f32 matmuls round like TF32 (measured on the H200: up to ~2e-4 at magnitude ~1, so the
    # bound there is relative, 1e-2). A wrong pairing (off by one position, the wrong token) moves
    # keys by O(1), far outside either bound.
    tol = dict(atol=1e-4) if mx.default_device() == mx.cpu else dict(rtol=1e-2, atol=1e-3)
    for ours, ref in zip(source.cache[0].state, fresh[0].state):
        assert ours.shape == ref.shape
        assert mx.allclose(ours, ref, **tol).item()


def test_the_mtp_head_resumes_from_a_prompt_boundary_as_if_it_had_seen_the_whole_prompt(hybrid, prompts):
    """A request whose target starts from a cached prompt boundary starts the head from the state stored there
    (`MTPSource.boundary`): plain greedy's tokens, and at its own boundary the head's pairs and the hidden state
    a cold run has (to the last bits: the forwards cover other row counts, as in the test above)."""
    model, longer = hybrid.model, prompts[0]
    first = longer[:-9]

    def run(prompt, cache=None, cached=0, state=None):
        seen = {}

        def on_prompt(target_cache, source_state):
            seen["cache"], seen["state"] = copy.deepcopy(target_cache), source_state

        out = speculative_generate(
            model,
            MTPSource(model),
            prompt,
            num_draft=3,
            stop=StopCriteria(max_tokens=STEPS),
            cache=cache,
            cached_tokens=cached,
            on_prompt=on_prompt,
            source_state=state,
        )
        return [t.token_id for t in out], seen

    cold_tokens, cold = run(longer)
    _, boundary = run(first)
    assert boundary["state"].tokens == len(first) - 1
    warm_tokens, warm = run(longer, boundary["cache"], len(first) - 1, boundary["state"])
    assert warm_tokens == cold_tokens == plain(model, longer)
    a, b = cold["state"], warm["state"]
    assert a.tokens == b.tokens == len(longer) - 1 and a.cache[0].offset == b.cache[0].offset == len(longer) - 2
    tol = dict(atol=1e-4) if mx.default_device() == mx.cpu else dict(rtol=1e-2, atol=1e-3)
    assert mx.allclose(a.hidden, b.hidden, **tol).item()
    for ours, ref in zip(b.cache[0].state, a.cache[0].state):
        assert ours.shape == ref.shape and mx.allclose(ours, ref, **tol).item()
    with pytest.raises(ValueError, match="state after the"):  # a cached start needs the head's state there
        run(longer, boundary["cache"], len(first) - 1)


def test_self_draft_accepts_everything_and_never_replays(hybrid, prompts):
    got, stats = spec(hybrid.model, DraftModelSource(hybrid.model, 2048), prompts[0], 3)
    assert got == plain(hybrid.model, prompts[0])
    assert stats.acceptance == 1.0 and stats.replays == 0
    assert stats.tokens_per_target_forward == STEPS / stats.rounds


PROMPT, FED = list(range(300, 340)), [901, 902, 903, 904, 905]


def _assert_same(a, b, offset):
    for ca, cb in zip(a, b):
        assert ca.offset == cb.offset == offset
        for x, y in zip(ca.state, cb.state):
            assert mx.array_equal(x, y).item()


def test_replay_rollback_rebuilds_recurrent_state_from_the_kept_tokens(hybrid):
    model = hybrid.model
    a = model.make_cache()
    model.hidden(mx.array(PROMPT)[None], a)
    point = checkpoint(a, trace=False)
    model.hidden(mx.array(FED)[None], a)
    assert rewind(model, a, point, FED, keep=2) is True
    b = model.make_cache()  # the same forwards without the rejected tokens: bit for bit
    model.hidden(mx.array(PROMPT)[None], b)
    model.hidden(mx.array(FED[:2])[None], b)
    _assert_same(a, b, 42)


@pytest.mark.parametrize("keep", [1, 2, 5])
def test_trace_rollback_keeps_the_state_after_the_last_kept_token(hybrid, keep):
    model = hybrid.model
    a = model.make_cache()
    model.hidden(mx.array(PROMPT)[None], a)
    point = checkpoint(a)
    model.hidden(mx.array(FED[:2])[None], a)  # a round may feed in several forwards (a draft model does)
    model.hidden(mx.array(FED[2:])[None], a)
    assert rewind(model, a, point, FED, keep=keep) is False
    # Reference: the same forwards, with the batch lane's length mask stopping the recurrent
    # layers after `keep` tokens, and the attention layers trimmed.
    b = model.make_cache()
    model.hidden(mx.array(PROMPT)[None], b)
    for part in (FED[:2], FED[2:]):
        done = b[0].offset - len(PROMPT)
        for c in b:
            if isinstance(c, RecurrentCache):
                c.lengths = [max(min(keep - done, len(part)), 0)]
        model.hidden(mx.array(part)[None], b)
    for c in b:
        c.trim(len(FED) - keep) if not isinstance(c, RecurrentCache) else setattr(c, "lengths", None)
        if isinstance(c, RecurrentCache):
            c.offset = len(PROMPT) + keep
    _assert_same(a, b, len(PROMPT) + keep)


def test_rewinding_to_nothing_restores_the_checkpoint_without_a_forward(hybrid):
    model = hybrid.model
    a = model.make_cache()
    model.hidden(mx.array(PROMPT)[None], a)
    point = checkpoint(a, trace=False)
    model.hidden(mx.array(FED)[None], a)
    assert rewind(model, a, point, FED, keep=0) is False
    b = model.make_cache()
    model.hidden(mx.array(PROMPT)[None], b)
    _assert_same(a, b, len(PROMPT))


def test_rewind_trims_attention_only_caches_without_a_forward():
    model = Engine.load("tiny-qwen3").model
    cache = model.make_cache()
    model.hidden(mx.array([[5, 6, 7, 8]]), cache)
    point = checkpoint(cache)
    model.hidden(mx.array([[9, 10, 11]]), cache)
    assert rewind(model, cache, point, [9, 10, 11], keep=1) is False
    assert all(c.offset == 5 for c in cache)


def test_sliding_window_target_stops_speculating_before_the_window_wraps():
    eng = Engine.load("tiny-gemma3-f32")  # window 64
    prompt = list(range(300, 340))
    got, stats = spec(eng.model, DraftModelSource(eng.model, 2048), prompt, 3, steps=60)
    assert got == plain(eng.model, prompt, 60)
    # Rounds past the window draft nothing: fewer drafted rounds than rounds.
    assert stats.drafted_at[0] < stats.rounds
    assert stats.accepted > 0


def test_eos_and_stop_sequences_end_where_plain_decoding_ends(hybrid, prompts):
    prompt = prompts[0]
    ref = plain(hybrid.model, prompt)
    eos = ref[10]
    first = ref.index(eos)
    got, _ = spec(hybrid.model, DraftModelSource(hybrid.model, 2048), prompt, 3, eos_ids=frozenset([eos]))
    assert got == ref[: first + 1]
    seq = tuple(ref[20:22])
    at = next(i for i in range(len(ref) - 1) if tuple(ref[i : i + 2]) == seq)
    stop = dict(stop_sequences=(seq,))
    got = [
        t
        for t in speculative_generate(
            hybrid.model,
            DraftModelSource(hybrid.model, 2048),
            prompt,
            num_draft=3,
            stop=StopCriteria(max_tokens=STEPS, **stop),
        )
    ]
    emitted = [t.token_id for t in got if not t.is_stop]
    assert emitted == ref[:at] and got[-1].finish_reason.value == "stop"


def test_max_tokens_is_exact_whatever_the_round_length(hybrid, prompts):
    for steps in (1, 2, 5, 7):
        got, _ = spec(hybrid.model, DraftModelSource(hybrid.model, 2048), prompts[0], 4, steps=steps)
        assert got == plain(hybrid.model, prompts[0], steps)


def test_processors_are_refused_by_the_verifier(hybrid):
    with pytest.raises(ValueError, match="logits processors"):
        list(
            speculative_generate(
                hybrid.model, NgramSource(), [5, 6, 7], num_draft=2, sampling=SamplingParams(repetition_penalty=1.2)
            )
        )


def test_a_draft_model_with_another_tokenizer_is_refused(hybrid, foreign_tokenizer_draft):
    with pytest.raises(DraftMismatchError, match=r"another tokenizer than the target \(4096 vs 4096 tokens, 2 differ"):
        load_speculation(SpecConfig("draft"), hybrid, draft_model_path=foreign_tokenizer_draft)


def test_a_same_vocabulary_draft_of_another_family_is_accepted(hybrid):
    spec_ = load_speculation(SpecConfig("draft"), hybrid, draft_model="tiny-qwen3-draft")
    assert spec_.draft is not hybrid.model and "tiny-qwen3-draft" in spec_.describe()


def test_self_draft_shares_the_target_weights(hybrid):
    spec_ = load_speculation(SpecConfig("draft"), hybrid, draft_model="tiny-qwen35-f32")
    assert spec_.draft is hybrid.model and "self-draft" in spec_.describe()


def test_setup_errors_name_the_problem(hybrid):
    with pytest.raises(ValueError, match="draft kind"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="needs a draft model"):
        Speculation(SpecConfig("draft"), hybrid.model)
    with pytest.raises(ValueError, match="MTP head"):
        Speculation(SpecConfig("mtp"), Engine.load("tiny-qwen3").model)
    with pytest.raises(ValueError, match="exactly one of"):
        load_speculation(SpecConfig("draft"), hybrid)
    with pytest.raises(ValueError, match="draft kind is 'ngram'"):
        load_speculation(SpecConfig("ngram"), hybrid, draft_model="tiny-qwen35-draft")


# ------------------------------------------------------------- prompt lookup


def _round(fed, accepted, next_token):
    return Round(tuple(fed), accepted, next_token, mx.zeros((1, len(fed), 1)))


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    src = NgramSource(2, 3)
    src.begin([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # Tail [2, 3] last appeared before at index 5 (followed by 5, 6, 7); [7, 2, 3] never did.
    assert src.propose(3, 3) == [5, 6, 7]
    assert src.propose(3, 1) == [5]
    src.commit(_round([3, 5], 1, 8))  # accepted 5, then the target said 8
    assert src.history[-3:] == [3, 5, 8]
    assert src.propose(8, 3) == []  # [5, 8] and [3, 5, 8] never appeared before


def test_ngram_prefers_the_longest_match_and_respects_min():
    src = NgramSource(1, 3)
    src.begin([7, 1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3])
    assert src.propose(3, 2) == [40, 9]  # the 3-gram [1, 2, 3] beats the later 2-gram [2, 3]
    src = NgramSource(2, 2)
    src.begin([5, 8, 6, 5])
    assert src.propose(5, 2) == []  # only a 1-gram matches


def test_ngram_zero_limit_and_bad_sizes():
    src = NgramSource()
    src.begin([1, 2, 1, 2])
    assert src.propose(2, 0) == []
    with pytest.raises(ValueError):
        NgramSource(3, 2)


def test_the_adaptive_policy_changes_windows_not_tokens(hybrid, hybrid_draft, prompts):
    from engine.speculative.policy import AdaptivePolicy

    for source in (DraftModelSource(hybrid_draft, 2048), MTPSource(hybrid.model), NgramSource()):
        stats = SpecStats(source.kind, 3)
        out = speculative_generate(
            hybrid.model,
            source,
            prompts[1],
            num_draft=3,
            stop=StopCriteria(max_tokens=STEPS),
            stats=stats,
            policy=AdaptivePolicy(3),
        )
        assert [t.token_id for t in out] == plain(hybrid.model, prompts[1]), source.kind
        assert stats.emitted == STEPS
    # The MTP head never agrees here: after measuring that, the policy runs pipelined plain rounds.
    assert stats.drafted_at[0] < stats.rounds / 3


def test_an_eos_inside_a_pipelined_plain_stretch_ends_the_request_there(hybrid, prompts):
    from engine.speculative.policy import AdaptivePolicy

    ref = plain(hybrid.model, prompts[0])
    eos = ref[30]
    out = speculative_generate(
        hybrid.model,
        MTPSource(hybrid.model),
        prompts[0],
        num_draft=3,
        stop=StopCriteria(max_tokens=STEPS, eos_ids=frozenset([eos])),
        policy=AdaptivePolicy(3),
    )
    assert [t.token_id for t in out] == ref[: ref.index(eos) + 1]
