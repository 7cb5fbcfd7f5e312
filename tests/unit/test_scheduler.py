"""The scheduler's decisions, without a model or MLX."""

import subprocess
import sys

import pytest

from engine.batch.kv_budget import KVLayout, LayerKV
from engine.batch.scheduler import RequestTooLarge, Scheduler, SchedulerConfig, SeqStatus
from engine.request import FinishReason, GeneratedToken, GenerationRequest, StopCriteria


def make_request(rid="r", prompt_len=5, max_tokens=4, **stop):
    return GenerationRequest(rid, tuple(range(1, prompt_len + 1)), stop=StopCriteria(max_tokens=max_tokens, **stop))


def make_scheduler(**overrides):
    return Scheduler(SchedulerConfig(**overrides))


def _join(s, rid, prompt_len=5, max_tokens=4, kv_bytes=0, **stop):
    """Submit and drive one request until its token 0 (100): returns (emitted, joins)."""
    s.submit(make_request(rid, prompt_len, max_tokens, **stop), kv_bytes)
    while True:
        plan = s.schedule_prefill()
        if plan.first_tokens:
            (first,) = s.update_first_tokens({rid: GeneratedToken(100)})
            return first.tokens, first.joins
        s.update_prefill(plan)


def test_scheduler_module_does_not_import_mlx():
    code = "import sys, engine.batch.scheduler, engine.batch.kv_budget, engine.request, engine.stopping, engine.sinks; sys.exit(any(m.startswith('mlx') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prompt_is_prefilled_in_chunks_then_the_last_token_gives_token0():
    s = make_scheduler(prefill_chunk=4)
    s.submit(make_request("a", prompt_len=10), 0)
    chunks = []
    plan = s.schedule_prefill()
    assert [q.request_id for q in plan.admitted] == ["a"]
    while not plan.first_tokens:
        chunks += [c for _, c in plan.chunks]
        s.update_prefill(plan)
        plan = s.schedule_prefill()
    assert chunks == [(1, 2, 3, 4), (5, 6, 7, 8), (9,)]
    (first,) = s.update_first_tokens({"a": GeneratedToken(42)})
    assert first.joins and [t.token_id for t in first.tokens] == [42] and s.running[0].status is SeqStatus.RUNNING


def test_prefill_group_admits_fifo_up_to_its_size_and_the_row_cap():
    s = make_scheduler(max_rows=3, prefill_batch=2)
    for rid, n in zip("abcd", (9, 3, 1, 1)):
        s.submit(make_request(rid, prompt_len=n), 0)
    plan = s.schedule_prefill()
    assert [q.request_id for q in plan.admitted] == ["a", "b"]  # the group is full at 2
    assert [(q.request_id, len(c)) for q, c in plan.chunks] == [("a", 8), ("b", 2)]
    s.update_prefill(plan)
    plan = s.schedule_prefill()  # both prompts are through: token 0 for both, nobody new yet
    assert [q.request_id for q in plan.first_tokens] == ["a", "b"] and not plan.admitted
    s.update_first_tokens({"a": GeneratedToken(7), "b": GeneratedToken(8)})
    plan = s.schedule_prefill()  # one row left under the cap of 3
    assert [q.request_id for q in plan.admitted] == ["c"] and s.pending_rows == 1


def test_one_joiner_at_a_time_with_prefill_batch_1():
    s = make_scheduler(max_rows=2, prefill_batch=1)
    for rid in "abc":
        s.submit(make_request(rid, prompt_len=1), 0)
    order = []
    for _ in range(5):
        plan = s.schedule_prefill()
        if not plan.first_tokens:
            break
        order += [q.request_id for q in plan.first_tokens]
        s.update_first_tokens({q.request_id: GeneratedToken(7) for q in plan.first_tokens})
    assert order == ["a", "b"] and s.pending_rows == 1  # "c" waits for a free row


def test_with_kv_groups_a_fresh_prompt_waits_until_the_group_has_run_no_chunk():
    s = make_scheduler(prefill_chunk=4, kv_groups=True)
    s.submit(make_request("a", prompt_len=9), 0)  # two chunks of 4, then token 0
    s.update_prefill(s.schedule_prefill())  # "a" ran a chunk (with quantized KV its caches are quantized now)
    s.submit(make_request("b", prompt_len=3), 0)
    plan = s.schedule_prefill()
    assert not plan.admitted and [q.request_id for q, _ in plan.chunks] == ["a"]
    s.update_prefill(plan)
    plan = s.schedule_prefill()  # "a" takes token 0 now: it still holds the group this step
    assert [q.request_id for q in plan.first_tokens] == ["a"] and not plan.admitted
    s.update_first_tokens({"a": GeneratedToken(7)})
    assert [q.request_id for q in s.schedule_prefill().admitted] == ["b"]  # a group of its own


def test_with_kv_groups_a_cached_prompt_joins_only_a_quantized_group():
    s = make_scheduler(prefill_chunk=4, kv_groups=True)
    s.submit(make_request("fresh", prompt_len=9), 0)
    s.submit(make_request("hit", prompt_len=9), 0, cached=4)  # its cached prefix is quantized already
    plan = s.schedule_prefill()
    assert [q.request_id for q in plan.admitted] == ["fresh"]  # "hit" waits: this group's first chunk is fresh
    s.update_prefill(plan)
    plan = s.schedule_prefill()  # "fresh" ran a chunk: the group is quantized, "hit" joins it
    assert [q.request_id for q in plan.admitted] == ["hit"]
    assert [(q.request_id, len(c)) for q, c in plan.chunks] == [("fresh", 4), ("hit", 4)]
    s2 = make_scheduler(prefill_chunk=4, kv_groups=True)
    s2.submit(make_request("hit", prompt_len=9), 0, cached=4)
    s2.submit(make_request("fresh", prompt_len=9), 0)
    assert [q.request_id for q in s2.schedule_prefill().admitted] == ["hit"]  # the fresh one waits its turn


def test_token0_is_not_emitted_twice():
    s = make_scheduler()
    _join(s, "a", max_tokens=3)
    out = s.update_decode({"a": GeneratedToken(100)})  # the register echoes token 0 back
    assert out.emissions == () and out.finished == ()
    out = s.update_decode({"a": GeneratedToken(5)})
    assert [t.token_id for t in out.emissions[0].tokens] == [5]


def test_rows_finish_and_leave_while_others_continue():
    s = make_scheduler()
    _join(s, "short", max_tokens=2)
    _join(s, "long", max_tokens=5)
    s.update_decode({"short": GeneratedToken(1), "long": GeneratedToken(1)})  # echoes of token 0
    out = s.update_decode({"short": GeneratedToken(2), "long": GeneratedToken(2)})
    assert [q.request_id for q in out.finished] == ["short"] and s.schedule_decode().rows == ("long",)
    assert out.finished[0].finish_reason is FinishReason.LENGTH
    assert [q.request_id for q in s.running] == ["long"]


def test_a_row_that_finishes_at_token0_never_joins():
    s = make_scheduler()
    emitted, joins = _join(s, "one", max_tokens=1)
    assert not joins and emitted[-1].finish_reason is FinishReason.LENGTH
    assert s.running == [] and s.active_rows == 0


def test_eos_at_token0_never_joins():
    s = make_scheduler()
    emitted, joins = _join(s, "eos", eos_ids=frozenset([100]))
    assert not joins and emitted[-1].is_stop and emitted[-1].finish_reason is FinishReason.STOP


def test_budget_holds_the_queue_head_and_never_reorders():
    s = make_scheduler(kv_budget_bytes=100)
    _join(s, "big", kv_bytes=70)
    s.submit(make_request("needs60"), 60)
    s.submit(make_request("needs10"), 10)  # would fit, but FIFO keeps it behind
    assert s.schedule_prefill().is_empty and s.pending_rows == 2
    s.update_decode({"big": GeneratedToken(1)})
    s.cancel("big")
    plan = s.schedule_decode()
    assert [g.request_id for g in plan.evicted] == ["big"] and plan.rows == ()
    assert [q.request_id for q in s.schedule_prefill().admitted] == ["needs60", "needs10"]


def test_a_request_larger_than_the_whole_budget_is_rejected():
    s = make_scheduler(kv_budget_bytes=1000)
    with pytest.raises(RequestTooLarge, match="needs 5,000 bytes.*budget is 1,000"):
        s.submit(make_request(), 5000)
    assert s.pending_rows == 0
    # a spec row's projection with its draft model's caches says how much of it is the draft's
    with pytest.raises(RequestTooLarge, match=r"needs 1,200 bytes.*, 300 of them for the draft model's KV cache\)"):
        s.submit(make_request(), 1200, spec=True, draft_bytes=300)
    assert s.pending_rows == 0


def test_hold_admission_lets_the_batch_drain():
    s = make_scheduler()
    s.submit(make_request("a", prompt_len=1), 0)
    s.hold_admission = True
    assert s.schedule_prefill().is_empty and not s.has_work
    s.hold_admission = False
    assert s.schedule_prefill().admitted


def test_cancel_queued_joiner_and_running_rows_counts_return_to_zero():
    s = make_scheduler()
    _join(s, "run")
    s.submit(make_request("join", prompt_len=50), 0)
    s.schedule_prefill()
    s.hold_admission = True
    s.submit(make_request("queued"), 0)
    assert (s.active_rows, s.pending_rows) == (2, 1)
    assert s.cancel("queued").status is SeqStatus.DONE and s.pending_rows == 0
    s.cancel("join")
    plan = s.schedule_prefill()
    assert [g.request_id for g in plan.evicted] == ["join"] and plan.is_empty and s.joiners == []
    s.cancel("run")
    plan = s.schedule_decode()
    assert [g.request_id for g in plan.evicted] == ["run"] and plan.rows == ()
    assert (s.active_rows, s.pending_rows, s.has_work) == (0, 0, False)
    assert s.cancel("nope") is None


def test_kv_projection_per_layer_kind():
    layout = KVLayout(
        (
            LayerKV("kv", bytes_per_token=10),
            LayerKV("rotating", bytes_per_token=10, window=64),
            LayerKV("recurrent", fixed_bytes=1000),
        )
    )
    # growing KV rounds up to 256-token steps; rotating stops at the window; recurrent is fixed
    assert layout.row_bytes(100, 100) == 10 * 256 + 10 * 64 + 1000
    assert layout.row_bytes(10, 10) == 10 * 256 + 10 * 20 + 1000


def test_joiners_take_the_idle_budget_only_while_no_row_decodes():
    s = make_scheduler(max_rows=4, prefill_batch=2, prefill_chunk=16, prefill_budget=8, idle_prefill_budget=16)
    for rid in "ab":
        s.submit(make_request(rid, prompt_len=20), 0)
    plan = s.schedule_prefill()  # nothing decodes: 16 tokens shared
    assert [len(c) for _, c in plan.chunks] == [8, 8]
    s.update_prefill(plan)
    plan = s.schedule_prefill()
    assert [len(c) for _, c in plan.chunks] == [8, 8]
    s.update_prefill(plan)
    plan = s.schedule_prefill()
    assert [len(c) for _, c in plan.chunks] == [3, 3]  # 19 tokens each before the last
    s.update_prefill(plan)
    plan = s.schedule_prefill()  # both through: token 0, then they decode
    assert [q.request_id for q in plan.first_tokens] == ["a", "b"] and not plan.chunks
    s.update_first_tokens({"a": GeneratedToken(100), "b": GeneratedToken(100)})
    for rid in "cd":
        s.submit(make_request(rid, prompt_len=20), 0)
    plan = s.schedule_prefill()  # "a" and "b" decode beside these: the budget's 8 tokens shared
    assert [(q.request_id, len(c)) for q, c in plan.chunks] == [("c", 4), ("d", 4)]
