"""The scheduler's decisions, without a model or MLX."""

import subprocess
import sys

import pytest

from engine.batch.kv_budget import KVLayout, LayerKV
from engine.batch.scheduler import JoinerAction, RequestTooLarge, Scheduler, SchedulerConfig, SeqStatus
from engine.types import FinishReason, GeneratedToken, GenerationRequest, StopCriteria


def make_request(rid="r", prompt_len=5, max_tokens=4, **stop):
    return GenerationRequest(rid, tuple(range(1, prompt_len + 1)), stop=StopCriteria(max_tokens=max_tokens, **stop))


def make_scheduler(**overrides):
    return Scheduler(SchedulerConfig(**overrides))


def _join(s, rid, prompt_len=5, max_tokens=4, kv_bytes=0, **stop):
    s.submit(make_request(rid, prompt_len, max_tokens, **stop), kv_bytes)
    while True:
        work = s.joiner_work()
        if work.action is JoinerAction.FIRST_TOKEN:
            return s.on_first_token(GeneratedToken(100))
        s.on_prefilled(len(work.tokens))


def test_scheduler_module_does_not_import_mlx():
    code = "import sys, engine.batch.scheduler, engine.batch.kv_budget, engine.types; sys.exit(any(m.startswith('mlx') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prompt_is_prefilled_in_chunks_then_the_last_token_gives_token0():
    s = make_scheduler(prefill_chunk=4)
    s.submit(make_request("a", prompt_len=10), 0)
    chunks = []
    work = s.joiner_work()
    assert work.is_new
    while work.action is JoinerAction.PREFILL:
        chunks.append(work.tokens)
        s.on_prefilled(len(work.tokens))
        work = s.joiner_work()
    assert chunks == [(1, 2, 3, 4), (5, 6, 7, 8), (9,)]
    assert work.tokens == (10,)
    emitted, joins = s.on_first_token(GeneratedToken(42))
    assert joins and [t.token_id for t in emitted] == [42] and s.running[0].status is SeqStatus.RUNNING


def test_fifo_one_joiner_at_a_time_and_row_cap():
    s = make_scheduler(max_rows=2)
    for rid in "abc":
        s.submit(make_request(rid, prompt_len=1), 0)
    order = []
    for _ in range(5):
        work = s.joiner_work()
        if work is None:
            break
        order.append(work.seq.request_id)
        s.on_first_token(GeneratedToken(7))
    assert order == ["a", "b"] and s.pending_rows == 1  # "c" waits for a free row


def test_token0_is_not_emitted_twice():
    s = make_scheduler()
    _join(s, "a", max_tokens=3)
    out = s.on_decoded([GeneratedToken(100)])  # the register echoes token 0 back
    assert out.emissions == () and out.keep == (0,)
    out = s.on_decoded([GeneratedToken(5)])
    assert [t.token_id for t in out.emissions[0].tokens] == [5]


def test_rows_finish_and_leave_while_others_continue():
    s = make_scheduler()
    _join(s, "short", max_tokens=2)
    _join(s, "long", max_tokens=5)
    s.on_decoded([GeneratedToken(1), GeneratedToken(1)])  # echoes of token 0
    out = s.on_decoded([GeneratedToken(2), GeneratedToken(2)])
    assert [q.request_id for q in out.finished] == ["short"] and out.keep == (1,)
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
    assert s.joiner_work() is None and s.pending_rows == 2
    s.on_decoded([GeneratedToken(1)])
    s.cancel("big")
    gone, keep = s.cancelled_rows()
    assert [g.request_id for g in gone] == ["big"] and keep == ()
    assert s.joiner_work().seq.request_id == "needs60"


def test_a_request_larger_than_the_whole_budget_is_rejected():
    s = make_scheduler(kv_budget_bytes=1000)
    with pytest.raises(RequestTooLarge, match="needs 5,000 bytes.*budget is 1,000"):
        s.submit(make_request(), 5000)
    assert s.pending_rows == 0


def test_hold_admission_lets_the_batch_drain():
    s = make_scheduler()
    s.submit(make_request("a", prompt_len=1), 0)
    s.hold_admission = True
    assert s.joiner_work() is None and not s.has_work
    s.hold_admission = False
    assert s.joiner_work() is not None


def test_cancel_queued_joiner_and_running_rows_counts_return_to_zero():
    s = make_scheduler()
    _join(s, "run")
    s.submit(make_request("join", prompt_len=50), 0)
    s.joiner_work()
    s.submit(make_request("queued"), 0)
    assert (s.active_rows, s.pending_rows) == (2, 1)
    assert s.cancel("queued").status is SeqStatus.DONE and s.pending_rows == 0
    s.cancel("join")
    s.drop_joiner(FinishReason.CANCELLED)
    s.cancel("run")
    gone, keep = s.cancelled_rows()
    assert [g.request_id for g in gone] == ["run"] and keep == ()
    assert (s.active_rows, s.pending_rows, s.has_work) == (0, 0, False)
    assert s.cancel("nope") is None


def test_kv_projection_per_layer_kind():
    layout = KVLayout((LayerKV("kv", bytes_per_token=10), LayerKV("rotating", bytes_per_token=10, window=64),
                       LayerKV("recurrent", fixed_bytes=1000)))
    # growing KV rounds up to 256-token steps; rotating stops at the window; recurrent is fixed
    assert layout.row_bytes(100, 100) == 10 * 256 + 10 * 64 + 1000
    assert layout.row_bytes(10, 10) == 10 * 256 + 10 * 20 + 1000
