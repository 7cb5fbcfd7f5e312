"""Spec rows in the continuous batch (engine.batch.spec_rows): every row's greedy output is plain greedy's.

As in test_spec.py the gate is token identity on tie-free float32 prompts (plain greedy never has its top two
logits closer than TIE_MARGIN): a verify window computes several positions in one forward, so its logits may
differ from plain decoding's in the last bits. Plain rows decoding beside spec rows run their own forward on their
own caches, so their logits are bit-identical to a run without the spec rows.
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.batch.spec_rows import SpecRows
from engine.engine import Engine
from engine.generate import generate
from engine.request import FinishReason, GenerationRequest, Lane, StopCriteria
from engine.sinks import CollectingSink
from engine.speculative.ngram import NgramSource

TIE_MARGIN = 1e-3
STEPS = 40
NUM_DRAFT = 3


@pytest.fixture(scope="module")
def dense():
    return Engine.load("tiny-qwen3-f32").model


def greedy(model, prompt, steps=STEPS, **stop):
    """Plain greedy ids, and the smallest gap between the top two logits over the run."""
    gaps = []

    def tap(step):
        top = mx.sort(step.logits[0].astype(mx.float32))[-2:]
        gaps.append((top[1] - top[0]).item())

    out = generate(model, prompt, stop=StopCriteria(max_tokens=steps, **stop), tap=tap)
    return [t.token_id for t in out if not t.is_stop], min(gaps)


def prompts_for(model, n, seed=1, length=20):
    """Tie-free prompts, each a random stretch with its own plain continuation and the stretch again inside, so
    prompt lookup finds drafts that are sometimes right and sometimes wrong."""
    rng = random.Random(seed)
    found = []
    while len(found) < n:
        base = [rng.randrange(300, 4000) for _ in range(length)]
        prompt = base + greedy(model, base, 10)[0] + base
        if greedy(model, prompt)[1] >= TIE_MARGIN:
            found.append(prompt)
    return found


@pytest.fixture(scope="module")
def dense_prompts(dense):
    return prompts_for(dense, 4)


def batcher(model, tap=None, rows=8):
    spec = SpecRows(model, NgramSource, "ngram", NUM_DRAFT)
    return ContinuousBatcher(model, SchedulerConfig(max_rows=rows), tap=tap, spec=spec)


def run(b, arrivals):
    """arrivals: (step, request, spec) submitted at that loop step; every request's sink once idle."""
    sinks, pending, step = {}, sorted(arrivals, key=lambda a: a[0]), 0
    while pending or b.has_work:
        while pending and pending[0][0] <= step:
            _, req, spec = pending.pop(0)
            sinks[req.request_id] = CollectingSink()
            b.submit(req, sinks[req.request_id], spec=spec)
        b.step()
        step += 1
    assert b.runner.spec.num_rows == 0 and b.runner.num_rows == 0
    return sinks


def request(rid, prompt, steps=STEPS, **stop):
    return GenerationRequest(rid, tuple(prompt), stop=StopCriteria(max_tokens=steps, **stop))


def joining_and_leaving(p):
    """Spec rows joining late and leaving early, a plain row beside them and a one-token prompt (nothing to
    prefill in a draft): (arrival step, request, speculates) as `run` takes them."""
    return [
        (0, request("a", p[0]), True),
        (0, request("b", p[1], 7), True),  # leaves early
        (3, request("c", p[2]), True),  # joins while a and b decode
        (5, request("plain", p[1], 20), False),  # a plain row beside them
        (9, request("d", p[3], 12), True),
        (30, request("e", p[2][:1], 9), True),  # a one-token prompt
    ]


def check_windows_not_tokens(model, b, p, rows):
    """`rows` spec rows and a late one through batcher `b`: each emits plain greedy's tokens, all but token 0 from
    spec rounds, however its group's windows were chosen."""
    arrivals = [(0, request(f"r{i}", q), True) for i, q in enumerate(p[:rows])]
    arrivals.append((5, request("late", p[-1], 17), True))  # the row count changes mid-run
    sinks = run(b, arrivals)
    for _, req, _ in arrivals:
        s = sinks[req.request_id]
        assert s.token_ids == greedy(model, req.prompt_ids, req.stop.max_tokens)[0], (rows, req.request_id)
        assert s.result.spec.emitted == req.stop.max_tokens - 1


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_spec_rows_equal_plain_greedy(dense, dense_prompts, rows):
    sinks = run(batcher(dense), [(0, request(f"r{i}", p), True) for i, p in enumerate(dense_prompts[:rows])])
    accepted = rejected = 0
    for i, p in enumerate(dense_prompts[:rows]):
        s = sinks[f"r{i}"]
        assert s.token_ids == greedy(dense, p)[0], f"row {i}"
        assert s.result.lane is Lane.CONTINUOUS and s.result.finish_reason is FinishReason.LENGTH
        assert s.result.spec.emitted >= STEPS - 1  # token 0 comes from the join, every other from a round
        accepted += s.result.spec.accepted
        rejected += s.result.spec.rewinds
    assert accepted > 0 and rejected > 0  # drafts were taken and drafts were dropped
    assert sinks["r0"].result.spec.rounds < STEPS - 1  # fewer target forwards than tokens


def test_spec_rows_joining_late_and_leaving_early_still_equal(dense, dense_prompts):
    p = dense_prompts
    arrivals = [
        (0, request("a", p[0]), True),
        (0, request("b", p[1], 7), True),  # leaves early
        (3, request("c", p[2]), True),  # joins while a and b decode
        (9, request("d", p[3], 12), True),
    ]
    sinks = run(batcher(dense), arrivals)
    for _, req, _ in arrivals:
        assert sinks[req.request_id].token_ids == greedy(dense, req.prompt_ids, req.stop.max_tokens)[0]


def test_plain_rows_beside_spec_rows_keep_their_logits_bit_for_bit(dense, dense_prompts):
    p = dense_prompts
    plain_rows = [(0, request("p0", p[0]), False), (0, request("p1", p[1], 30), False)]
    spec_rows = [(2, request("s0", p[2]), True), (5, request("s1", p[3], 9), True)]

    def taps(arrivals):
        seen = {}
        sinks = run(batcher(dense, tap=lambda rid, x: seen.setdefault(rid, []).append(np.array(x))), arrivals)
        return seen, sinks

    alone, alone_sinks = taps(plain_rows)
    beside, sinks = taps(plain_rows + spec_rows)
    for rid in ("p0", "p1"):
        assert sinks[rid].token_ids == alone_sinks[rid].token_ids
        assert len(beside[rid]) == len(alone[rid])
        assert all(np.array_equal(a, b) for a, b in zip(alone[rid], beside[rid]))
        assert sinks[rid].result.spec is None
    for _, req, _ in spec_rows:
        assert sinks[req.request_id].token_ids == greedy(dense, req.prompt_ids, req.stop.max_tokens)[0]


def test_eos_stop_sequences_and_max_tokens_end_spec_rows_exactly(dense, dense_prompts):
    prompt = dense_prompts[0]
    ref = greedy(dense, prompt)[0]
    eos = ref[10]
    seq = tuple(ref[20:22])
    at = next(i for i in range(len(ref) - 1) if tuple(ref[i : i + 2]) == seq)
    arrivals = [
        (0, request("eos", prompt, eos_ids=frozenset([eos])), True),
        (0, request("stop", prompt, stop_sequences=(seq,)), True),
        *[(0, request(f"max{n}", prompt, n), True) for n in (1, 2, 5, 7)],
    ]
    sinks = run(batcher(dense), arrivals)
    assert [t.token_id for t in sinks["eos"].tokens] == ref[: ref.index(eos) + 1]
    assert sinks["eos"].result.finish_reason is FinishReason.STOP
    assert sinks["stop"].token_ids == ref[:at] and sinks["stop"].result.finish_reason is FinishReason.STOP
    for n in (1, 2, 5, 7):
        assert sinks[f"max{n}"].token_ids == ref[:n]
        assert sinks[f"max{n}"].result.finish_reason is FinishReason.LENGTH
        assert sinks[f"max{n}"].result.generated_tokens == n


def test_hybrid_spec_rows_roll_deltanet_state_back_per_row_and_equal_plain_greedy():
    hybrid = Engine.load("tiny-qwen35-f32").model
    p = prompts_for(hybrid, 4)
    arrivals = [
        (0, request("a", p[0]), True),
        (0, request("b", p[1], 9), True),
        (0, request("c", p[2]), False),  # a plain row beside them
        (4, request("d", p[3]), True),
    ]
    sinks = run(batcher(hybrid), arrivals)
    rewinds = 0
    for _, req, spec in arrivals:
        s = sinks[req.request_id]
        assert s.token_ids == greedy(hybrid, req.prompt_ids, req.stop.max_tokens)[0], req.request_id
        if spec:
            assert s.result.spec.replays == 0  # every rejection was undone from the trace, no forward replayed
            rewinds += s.result.spec.rewinds
    assert rewinds > 0


@pytest.mark.parametrize("name", ["tiny-qwen3-f32", "tiny-qwen35-f32"])
def test_the_adaptive_window_changes_windows_not_tokens(name):
    model = Engine.load(name).model
    p = prompts_for(model, 4)
    for rows in (1, 4):
        spec = SpecRows(model, NgramSource, "ngram", NUM_DRAFT, "adaptive")
        check_windows_not_tokens(model, ContinuousBatcher(model, SchedulerConfig(max_rows=8), spec=spec), p, rows)
        assert 1 in spec.seconds or rows > 1  # a plain window was measured


def adaptive_rows(n, limit=NUM_DRAFT):
    from engine.batch.spec_rows import SpecRow
    from engine.speculative.policy import AdaptivePolicy

    spec = SpecRows(None, NgramSource, "ngram", limit, "adaptive")
    spec.rows = [SpecRow(f"r{i}", None, None, None, None, (), 100, 0, estimate=AdaptivePolicy(limit)) for i in range(n)]
    return spec


def test_the_window_width_maximises_the_groups_expected_tokens_per_second():
    spec = adaptive_rows(2)
    assert spec.width([[1, 2, 3], [4]]) == 1  # nothing measured at two rows: a plain step first
    spec.seconds = {2: 1.0, 8: 1.0}  # drafting costs nothing
    assert spec.width([[1, 2, 3], [4]]) == 4
    assert spec.width([[1], []]) == 2  # no wider than the longest proposal
    assert spec.width([[], []]) == 1
    spec.seconds = {2: 1.0, 8: 2.5}  # a 4-wide window costs two and a half plain steps
    for r in spec.rows:
        for _ in range(20):
            r.estimate.record_acceptance(3, 0)  # nothing accepted
    assert spec.width([[1, 2, 3], [4, 5, 6]]) == 1
    for r in spec.rows:
        for _ in range(40):
            r.estimate.record_acceptance(3, 3)  # everything accepted
    assert spec.width([[1, 2, 3], [4, 5, 6]]) == 4
    assert spec.width([[1, 2, 3], []]) == 1  # one row alone cannot pay for the window


def test_a_window_that_ends_the_request_counts_only_the_tokens_it_keeps():
    # 2 tokens left, 2 drafts fed (mlx-lm's min(remaining, num_draft)), both accepted: 3 tokens come out of the
    # window, the request keeps 2, and its stats count those (the batcher drops the third)
    from engine.request import SamplingParams, SpecStats

    spec = adaptive_rows(1)
    row = spec.rows[0]
    row.params, row.stats, row.produced = SamplingParams(), SpecStats("ngram", NUM_DRAFT), 98
    assert spec._limit(row) == 2
    logprobs = mx.zeros((1, 3, 8))
    out, kept = spec._emit([row], [(1, 2, 3)], [[]], [[2, 3, 4]], logprobs, None, False)
    assert len(out["r0"]) == 3 and kept == [3]
    assert row.stats.emitted == 2 and row.stats.accepted == 2


def test_drafts_not_fed_are_checked_against_the_tokens_that_follow():
    row = adaptive_rows(1).rows[0]
    row.shadow = [5, 6, 7]
    row.check_shadow([5])
    assert row.shadow and row.estimate.tried == [0.0, 0.0, 0.0]  # not decided yet
    row.check_shadow([6, 9])  # two matched, the third did not
    assert row.shadow == [] and row.estimate.tried == [1.0, 1.0, 1.0] and row.estimate.taken == [1.0, 1.0, 0.0]


class MissSource(NgramSource):
    """Prompt lookup with every drafted token off by one: nothing is ever accepted."""

    def propose(self, pending, limit):
        return [t + 1 for t in super().propose(pending, limit)]


@pytest.mark.parametrize("name", ["tiny-qwen3-f32", "tiny-qwen35-f32"])
def test_a_group_whose_drafts_never_pay_pipelines_plain_windows_and_still_equals_plain_greedy(name):
    model = Engine.load(name).model
    p = prompts_for(model, 4)
    ref = greedy(model, p[2])[0]
    launched = []

    class FixedCosts(dict):
        """A forward's seconds in proportion to its tokens, whatever the clock measured: which widths the group
        prices as best cannot change with how busy the machine is (on a loaded CI machine it pipelined 4 windows,
        31 of 37 with these)."""

        def __setitem__(self, tokens, _):
            super().__setitem__(tokens, 0.001 * tokens)

    class Counting(SpecRows):
        def __init__(self, *args):
            super().__init__(*args)
            self.seconds = FixedCosts()

        def _launch_ahead(self, sampled):
            launched.append(super()._launch_ahead(sampled))
            return launched[-1]

    spec = Counting(model, MissSource, "ngram", NUM_DRAFT, "adaptive")
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=8), spec=spec, keep_caches=True)
    stored = []
    real = b._stored
    b._stored = lambda seq, held, cache: stored.append((held, cache)) or real(seq, held, cache)
    arrivals = [
        (0, request("a", p[0]), True),
        (0, request("b", p[1], 9), True),  # leaves while a plain window is in flight
        (0, request("c", p[2], eos_ids=frozenset([ref[25]])), True),
        (6, request("d", p[3], 30), True),  # joins while one is in flight
        (2, request("e", p[0], 20), False),  # a plain row beside them
    ]
    sinks = run(b, arrivals)
    for _, req, _ in arrivals:
        want = greedy(model, req.prompt_ids, req.stop.max_tokens, eos_ids=req.stop.eos_ids)[0]
        assert sinks[req.request_id].token_ids == want, req.request_id
    assert sum(launched) >= 5  # plain windows were pipelined
    for held, cache in stored:  # each stored row's caches hold exactly the tokens it says
        kv = next(c for c in cache if hasattr(c, "keys"))
        assert kv.offset == len(held)


class SilentSource(NgramSource):
    """A source with nothing to propose: no window is ever wider than one token, so none is measured."""

    def propose(self, pending, limit):
        return []


def test_a_group_that_never_proposes_pipelines_its_plain_windows():
    # Widths never measured look worth trying (priced as the nearest measured one), but only a proposal can try
    # one: the group pipelines at the widths it has measured and pauses every `wait` windows for proposals.
    model = Engine.load("tiny-qwen35-f32").model
    p = prompts_for(model, 4)
    launched = []

    class Counting(SpecRows):
        def _launch_ahead(self, sampled):
            launched.append(super()._launch_ahead(sampled))
            return launched[-1]

    spec = Counting(model, SilentSource, "ngram", NUM_DRAFT, "adaptive")  # the rows' estimates: their priors
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=8), spec=spec)
    arrivals = [(0, request(f"r{i}", p[i], 40), True) for i in range(4)]
    sinks = run(b, arrivals)
    for _, req, _ in arrivals:
        assert sinks[req.request_id].token_ids == greedy(model, req.prompt_ids, req.stop.max_tokens)[0]
    assert sum(launched) >= 30 and not all(launched)  # pipelined, with pauses for proposals
