"""The MTP head's speculation as spec rows in the continuous batch (speculative/mtp.py's BatchMTP).

The head's KV cache holds every spec row; each verify window's hidden states at the positions a row kept go in as
that row's exact pairs, drafts chain in [B, 1] steps and are trimmed after the round. The gate is the one of
test_spec_batch.py: on tie-free float32 prompts every row's greedy output is plain greedy's, whatever the head
proposes (tiny-qwen35-f32's head has random weights, so a steered head also feeds the right drafts).
"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from test_spec_batch import (
    NUM_DRAFT,
    STEPS,
    check_windows_not_tokens,
    greedy,
    joining_and_leaving,
    prompts_for,
    request,
    run,
)

from engine.batch.batcher import ContinuousBatcher
from engine.batch.kv_budget import STEP
from engine.batch.scheduler import SchedulerConfig
from engine.batch.spec_rows import SpecRows
from engine.cache import KVCache, cache_nbytes
from engine.engine import Engine
from engine.request import FinishReason, Lane, SpecStats
from engine.sinks import CollectingSink
from engine.speculative.config import SpecConfig, Speculation
from engine.speculative.mtp import BatchMTP, MTPSource
from engine.speculative.source import Round


@pytest.fixture(scope="module")
def hybrid():
    model = Engine.load("tiny-qwen35-f32").model
    return model, prompts_for(model, 4)


def batcher(model, policy="fixed", rows=8):
    spec = SpecRows(model, lambda: MTPSource(model), "mtp", NUM_DRAFT, policy)
    return ContinuousBatcher(model, SchedulerConfig(max_rows=rows), spec=spec)


class Steered(BatchMTP):
    """The batched head with the known continuation put in front of its drafts, a different number of right
    drafts per row and round (the head still runs and its cache fills and trims as usual)."""

    spec: SpecRows | None = None
    truth: dict | None = None
    rounds: int = 0

    def propose(self, pending, limits):
        drafts = super().propose(pending, limits)
        out = []
        for b, (row, d) in enumerate(zip(self.spec.rows, drafts)):
            right = self.truth[row.request_id][row.produced : row.produced + (self.rounds + b) % (len(d) + 1)]
            out.append(right + d[len(right) :])
        self.rounds += 1
        return out


def steered_batcher(model, truth):
    head = MTPSource(model)
    steered = Steered(head.head, head.embed, head.logits)
    spec = SpecRows(model, lambda: SimpleNamespace(batched=lambda: steered), "mtp", NUM_DRAFT)
    steered.spec, steered.truth = spec, truth
    return ContinuousBatcher(model, SchedulerConfig(max_rows=8), spec=spec)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_mtp_spec_rows_equal_plain_greedy(hybrid, rows):
    model, prompts = hybrid
    sinks = run(batcher(model), [(0, request(f"r{i}", p), True) for i, p in enumerate(prompts[:rows])])
    for i, p in enumerate(prompts[:rows]):
        s = sinks[f"r{i}"]
        assert s.token_ids == greedy(model, p)[0], f"row {i}"
        assert s.result.lane is Lane.CONTINUOUS and s.result.finish_reason is FinishReason.LENGTH
        assert s.result.spec.kind == "mtp" and s.result.spec.drafted > 0 and s.result.spec.replays == 0


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_steered_mtp_rows_accept_and_reject_and_equal_plain_greedy(hybrid, rows):
    model, prompts = hybrid
    truth = {f"r{i}": greedy(model, p)[0] for i, p in enumerate(prompts[:rows])}
    sinks = run(steered_batcher(model, truth), [(0, request(f"r{i}", p), True) for i, p in enumerate(prompts[:rows])])
    for rid, tokens in truth.items():
        s = sinks[rid].result.spec
        assert sinks[rid].token_ids == tokens, rid
        assert s.accepted > 0 and s.rewinds > 0
        assert s.rounds < STEPS - 1


def test_the_head_cache_holds_each_rows_exact_pairs_of_its_prompt_and_the_tokens_it_generated(hybrid):
    """Mid-run, after rounds that kept 1 .. NUM_DRAFT + 1 tokens per row (and a late joiner): each row's head
    cache and newest output are a fresh head's over the target's hidden states of the row's prompt and fed tokens
    (the prompt's pairs from the batched prefill's hidden states)."""
    model, prompts = hybrid
    truth = {f"r{i}": greedy(model, p)[0] for i, p in enumerate(prompts[:3])}
    b = steered_batcher(model, truth)
    sinks = {rid: CollectingSink() for rid in truth}
    b.submit(request("r0", prompts[0]), sinks["r0"], spec=True)
    b.submit(request("r1", prompts[1]), sinks["r1"], spec=True)
    for step in range(9):
        if step == 3:
            b.submit(request("r2", prompts[2]), sinks["r2"], spec=True)
        b.step()
    spec = b.runner.spec
    head = spec.draft
    head._flush()
    text = model.language_model
    assert len(spec.rows) == 3
    for i, row in enumerate(spec.rows):
        n = len(row.prompt)
        seq = [*row.prompt, *row.fed, row.pending]
        assert len(row.fed) > 1
        hidden = model.hidden(mx.array(seq[:-1])[None], model.make_cache())
        fresh = [KVCache() for _ in text.mtp.layers]
        out = text.mtp(hidden, text.model.embed_tokens(mx.array(seq[1:])[None]), fresh)
        got = [c.extract(i) for c in head.cache]
        for g, f in zip(got, fresh):
            assert g.size() == f.size() == n + len(row.fed)
            for x, y in zip(g.state, f.state):
                np.testing.assert_allclose(np.array(x[..., : g.size(), :]), np.array(y[..., : f.size(), :]), atol=1e-5)
        np.testing.assert_allclose(np.array(head.last[i]), np.array(out[:, -1:]), atol=1e-5)
    while b.has_work:
        b.step()
    for rid, tokens in truth.items():
        assert sinks[rid].token_ids == tokens


def test_mtp_rows_joining_late_and_leaving_early_still_equal(hybrid):
    model, p = hybrid
    arrivals = joining_and_leaving(p)
    b = batcher(model)
    sinks = run(b, arrivals)
    for _, req, _ in arrivals:
        assert sinks[req.request_id].token_ids == greedy(model, req.prompt_ids, req.stop.max_tokens)[0]
    head = b.runner.spec.draft
    assert head.cache is None and head.queued == [] and head.last == []  # the last row left the head too


def test_one_mtp_row_emits_the_serial_spec_lanes_tokens(hybrid):
    model, prompts = hybrid
    setup = Speculation(SpecConfig("mtp", NUM_DRAFT, policy="fixed"), model)
    for prompt in prompts[:2]:
        serial = SpecStats("mtp", NUM_DRAFT)
        lane = [t.token_id for t in setup.generate(prompt, stop=request("x", prompt).stop, stats=serial)]
        sinks = run(batcher(model), [(0, request("r", prompt), True)])
        assert sinks["r"].token_ids == lane
        assert serial.drafted > 0 and sinks["r"].result.spec.drafted > 0


def test_the_adaptive_window_with_mtp_rows_changes_windows_not_tokens(hybrid):
    model, p = hybrid
    for rows in (1, 4):
        check_windows_not_tokens(model, batcher(model, "adaptive"), p, rows)


def test_spec_batch_places_mtp_requests_in_spec_rows(hybrid):
    from engine.gateway import Gateway, GatewayConfig

    model, prompts = hybrid
    setup = Speculation(SpecConfig("mtp", 2), model)
    g = Gateway(model, GatewayConfig(spec_batch=True, prompt_cache_bytes=1 << 20), setup)
    reqs = [request(f"r{i}", q, 12) for i, q in enumerate(prompts[:3])]
    sinks = [CollectingSink() for _ in reqs]
    placements = [g.submit(r, s) for r, s in zip(reqs, sinks)]
    g.run_until_idle()
    for placement, s, r in zip(placements, sinks, reqs):
        assert placement.lane is Lane.CONTINUOUS and placement.spec
        assert "speculative decoding (mtp, up to 2 drafts per round" in placement.reason
        assert "continuous batch" in placement.reason
        assert s.result.lane is Lane.CONTINUOUS and s.result.spec.kind == "mtp" and s.result.spec.rounds > 0
        assert s.token_ids == greedy(model, r.prompt_ids, 12)[0]
    # a second turn starts the target from the prompt cache; the head starts from the generated tokens as ever
    longer = request("again", (*reqs[0].prompt_ids, *sinks[0].token_ids), 12)
    sink = CollectingSink()
    placement = g.submit(longer, sink)
    g.run_until_idle()
    assert placement.spec and placement.cached_tokens > 0 and sink.result.spec.rounds > 0
    assert sink.token_ids == greedy(model, longer.prompt_ids, 12)[0]


def test_a_tiny_concurrent_mtp_run_at_1_and_4_rows():
    from harness.bench.spec import SpecBenchConfig, parse_arms, run_concurrent_bench

    cfg = SpecBenchConfig(prompt_tokens=24, decode_tokens=10, blocks=2, warmup=0, num_draft=2, concurrency=(1, 4))
    for r in run_concurrent_bench("tiny-qwen35-f32", parse_arms("mtp", "tiny-qwen35-f32"), cfg):
        plain, mtp = r.arms
        assert all(mtp.same_tokens) and mtp.spec["kind"] == "mtp" and len(mtp.row_spec) == 2 * r.rows


def test_the_batched_head_given_the_prompts_hidden_states_drafts_what_the_serial_head_drafts(hybrid):
    """BatchMTP driven by hand beside one serial MTPSource per row, both fed the same target hidden states: rounds
    that draft nothing (the pairs queue), partial acceptance, a row joining late and a row leaving; each row's
    drafts are its serial head's."""
    model, prompts = hybrid
    refs = [greedy(model, p)[0] for p in prompts[:3]]
    head = MTPSource(model).batched()
    rows = []  # per row: [reference index, tokens emitted, serial head]

    def join(i):
        hidden = model.hidden(mx.array(prompts[i])[None], model.make_cache())
        serial = MTPSource(model)
        serial.begin(prompts[i])
        serial.observe(hidden[:, :-1], 0)
        serial.commit(Round((prompts[i][-1],), 0, refs[i][0], hidden[:, -1:]))  # token 0, as a round without drafts
        head.join([prompts[i]], [refs[i][0]], [hidden])
        rows.append([i, 1, serial])

    def round(limits, accept):
        drafts = head.propose([refs[i][n - 1] for i, n, _ in rows], limits)
        fed, windows, after = [], [], []
        for (i, n, serial), d, limit, a in zip(rows, drafts, limits, accept):
            assert d == serial.propose(refs[i][n - 1], limit), (i, n)
            f = (refs[i][n - 1], *refs[i][n : n + a], *[1] * (limit - a))  # a right drafts, then wrong ones
            seq = [*prompts[i], *refs[i][: n + limit]]
            start = len(prompts[i]) + n - 1
            hidden = model.hidden(mx.array(seq)[None], model.make_cache())[:, start : start + len(f)]
            serial.commit(Round(f, a, refs[i][n + a], hidden))
            fed.append(f)
            windows.append(mx.pad(hidden, [(0, 0), (0, 1 + max(limits) - len(f)), (0, 0)]))
            after.append(refs[i][n + a])
        head.commit(fed, accept, mx.concatenate(windows), after)
        for row, a in zip(rows, accept):
            row[1] += a + 1

    join(0)
    join(1)
    round([3, 1], [3, 0])
    round([0, 0], [0, 0])  # nothing drafted: the pairs queue
    join(2)
    round([2, 3, 1], [1, 3, 0])
    head.filter([0, 2])  # row 1 leaves
    del rows[1]
    round([3, 2], [2, 1])
    round([1, 3], [0, 3])
    round([3, 3], [0, 0])


def test_an_mtp_rows_head_cache_counts_in_the_kv_budget(hybrid):
    model, prompts = hybrid
    b = batcher(model)
    req = request("r", prompts[0])
    head = model.language_model.mtp.layers[0].self_attn.kv_channels * 4  # f32 keys and values, one layer
    assert b.draft_bytes(req) == head * STEP * -(-(len(prompts[0]) + STEPS + NUM_DRAFT) // STEP) > 0
    sink = CollectingSink()
    b.submit(req, sink, spec=True)
    for _ in range(4):
        b.step()
    assert b.kv_bytes > sum(cache_nbytes(c) for c in (b.runner.cache, b.runner.spec.cache) if c is not None)
    while b.has_work:
        b.step()
    assert sink.token_ids == greedy(model, prompts[0])[0]


def test_an_mtp_row_drafts_what_the_serial_lanes_head_drafts_from_the_prompt_on(hybrid, monkeypatch):
    """Through the batcher, each MTP spec row's head starts from its prompt's pairs (the target's hidden states the
    batched prefill kept over every chunk and the token-0 forward), so with fixed drafts its every round's drafts
    are the serial spec lane's on the same prompt, from the first round on; its tokens are plain greedy's. Rows
    prefilled together in chunks (a short chunk size) and right-padded against each other, and a plain row beside
    them that keeps nothing."""
    model, prompts = hybrid
    serial_drafts = []
    propose = MTPSource.propose

    def record(self, pending, limit):
        drafts = propose(self, pending, limit)
        if drafts:
            serial_drafts[-1].append(drafts)
        return drafts

    monkeypatch.setattr(MTPSource, "propose", record)
    setup = Speculation(SpecConfig("mtp", NUM_DRAFT, policy="fixed"), model)
    lanes = []
    for p in prompts[:3]:
        serial_drafts.append([])
        lanes.append(
            [t.token_id for t in setup.generate(p, stop=request("x", p).stop, stats=SpecStats("mtp", NUM_DRAFT))]
        )
    monkeypatch.setattr(MTPSource, "propose", propose)

    batched_drafts = {f"r{i}": [] for i in range(3)}
    b = ContinuousBatcher(
        model,
        SchedulerConfig(max_rows=8, prefill_chunk=5),
        spec=SpecRows(model, lambda: MTPSource(model), "mtp", NUM_DRAFT, "fixed"),
    )
    head = b.runner.spec.draft
    batch_propose = head.propose

    def record_rows(pending, limits):
        drafts = batch_propose(pending, limits)
        for row, d in zip(b.runner.spec.rows, drafts):
            if d:
                batched_drafts[row.request_id].append(d)
        return drafts

    head.propose = record_rows
    arrivals = [(0, request(f"r{i}", p), True) for i, p in enumerate(prompts[:3])]
    arrivals.append((0, request("plain", prompts[3]), False))
    sinks = run(b, arrivals)
    for i, p in enumerate(prompts[:3]):
        rid = f"r{i}"
        assert sinks[rid].token_ids == lanes[i] == greedy(model, p)[0], rid
        # the lane's first round drafts after the last prompt token (token 0 on); the batch samples token 0 from
        # its token-0 forward. That round rejects its first draft here, so the lane's next rounds are the batch's
        assert serial_drafts[i][0][0] != lanes[i][0], rid
        assert batched_drafts[rid] == serial_drafts[i][1:], rid
        assert len(batched_drafts[rid]) == sinks[rid].result.spec.rounds  # it drafted from its first round on
    assert sinks["plain"].token_ids == greedy(model, prompts[3])[0]
