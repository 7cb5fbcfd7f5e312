"""Requests reaching an idle engine are gathered for a moment (`EngineWorker.gather_s`, `engine serve --gather-ms`), so
a burst that the HTTP thread hands over one request at a time starts as one prefill group."""

import threading
import time

import pytest

from engine.gateway import Gateway, GatewayConfig
from engine.kernels import EXACT, FAST
from engine.loading import load_model
from engine.request import GenerationRequest, StopCriteria
from engine.server.main import ServeConfig
from engine.server.worker import FAST_GATHER_MS, Arrival, Ended, EngineWorker, Rejected, Stream

STOP = StopCriteria(max_tokens=2, ignore_eos=True)


class Recorder(Stream):
    """A request's stream that keeps its events in a list (no event loop)."""

    def __init__(self, request_id: str):
        super().__init__(None, request_id)
        self.kept = []

    def put(self, event):
        self.kept.append(event)


def prefill_groups(tiny_path, gather_s: float, late_s: float = 0.02, announced: bool = False) -> list[int]:
    """The prefill groups (joiners a forward) of four requests, the first alone at an idle worker and three more
    `late_s` after it, all on the continuous lane; `announced`: the three on their way (`EngineWorker.arriving`)
    from before the first is submitted, as the HTTP layer marks requests it is still reading."""
    gateway = Gateway(load_model(tiny_path("tiny-qwen3"))[0], GatewayConfig(batch=8, prefill_batch=8))
    worker = EngineWorker(gateway, gather_s=gather_s)
    streams = [Recorder(f"r{i}") for i in range(4)]

    def submit(i: int) -> None:
        worker.submit(GenerationRequest(f"r{i}", tuple(range(5 + i, 30 + i)), stop=STOP), streams[i])

    arrivals = [worker.arriving() for _ in range(3)] if announced else []

    def later() -> None:
        time.sleep(late_s)
        for i in range(1, 4):
            submit(i)
            if arrivals:
                arrivals[i - 1].done()
        deadline = time.monotonic() + 120  # a request refused or stuck ends the test, not the run
        while time.monotonic() < deadline and not all(
            r.kept and isinstance(r.kept[-1], (Ended, Rejected)) for r in streams
        ):
            time.sleep(0.01)
        worker.stop()

    submit(0)
    thread = threading.Thread(target=later)
    thread.start()
    worker.run()
    thread.join()
    assert all(isinstance(r.kept[-1], Ended) for r in streams), [r.kept[-1:] for r in streams]
    return sorted(shape[1] for shape in gateway.batcher.shapes if shape[0] == "prefill")


@pytest.mark.parametrize("gather_s,groups", [(0.0, [1, 3]), (0.25, [4])])
def test_a_burst_handed_over_one_by_one_prefills_together_when_gathered(tiny_path, gather_s, groups):
    # without gathering the first request prefills alone and the rest join a second group; gathered (the quiet
    # gap longer than the arrivals' spread), the four share one forward
    assert prefill_groups(tiny_path, gather_s) == groups


def test_gathering_is_the_fast_tier_s_default():
    assert ServeConfig(model="m").gather_seconds(FAST) == FAST_GATHER_MS / 1e3
    assert ServeConfig(model="m").gather_seconds(EXACT) == 0.0  # mlx_lm.server's groups, for the same-B oracle
    assert ServeConfig(model="m", gather_ms=0.0).gather_seconds(FAST) == 0.0
    assert ServeConfig(model="m", gather_ms=5.0).gather_seconds(EXACT) == 0.005


@pytest.mark.parametrize("announced,groups", [(False, [1, 3]), (True, [4])])
def test_a_gathering_waits_for_requests_still_on_their_way(tiny_path, announced, groups):
    # a quiet gap of 5 ms ends the gathering before requests 60 ms late, unless the HTTP layer has said they are
    # coming (their bodies still being read): then it waits for them, within GATHER_SPAN gaps (250 ms here)
    assert prefill_groups(tiny_path, 0.005, late_s=0.06, announced=announced) == groups


def test_an_arrival_is_done_once():
    # done after its submit, then again at the end of the handler's `with`: one request leaves the count once
    class Worker:
        left = 0

        def _arrived(self):
            self.left += 1

    worker = Worker()
    with Arrival(worker) as arrival:
        arrival.done()
    assert worker.left == 1
