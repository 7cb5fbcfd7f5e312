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


def test_the_snapshot_follows_a_request_in_and_out_between_its_timed_refreshes(tiny_path, monkeypatch):
    # remade after a step that took a command or ended a request, whatever SNAPSHOT_S: a client polling /stats
    # right after its request never meets the snapshot from before it (idle)
    import threading
    import time

    from engine.request import GenerationRequest, StopCriteria
    from engine.server import worker as worker_module

    monkeypatch.setattr(worker_module, "SNAPSHOT_S", 3600.0)
    worker = EngineWorker(Gateway(load_model(tiny_path("tiny-qwen3"))[0], GatewayConfig(batch=4)))
    seen, done = [], threading.Event()

    class Sink(worker_module.Stream):
        def __init__(self):
            super().__init__(None, "r")

        def put(self, event):
            if len(seen) < 3:  # the engine thread, between its steps: what /stats would read now
                seen.append(worker.snapshot["batch"]["live_requests"])
            if isinstance(event, (worker_module.Ended, worker_module.Rejected)):
                done.set()

    worker.submit(
        GenerationRequest("r", tuple(range(5, 30)), stop=StopCriteria(max_tokens=40, ignore_eos=True)), Sink()
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    assert done.wait(120)
    time.sleep(0.3)  # the loop's idle refresh
    worker.stop()
    thread.join()
    assert 1 in seen  # taken in, refreshed after that step although the timed refresh is an hour away
    assert worker.snapshot["batch"]["live_requests"] == 0 and worker.snapshot["totals"]["completed"] == 1
