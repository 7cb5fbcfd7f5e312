"""Failures and cancellations stay with the request they belong to, and no row leaks."""

import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.errors import RequestTooLarge
from engine.generate import generate
from engine.loading import load_model
from engine.request import FinishReason, GenerationRequest, StopCriteria
from engine.sinks import CollectingSink


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path("tiny-qwen35"))[0]


def make_request(rid, prompt_len=20, max_tokens=8):
    return GenerationRequest(
        rid, tuple(range(3, 3 + prompt_len)), stop=StopCriteria(max_tokens=max_tokens, ignore_eos=True)
    )


def serial_ids(model, req):
    return [t.token_id for t in generate(model, req.prompt_ids, stop=req.stop)]


class FailingSink(CollectingSink):
    def __init__(self, fail_at, mode="raise"):
        super().__init__()
        self.fail_at, self.mode = fail_at, mode

    def on_token(self, token):
        super().on_token(token)
        if len(self.tokens) == self.fail_at:
            if self.mode == "raise":
                raise RuntimeError("client socket closed")
            return False
        return True


def _idle(b):
    assert (b.active_rows, b.pending_rows, b.has_work, b.runner.num_rows) == (0, 0, False, 0)


@pytest.mark.parametrize("mode,reason", [("raise", FinishReason.ERROR), ("gone", FinishReason.CANCELLED)])
def test_a_failing_consumer_removes_only_its_row(model, mode, reason):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4))
    reqs = [make_request(f"r{i}", 10 + 7 * i, 12) for i in range(3)]
    sinks = [CollectingSink(), FailingSink(3, mode), CollectingSink()]
    for r, s in zip(reqs, sinks):
        b.submit(r, s)
    b.run_until_idle()
    assert sinks[1].result.finish_reason is reason and len(sinks[1].tokens) == 3
    for i in (0, 2):
        assert sinks[i].result.finish_reason is FinishReason.LENGTH
        assert sinks[i].token_ids == serial_ids(model, reqs[i])
    _idle(b)


def test_cancelling_queued_prefilling_and_running_requests(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=2, prefill_chunk=8))
    sinks = {rid: CollectingSink() for rid in ("run", "joiner", "queued")}
    b.submit(make_request("run", 5, 50), sinks["run"])
    b.step()
    b.step()  # "run" is decoding
    b.submit(make_request("joiner", 40, 5), sinks["joiner"])
    b.submit(make_request("queued"), sinks["queued"])
    b.step()  # "joiner" starts its chunked prefill
    assert b.cancel("queued") and sinks["queued"].result.finish_reason is FinishReason.CANCELLED
    assert b.cancel("joiner") and b.cancel("run")
    b.run_until_idle()
    for s in sinks.values():
        assert s.result.finish_reason is FinishReason.CANCELLED
    assert not b.cancel("run")
    _idle(b)


def test_a_forward_error_fails_the_batch_and_the_loop_keeps_serving(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4))
    a, c = CollectingSink(), CollectingSink()
    b.submit(make_request("a", 6, 20), a)
    b.run_until_idle(max_steps=3)
    real = b.runner.decode

    def boom():
        b.runner.decode = real
        raise RuntimeError("device lost")

    b.runner.decode = boom
    b.step()
    assert a.result.finish_reason is FinishReason.ERROR and "device lost" in a.result.error
    assert b.runner.num_rows == 0 and b.runner.cache is None
    later = make_request("later", 9, 6)
    b.submit(later, c)
    b.run_until_idle()
    assert c.result.finish_reason is FinishReason.LENGTH and c.token_ids == serial_ids(model, later)
    _idle(b)


def test_a_prefill_error_fails_only_the_joiners_of_that_prefill(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4))
    ok, bad1, bad2, later = CollectingSink(), CollectingSink(), CollectingSink(), CollectingSink()
    b.submit(make_request("ok", 8, 10), ok)
    b.run_until_idle(max_steps=3)
    real = b.runner.prefill

    def boom(chunks, clear_cache=True):
        b.runner.prefill = real
        raise MemoryError("prefill out of memory")

    b.runner.prefill = boom
    b.submit(make_request("bad1", 30, 10), bad1)
    b.submit(make_request("bad2", 20, 10), bad2)
    b.step()
    b.submit(make_request("later", 12, 5), later)
    b.run_until_idle()
    for s in (bad1, bad2):
        assert s.result.finish_reason is FinishReason.ERROR and "out of memory" in s.result.error
    assert ok.result.finish_reason is FinishReason.LENGTH and ok.token_ids == serial_ids(
        model, make_request("ok", 8, 10)
    )
    assert later.token_ids == serial_ids(model, make_request("later", 12, 5))
    _idle(b)


def test_cancelling_one_joiner_of_a_group_leaves_the_other_intact(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4, prefill_chunk=8))
    keep, drop = CollectingSink(), CollectingSink()
    b.submit(make_request("keep", 30, 6), keep)
    b.submit(make_request("drop", 40, 6), drop)
    b.step()  # both in the prefill group, first chunks done
    b.cancel("drop")
    b.run_until_idle()
    assert drop.result.finish_reason is FinishReason.CANCELLED
    assert keep.token_ids == serial_ids(model, make_request("keep", 30, 6))
    _idle(b)


def test_max_tokens_one_finishes_at_token0_without_joining(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4), keep_caches=True)
    sink = CollectingSink()
    b.submit(make_request("one", 12, 1), sink)
    b.step()  # prefill
    b.step()  # token 0: done, never joins
    assert len(sink.tokens) == 1 and sink.result.finish_reason is FinishReason.LENGTH
    assert b.runner.num_rows == 0 and len(sink.result.caches) == 2  # prompt boundary + final (recurrent model)
    _idle(b)


def test_budget_rejects_the_impossible_and_queues_the_rest(model):
    layout_bytes = ContinuousBatcher(model).layout.row_bytes(20, 8)
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4, kv_budget_bytes=layout_bytes + 1))
    with pytest.raises(RequestTooLarge):
        b.submit(make_request("huge", 20, 10_000), CollectingSink())
    first, second = CollectingSink(), CollectingSink()
    b.submit(make_request("first"), first)
    b.submit(make_request("second"), second)
    b.run_until_idle(max_steps=4)
    assert b.active_rows == 1 and b.pending_rows == 1  # the second waits for the budget
    b.run_until_idle()
    assert first.result.finish_reason is second.result.finish_reason is FinishReason.LENGTH
    _idle(b)


def test_finished_rows_hand_back_their_caches(model):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4), keep_caches=True)
    sinks = [CollectingSink(), CollectingSink()]
    b.submit(make_request("a", 9, 4), sinks[0])
    b.submit(make_request("b", 30, 6), sinks[1])
    b.run_until_idle()
    for s, (n, m) in zip(sinks, [(9, 4), (30, 6)]):
        boundary, prefix = s.result.caches
        assert boundary.tokens == make_request(s.result.request_id, n, m).prompt_ids[:-1]
        # prompt + every emitted token went through the model (the last one in the launched step)
        assert len(prefix.tokens) == prefix.cache[3].offset == n + m and prefix.cache[0].state[1].shape[0] == 1
        assert prefix.tokens == make_request(s.result.request_id, n, m).prompt_ids + tuple(s.token_ids)


def test_batched_rows_report_logprobs_when_asked(model):
    from engine.request import SamplingParams

    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4))
    plain, rich = CollectingSink(), CollectingSink()
    b.submit(make_request("plain", 10, 5), plain)
    req = make_request("rich", 14, 5)
    b.submit(GenerationRequest("rich", req.prompt_ids, SamplingParams(top_logprobs=3), req.stop), rich)
    b.run_until_idle()
    assert all(t.logprob is None for t in plain.tokens)
    for t in rich.tokens:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob
        assert t.token_id in {x.token_id for x in t.top_logprobs if x.logprob == t.logprob}
    assert rich.token_ids == serial_ids(model, req)
