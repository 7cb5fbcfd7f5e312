"""A draft model's speculation as spec rows in the continuous batch (speculative/draft_model.py's BatchDraft).

The draft's caches hold every spec row; each step drafts for all rows in [B, 1] greedy steps and rolls each row's
draft cache back to what the target kept. The gate is the one of test_spec_batch.py: on tie-free float32 prompts
every row's greedy output is plain greedy's, whatever the draft proposes.
"""

import dataclasses

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
from engine.batch.scheduler import SchedulerConfig
from engine.batch.spec_rows import SpecRows
from engine.cache import cache_nbytes
from engine.engine import Engine
from engine.request import FinishReason, Lane, SpecStats
from engine.sinks import CollectingSink
from engine.speculative.config import SpecConfig, Speculation
from engine.speculative.draft_model import DraftModelSource

PAIRS = [("tiny-qwen3-f32", "tiny-qwen3-draft-f32"), ("tiny-qwen35-f32", "tiny-qwen35-draft-f32")]


@pytest.fixture(scope="module", params=PAIRS, ids=["dense", "hybrid"])
def pair(request):
    target, draft = (Engine.load(name).model for name in request.param)
    return target, draft, prompts_for(target, 4)


def batcher(target, draft, policy="fixed", rows=8, budget=None):
    spec = SpecRows(target, lambda: DraftModelSource(draft, 2048), "draft", NUM_DRAFT, policy)
    return ContinuousBatcher(target, SchedulerConfig(max_rows=rows, kv_budget_bytes=budget), spec=spec)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_draft_model_spec_rows_equal_plain_greedy(pair, rows):
    target, draft, prompts = pair
    sinks = run(batcher(target, draft), [(0, request(f"r{i}", p), True) for i, p in enumerate(prompts[:rows])])
    accepted = rejected = 0
    for i, p in enumerate(prompts[:rows]):
        s = sinks[f"r{i}"]
        assert s.token_ids == greedy(target, p)[0], f"row {i}"
        assert s.result.lane is Lane.CONTINUOUS and s.result.finish_reason is FinishReason.LENGTH
        assert s.result.spec.kind == "draft" and s.result.spec.replays == 0
        accepted += s.result.spec.accepted
        rejected += s.result.spec.rewinds
    assert accepted > 0 and rejected > 0  # drafts were taken and drafts were dropped


def test_draft_model_rows_joining_late_and_leaving_early_still_equal(pair):
    target, draft, p = pair
    arrivals = joining_and_leaving(p)
    b = batcher(target, draft)
    sinks = run(b, arrivals)
    for _, req, _ in arrivals:
        assert sinks[req.request_id].token_ids == greedy(target, req.prompt_ids, req.stop.max_tokens)[0]
    assert b.runner.spec.draft.cache is None and b.runner.spec.draft.behind == []  # the last row left the draft too


@pytest.mark.parametrize("name", ["tiny-qwen3-f32", "tiny-qwen35-f32"])
def test_a_target_drafting_for_itself_has_every_draft_accepted_in_every_row(name):
    # f32 on the CPU: a [B, 1] draft step and the verify window agree to the last bits, so nothing is rejected.
    model = Engine.load(name).model
    p = prompts_for(model, 3)
    sinks = run(batcher(model, model), [(i, request(f"r{i}", q), True) for i, q in enumerate(p)])
    for i, q in enumerate(p):
        s = sinks[f"r{i}"].result.spec
        assert sinks[f"r{i}"].token_ids == greedy(model, q)[0]
        assert s.accepted == s.drafted > 0 and s.rewinds == 0
        assert s.rounds <= (STEPS - 1 + NUM_DRAFT) // (NUM_DRAFT + 1) + 1  # every round emits num_draft + 1


def test_one_row_emits_the_serial_spec_lanes_tokens_with_the_same_draft(pair):
    target, draft, prompts = pair
    setup = Speculation(SpecConfig("draft", NUM_DRAFT, policy="fixed"), target, draft)
    for prompt in prompts[:2]:
        serial = SpecStats("draft", NUM_DRAFT)
        lane = [t.token_id for t in setup.generate(prompt, stop=request("x", prompt).stop, stats=serial)]
        sinks = run(batcher(target, draft), [(0, request("r", prompt), True)])
        assert sinks["r"].token_ids == lane
        assert serial.accepted > 0 and sinks["r"].result.spec.accepted > 0


def test_the_adaptive_window_with_a_draft_model_changes_windows_not_tokens(pair):
    target, draft, p = pair
    for rows in (1, 4):
        check_windows_not_tokens(target, batcher(target, draft, "adaptive"), p, rows)


# ------------------------------------------------------------------ placement (engine serve --spec-batch)


def test_spec_batch_places_draft_model_requests_in_spec_rows():
    from engine.gateway import Gateway, GatewayConfig
    from engine.sinks import CollectingSink

    target = Engine.load("tiny-qwen3-f32").model
    draft = Engine.load("tiny-qwen3-draft-f32").model
    setup = Speculation(SpecConfig("draft", 2), target, draft, draft_name="tiny-qwen3-draft-f32")
    g = Gateway(target, GatewayConfig(spec_batch=True, prompt_cache_bytes=1 << 20), setup)
    reqs = [request(f"r{i}", p, 12) for i, p in enumerate(prompts_for(target, 3))]
    sinks = [CollectingSink() for _ in reqs]
    placements = [g.submit(r, s) for r, s in zip(reqs, sinks)]
    g.run_until_idle()
    for p, s, r in zip(placements, sinks, reqs):
        assert p.lane is Lane.CONTINUOUS and p.spec
        assert "speculative decoding (draft, up to 2 drafts per round" in p.reason and "continuous batch" in p.reason
        assert s.result.lane is Lane.CONTINUOUS and s.result.spec.kind == "draft" and s.result.spec.rounds > 0
        assert s.token_ids == greedy(target, r.prompt_ids, 12)[0]
    assert (g.active_rows, g.pending_rows, g.has_work) == (0, 0, False)
    # a second turn starts the target from the prompt cache; the draft prefills the whole prompt itself
    longer = request("again", (*reqs[0].prompt_ids, *sinks[0].token_ids), 12)
    sink = CollectingSink()
    placement = g.submit(longer, sink)
    g.run_until_idle()
    assert placement.spec and placement.cached_tokens > 0 and sink.result.spec.rounds > 0
    assert sink.token_ids == greedy(target, longer.prompt_ids, 12)[0]
    # a draft whose caches cannot roll back rows (sliding windows) keeps the spec lane, and says why
    gemma = Engine.load("tiny-gemma3").model
    placement = Gateway(target, GatewayConfig(spec_batch=True), Speculation(SpecConfig("draft"), target, gemma)).place(
        request("w", [5, 6, 7])
    )
    assert placement.lane is Lane.SPEC and not placement.spec
    assert "the draft model's caches (RotatingKVCache) cannot roll back rows" in placement.reason


@pytest.mark.parametrize("name", ["tiny-qwen3-f32", "tiny-qwen35-f32"])
def test_the_batched_draft_follows_every_rows_kept_tokens_through_trims_catch_ups_and_joins(name):
    """The target as its own BatchDraft, driven by hand: whatever each round kept (rounds drafting nothing, so the
    rows fall behind; partial acceptance; a row joining late; a row leaving), its next drafts are plain greedy's."""
    from engine.speculative.draft_model import BatchDraft

    model = Engine.load(name).model
    prompts = prompts_for(model, 3)
    refs = [greedy(model, p)[0] for p in prompts]
    draft = BatchDraft(model, 2048)
    at = []  # per row: (its reference index, how many of its tokens were emitted)

    def join(i):
        draft.join([prompts[i]])
        at.append([i, 1])  # token 0 emitted, pending

    def round(limits, accept):
        pending = [refs[i][n - 1] for i, n in at]
        drafts = draft.propose(pending, limits)
        fed = []
        for (i, n), d, limit, a in zip(at, drafts, limits, accept):
            assert d == refs[i][n : n + limit], (i, n)
            fed.append((refs[i][n - 1], *d))
        draft.commit(fed, [min(a, len(f) - 1) for a, f in zip(accept, fed)])
        for row, f, a in zip(at, fed, accept):
            row[1] += min(a, len(f) - 1) + 1

    join(0)
    join(1)
    round([3, 1], [3, 0])
    round([0, 0], [0, 0])  # nothing drafted: both rows fall behind
    round([0, 0], [0, 0])
    join(2)  # joins while the others are behind
    round([2, 3, 1], [1, 3, 1])  # the backlog fed first, then drafts
    round([0, 0, 0], [0, 0, 0])
    draft.filter([0, 2])  # row 1 leaves
    del at[1]
    round([3, 2], [2, 2])
    round([1, 3], [0, 1])
    assert draft.behind == [[refs[i][n - 2]] for i, n in at]  # one token behind each row's pending one


# ------------------------------------------------------------------ the KV budget


def _dense_pair():
    return Engine.load("tiny-qwen3-f32").model, Engine.load("tiny-qwen3-draft-f32").model


def test_the_kv_budget_counts_a_draft_model_spec_rows_draft_caches():
    """A budget that admits four plain rows admits fewer draft-model spec rows: each projects the draft's caches
    too (the draft's own layout over prompt + max_tokens + the draft window); the batch's bytes hold them."""
    target, draft = _dense_pair()
    prompt, steps = list(range(300, 320)), 8
    probe = batcher(target, draft)
    plain = probe.layout.row_bytes(len(prompt), steps)
    target_bytes = probe.layout.row_bytes(len(prompt), steps + NUM_DRAFT)
    draft_bytes = probe.draft_bytes(request("x", prompt, steps))
    assert draft_bytes == probe.runner.spec.draft.layout.row_bytes(len(prompt), steps + NUM_DRAFT) > 0
    budget = 4 * max(plain, target_bytes)  # four plain rows, or four spec rows without a draft model's caches
    fits = budget // (target_bytes + draft_bytes)
    assert 0 < fits < 4

    b = batcher(target, draft, budget=budget)
    for spec in (False, True):
        sinks = [CollectingSink() for _ in range(4)]
        for i, sink in enumerate(sinks):
            b.submit(request(f"{spec}-{i}", [*prompt[:-1], 400 + i], steps), sink, spec=spec)
        b.step()
        assert (b.active_rows, b.pending_rows) == ((fits, 4 - fits) if spec else (4, 0)), spec
        assert b.scheduler.kv_bytes <= budget
        if spec:
            while not b.runner.spec.num_rows:
                b.step()
            held = b.runner.spec.draft.cache
            assert cache_nbytes(held) > 0 and b.kv_bytes == cache_nbytes(b.runner.spec.cache) + cache_nbytes(held)
        b.run_until_idle()
        assert all(s.result.finish_reason is FinishReason.LENGTH and s.result.generated_tokens == steps for s in sinks)


def test_a_request_whose_draft_caches_can_never_fit_is_refused_naming_the_draft():
    from engine.errors import RequestTooLarge
    from engine.gateway import Gateway, GatewayConfig

    target, draft = _dense_pair()
    setup = Speculation(SpecConfig("draft", NUM_DRAFT), target, draft)
    req = request("big", list(range(300, 320)), 8)
    target_bytes = Gateway(target, GatewayConfig(spec_batch=True), setup).layout.row_bytes(20, 8 + NUM_DRAFT)
    # the target alone fits; the prompt cache on, so the refusal must come before it is asked
    g = Gateway(target, GatewayConfig(spec_batch=True, kv_budget=target_bytes, prompt_cache_bytes=1 << 20), setup)
    need = target_bytes + g.batcher.draft_bytes(req)
    with pytest.raises(RequestTooLarge, match=rf"needs {need:,} bytes .*of them for the draft model's KV cache"):
        g.submit(req, CollectingSink())
    assert (g.pending_rows, g.has_work) == (0, False)
    assert (g.prompt_cache.stats().hits, g.prompt_cache.stats().misses) == (0, 0)


def test_the_full_warmup_keeps_a_draft_model_spec_rows_draft_caches_in_the_kv_budget():
    """A warm-up prompt that fits the budget with the target's caches alone but not with the draft's is left
    out, as a client's would be refused: the start does not fail on it."""
    from engine.gateway import Gateway, GatewayConfig
    from engine.request import GenerationRequest, StopCriteria
    from engine.warmup import warm_up

    target, draft = _dense_pair()
    setup = Speculation(SpecConfig("draft", NUM_DRAFT), target, draft)
    config = GatewayConfig(batch=4, decode_buckets=(1, 2, 4), prefill_buckets=(16, 300), spec_batch=True)
    probe = Gateway(target, config, setup)
    longest = GenerationRequest("probe", (0,) * 301, stop=StopCriteria(max_tokens=2))
    placement = probe.place(longest)
    need, draft_bytes = probe.kv_need(longest, placement)
    assert placement.spec and draft_bytes > 0
    gateway = Gateway(target, dataclasses.replace(config, kv_budget=need), setup)  # the target's alone fit
    stages = warm_up(gateway, "full")
    # the 16-token chunk's prompts (16 tokens and 15 right-padded to them), not the 300-token one's nor the 299's
    assert sum(st.requests for st in stages) == 2 + 4 + 2
