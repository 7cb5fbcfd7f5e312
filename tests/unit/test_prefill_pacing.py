"""Prefill pacing: beside decoding rows a prompt prefills in pieces that keep their token gaps within the ratio."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_block_snapshots import assert_cut_states

from engine.batch.batcher import ContinuousBatcher
from engine.batch.pacing import DOMINATED, PROBE, SPAN, PacingConfig, PrefillPacer
from engine.batch.scheduler import SchedulerConfig
from engine.loading import load_model
from engine.request import GenerationRequest, SamplingParams, StopCriteria
from engine.sinks import CollectingSink


def test_the_cap_holds_a_prefill_to_the_ratio_of_a_decode_step():
    pacer = PrefillPacer(PacingConfig(ratio=3.0, alpha=1.0))
    assert pacer.cap(rows=2) == 0  # no decode step measured: prefill nothing, so the next gap measures one
    pacer.observe(rows=2, gap_s=0.010, tokens=0)
    assert pacer.cap(rows=2) == 1  # a step, but no prefill cost yet: the smallest piece
    pacer.observe(rows=2, gap_s=0.026, tokens=16)  # 16 tokens cost 16 ms
    assert pacer.cap(rows=2) == 20  # (3 - 1) * 10 ms / 1 ms a token
    assert pacer.cap(rows=4) == 20  # 4 rows unmeasured: 2 rows' step stands in
    assert pacer.cap(rows=1) == 20  # nothing at or below 1 row: the fewest rows above stand in
    pacer.observe(rows=4, gap_s=0.020, tokens=0)
    assert pacer.cap(rows=4) == 40
    assert pacer.cap(rows=4, first_tokens=True) == 20  # token 0's forward takes a decode step of the allowance
    # more prompts waiting than rows decoding: each waiting prompt per row weighs as much as a row's stall
    assert (pacer.cap(rows=4, waiting=4), pacer.cap(rows=4, waiting=12), pacer.cap(rows=4, waiting=0)) == (40, 120, 40)


def test_the_cap_rounds_up_so_fixed_costs_cannot_hold_it_below_the_bound():
    # a prefill forward that costs 55 ms before its first token and 10 ms a token, beside a 50 ms step, ratio 3:
    # the bound (100 ms of prefill) is 4.5 tokens; measured at 1 token (65 ms), truncating would stay at 1
    pacer, caps = PrefillPacer(PacingConfig(ratio=3.0, alpha=1.0)), []
    pacer.observe(1, 0.050, 0)
    tokens = 1
    for _ in range(6):
        pacer.observe(1, 0.050 + 0.055 + 0.010 * tokens, tokens)
        tokens = pacer.cap(1)
        caps.append(tokens)
    assert caps[:4] == [2, 3, 4, 5] and caps[-1] == 5  # within a token of the bound
    assert pacer.cap(1, first_tokens=True) == 3  # (100 - 50) ms / 21 ms a token (105 ms for 5), rounded up
    assert PrefillPacer(PacingConfig(ratio=1.5), {1: 0.05}, 0.01).cap(1, first_tokens=True) == 0  # no room left


gaps = st.lists(st.tuples(st.integers(1, 64), st.floats(1e-4, 1.0), st.integers(0, 4096)), min_size=1, max_size=30)


@given(gaps, st.integers(1, 64), st.integers(0, 200), st.sampled_from([1.5, 2.0, 3.0, 5.0]))
def test_the_cap_grows_with_waiting_prompts_and_shrinks_for_token_0(observed, rows, waiting, ratio):
    pacer = PrefillPacer(PacingConfig(ratio=ratio))
    for r, gap, tokens in observed:
        pacer.observe(r, gap, tokens)
    cap = pacer.cap(rows, waiting)
    d = pacer._step(rows)
    allowance = None if d is None else (ratio - 1) * d * max(1.0, waiting / rows)
    if pacer.least is not None and pacer.least[1] > allowance:  # no piece keeps the bound
        tokens, seconds = pacer.least
        if pacer.token_low is None:  # a larger piece first, to see how the cost grows
            assert cap == SPAN * tokens
            return
        if seconds > DOMINATED * tokens * pacer.token_low:  # fixed costs dominate
            assert cap == (None if pacer.since_least < PROBE else 1)
            return
    more, token_0 = pacer.cap(rows, waiting + rows), pacer.cap(rows, waiting, first_tokens=True)
    assert cap >= 0 and (more is None or more >= cap) and cap >= token_0
    assert (cap == 0) == (not pacer.step_s)  # none only before any decode step is measured (ratio > 1)
    if pacer.token_s:  # the bound: (ratio - 1) d a row's share, within a token
        assert (cap - 1) * pacer.token_s <= allowance + 1e-9


def test_where_the_smallest_prefill_outlasts_the_allowance_whole_chunks_go_and_a_probe_remeasures():
    # a decode step of 10 ms, ratio 3: 20 ms of prefill a gap; the smallest piece (16 tokens) took 60 ms
    pacer = PrefillPacer(PacingConfig(ratio=3.0, alpha=0.5))
    pacer.observe(4, 0.010, 0)
    pacer.observe(4, 0.070, 16)
    assert pacer.least == (16, pytest.approx(0.060)) and pacer.cap(4) == 2 * 16  # a larger one, to compare
    assert pacer.cap(4, waiting=28) == 38  # 7 prompts a row: 140 ms of allowance, pieces (3.75 ms a token)
    pacer.observe(4, 0.072, 32)  # 62 ms for 2x the tokens: the smallest piece's cost is a forward's fixed cost
    assert pacer.token_low == pytest.approx(0.062 / 32) and pacer.cap(4) is None  # no cap: whole chunks
    for _ in range(PROBE - 2):  # whole chunks of 2048 tokens, 300 ms each
        pacer.observe(4, 0.310, 2048)
        assert pacer.cap(4) is None
    pacer.observe(4, 0.310, 2048)
    assert pacer.cap(4) == 1  # the smallest piece again, to measure it anew
    pacer.observe(4, 0.025, 16)  # now 15 ms (the first had compiled a kernel): down at once
    assert pacer.least == (16, pytest.approx(0.015)) and pacer.cap(4) not in (None, 1)
    pacer.observe(4, 0.050, 16)  # up as a blend: (15 + 40) / 2 ms, over the 20 ms allowance again
    assert pacer.least == (16, pytest.approx(0.0275)) and pacer.cap(4) is None
    pacer.observe(4, 0.015, 64)  # a larger prefill that cost 5 ms: the smallest costs no more
    assert pacer.least == (16, pytest.approx(0.005)) and pacer.cap(4) is not None
    record = pacer.as_record()
    assert record["smallest_prefill"] == {"tokens": 16, "ms": 5.0} and record["larger_prefill_token_ms"] > 0


def test_where_pieces_cost_their_tokens_they_still_bound_the_stalls():
    # the same 60 ms for the smallest piece, but 2x the tokens cost 2x as much (a CPU): pieces, not whole chunks
    pacer = PrefillPacer(PacingConfig(ratio=3.0, alpha=1.0))
    pacer.observe(4, 0.010, 0)
    pacer.observe(4, 0.070, 16)
    pacer.observe(4, 0.130, 32)
    assert pacer.token_low == pytest.approx(0.120 / 32)
    assert pacer.cap(4) == 6  # 20 ms at 3.75 ms a token, rounded up: the scheduler's smallest piece


def test_the_estimates_blend_and_a_free_prefill_does_not_divide_by_zero():
    pacer = PrefillPacer(PacingConfig(ratio=2.0, alpha=0.5))
    pacer.observe(1, 0.010, 0)
    pacer.observe(1, 0.020, 0)
    assert pacer.step_s[1] == pytest.approx(0.015)
    pacer.observe(1, 0.010, 8)  # faster than a step alone: free
    assert pacer.token_s == 0.0 and pacer.cap(1) > 10**6
    assert pacer.as_record() == {
        "ratio": 2.0,
        "decode_step_ms": {1: 15.0},
        "prompt_token_ms": 0.0,
        "smallest_prefill": {"tokens": 8, "ms": 0.0},
        "larger_prefill_token_ms": None,
    }
    pacer.forget()
    assert (pacer.step_s, pacer.token_s, pacer.least, pacer.cap(1)) == ({}, None, None, 0)
    with pytest.raises(ValueError, match="ratio"):
        PacingConfig(ratio=1.0)
    with pytest.raises(ValueError, match="alpha"):
        PacingConfig(ratio=2.0, alpha=0.0)


def request(rid, prompt_len, max_tokens):
    prompt = tuple(range(5, 5 + prompt_len))
    return GenerationRequest(rid, prompt, SamplingParams(), StopCriteria(max_tokens=max_tokens, ignore_eos=True))


def run(model, pacing, lead=4, prompt=tuple(range(5, 206)), others=0, forward_s=0.0, **batcher):
    """Row `a` decodes (`lead` iterations in; 1: it takes token 0 as `b` is admitted); `b`, a 201-token prompt,
    joins it. A simulated device: a decode step costs 10 ms and a prompt token 1 ms, a prefill forward
    `forward_s` more (the batcher's clock reads it). The tokens of each row, `b`'s chunks beside `a`, the gaps between `a`'s readbacks, and `b`'s result."""
    now, buckets = [0.0], (8, 16, 32, 64, 128, 256)
    b = ContinuousBatcher(
        model,
        SchedulerConfig(max_rows=8, prefill_chunk=256, prefill_budget=256, chunk_buckets=buckets),
        chunk_buckets=buckets,
        pacing=pacing,
        clock=lambda: now[0],
        **batcher,
    )
    decode, prefill = b.runner.decode, b.runner.prefill
    chunks, reads = [], []

    def timed_decode():
        now[0] += 0.010
        reads.append(now[0])
        return decode()

    def timed_prefill(cs, clear_cache=True):
        now[0] += forward_s + 0.001 * sum(len(c) for c in cs)
        if b.scheduler.running:
            chunks.append(max(len(c) for c in cs) if not others else sum(len(c) for c in cs))
            assert not clear_cache  # the decoding rows' buffers stay cached
        return prefill(cs, clear_cache)

    b.runner.decode, b.runner.prefill = timed_decode, timed_prefill
    sinks = {"a": CollectingSink(), "b": CollectingSink()}
    b.submit(request("a", 7, 40), sinks["a"])
    for _ in range(lead):
        b.step()
    b.submit(GenerationRequest("b", prompt, stop=StopCriteria(max_tokens=4, ignore_eos=True)), sinks["b"])
    for i in range(others):  # more prompts arriving with b
        sinks[f"o{i}"] = CollectingSink()
        b.submit(
            GenerationRequest(f"o{i}", prompt[i:], stop=StopCriteria(max_tokens=2, ignore_eos=True)), sinks[f"o{i}"]
        )
    b.run_until_idle()
    gaps = [y - x for x, y in zip(reads, reads[1:])]
    return {rid: s.token_ids for rid, s in sinks.items()}, chunks, gaps, sinks["b"].result


def test_a_paced_prompt_keeps_the_decoding_row_within_the_ratio(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    plain, plain_chunks, plain_gaps, _ = run(model, None)
    paced, chunks, gaps, _ = run(model, PacingConfig(ratio=2.5, alpha=1.0))
    assert paced == plain  # the same tokens, in smaller prefill pieces
    assert plain_chunks == [200] and max(plain_gaps) == pytest.approx(0.210)  # the whole prompt in one gap
    # 0 (a step measured), 8 (the smallest bucket), then (2.5 - 1) * 10 ms / 1 ms: 15, rounded down to 8
    assert chunks[0] == 8 and set(chunks) == {8}
    assert max(gaps) == pytest.approx(0.018) and max(gaps) <= 2.5 * 0.010
    # `b` admitted in the phase where `a` takes token 0: `a` decodes next, so `b`'s first chunk is paced too
    assert run(model, None, lead=1)[1] == [200]  # (unpaced: all of it before `a`'s first decode step)
    paced, chunks, gaps, _ = run(model, PacingConfig(ratio=2.5, alpha=1.0), lead=1)
    assert paced == plain and set(chunks) == {8} and max(gaps) <= 2.5 * 0.010


def test_where_a_forward_costs_more_than_the_allowance_the_prompt_goes_whole(tiny_path):
    # 100 ms a prefill forward before its first token (a GPU's prompt chunk), ratio 2.5 of a 10 ms step: no piece
    # keeps the bound, and pieces of 8 would take 25 forwards, each stalling the row as long as the first
    model = load_model(tiny_path("tiny-qwen35"))[0]
    plain = run(model, None, forward_s=0.1)
    paced, chunks, gaps, _ = run(model, PacingConfig(ratio=2.5, alpha=1.0), forward_s=0.1)
    assert paced == plain[0] and plain[1] == [200]
    # the smallest piece (108 ms), one of 2x its tokens (116 ms: 108 > 1.5 x 8 x 7.25 ms), the rest in one chunk
    assert chunks == [8, 16, 176]
    assert max(gaps) == pytest.approx(0.010 + 0.1 + 0.176)
    # 10 ms: the piece of 8 (18 ms, over the 15 ms allowance) is 1.4x its tokens at the larger one's rate: pieces
    assert set(run(model, PacingConfig(ratio=2.5, alpha=1.0), forward_s=0.01)[1][2:]) == {8}


def test_paced_pieces_keep_the_block_snapshots_a_cold_prefill_would(tiny_path):
    # A hybrid model's prompt cache keeps a snapshot every 16 tokens from inside the prefill forwards: paced
    # into 8-token pieces beside a decoding row, each still holds the state of the prompt cut there.
    model = load_model(tiny_path("tiny-qwen35-f32"))[0]
    prompt = tuple(3 + (i * 37) % 200 for i in range(101))
    _, chunks, _, result = run(
        model, PacingConfig(ratio=2.5, alpha=1.0), prompt=prompt, keep_caches=True, snapshot_block=16
    )
    assert max(chunks) == 8 and sum(chunks) == 100  # 12 pieces of 8 and the prompt's last 4
    (entry,) = [c for c in result.caches if c.snapshots]
    assert [n for n, _ in entry.snapshots] == list(range(16, 100, 16))
    assert_cut_states(model, prompt, entry.snapshots, bitwise=True)


def test_a_burst_beside_a_lone_decoding_row_is_not_held_to_its_pace(tiny_path):
    # Four prompts wait beside one decoding row: each is weighed against that row's stall, so a prefill may take
    # (2.5 - 1) * 4 decode steps, not 1.5.
    model = load_model(tiny_path("tiny-qwen35"))[0]
    _, chunks, gaps, _ = run(model, PacingConfig(ratio=2.5, alpha=1.0), others=3)
    assert max(chunks) == 32  # the four joiners' pieces together (8 each), beside the row
    assert 0.025 < max(gaps) <= 0.010 + 1.5 * 4 * 0.010
