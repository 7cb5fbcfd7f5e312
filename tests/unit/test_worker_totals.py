"""The engine worker's counters: a request's end is published before the end reaches its client."""

from engine.gateway import Gateway, GatewayConfig
from engine.loading import load_model
from engine.request import FinishReason, Lane, RequestResult
from engine.server.worker import EngineWorker


def test_a_requests_end_is_in_the_snapshot_before_the_next_refresh(tiny_path):
    # the worker refreshes its snapshot after each step, but the client may read /metrics or /stats as soon as
    # its response ends (within the step): the totals there already count the request
    worker = EngineWorker(Gateway(load_model(tiny_path("tiny-qwen3"))[0], GatewayConfig()))
    assert worker.snapshot["totals"]["completion_tokens"] == 0 and worker.snapshot["batch"]["gather_ms"] == 0.0
    worker.record_end(RequestResult("r", Lane.SERIAL, FinishReason.LENGTH, prompt_tokens=5, generated_tokens=8))
    assert worker.snapshot["totals"]["completion_tokens"] == 8 and worker.snapshot["totals"]["completed"] == 1
    assert "batch" in worker.snapshot  # the rest of the snapshot stays


def test_the_snapshot_says_the_prefill_budgets(tiny_path):
    config = GatewayConfig(prefill_budget=512, idle_prefill_budget=1024)
    batch = EngineWorker(Gateway(load_model(tiny_path("tiny-qwen3"))[0], config)).snapshot["batch"]
    assert (batch["prefill_budget"], batch["idle_prefill_budget"]) == (512, 1024)
