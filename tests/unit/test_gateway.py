import pytest

from engine.gateway import Gateway, GatewayConfig, _Queued
from engine.generate import KVQuantization
from engine.loading import load_model
from engine.request import FinishReason, GenerationRequest, Lane, StopCriteria
from engine.sinks import CollectingSink


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path("tiny-llama"))[0]


def make_request(rid, n=12, max_tokens=6):
    return GenerationRequest(rid, tuple(range(5, 5 + n)), stop=StopCriteria(max_tokens=max_tokens, ignore_eos=True))


def test_batch_1_pins_serial_and_reports_the_lane(model):
    g = Gateway(model, GatewayConfig(batch=1))
    sink = CollectingSink()
    placement = g.submit(make_request("a"), sink)
    g.run_until_idle()
    assert placement.lane is Lane.SERIAL and "--batch 1" in placement.reason
    assert sink.result.lane is Lane.SERIAL and sink.result.finish_reason is FinishReason.LENGTH


def test_default_batch_places_continuous(model):
    g = Gateway(model)
    sinks = [CollectingSink() for _ in range(3)]
    placements = [g.submit(make_request(f"r{i}", 10 + i), s) for i, s in enumerate(sinks)]
    g.run_until_idle()
    assert all(p.lane is Lane.CONTINUOUS for p in placements)
    assert all(s.result.lane is Lane.CONTINUOUS and len(s.token_ids) == 6 for s in sinks)
    assert (g.active_rows, g.pending_rows, g.has_work) == (0, 0, False)


def test_delayed_quantized_kv_runs_serial_unchanged_with_its_reason(model):
    g = Gateway(model, GatewayConfig(batch=8, kv_quantization=KVQuantization(bits=8, group_size=32, start=100)))
    sink = CollectingSink()
    placement = g.submit(make_request("q"), sink)
    g.run_until_idle()
    assert placement.lane is Lane.SERIAL and "quantized KV starting after 100" in placement.reason
    assert sink.result.lane is Lane.SERIAL and len(sink.token_ids) == 6


def test_a_waiting_serial_request_drains_the_batch_first(model):
    g = Gateway(model)
    order = []

    class Recorder(CollectingSink):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def on_end(self, result):
            super().on_end(result)
            order.append(self.name)

    batch = [Recorder(f"b{i}") for i in range(2)]
    for i, s in enumerate(batch):
        g.submit(make_request(f"b{i}", 8, 6 + 4 * i), s)
    g.step()
    g._serial.append(
        _Queued(make_request("serial", 8, 4), Recorder("serial"), None)
    )  # a request only the serial lane runs
    late = Recorder("late")
    g.submit(make_request("late", 8, 3), late)
    g.run_until_idle()
    assert order.index("serial") > order.index("b0") and order.index("serial") < order.index("late")


def test_cancelling_a_queued_serial_request(model):
    g = Gateway(model, GatewayConfig(batch=1))
    sink = CollectingSink()
    g.submit(make_request("x"), sink)
    assert g.cancel("x") and sink.result.finish_reason is FinishReason.CANCELLED and not g.has_work


# ------------------------------------------------------------------ spec lane


def _speculation(model, kind="ngram"):
    from engine.speculative.config import SpecConfig, Speculation

    return Speculation(SpecConfig(kind, num_draft=2), model, model if kind == "draft" else None)


def test_spec_lane_runs_speculation_and_reports_its_stats(model):
    g = Gateway(model, GatewayConfig(prompt_cache_bytes=1 << 20), _speculation(model, "draft"))
    sink = CollectingSink()
    placement = g.submit(make_request("s", max_tokens=9), sink)
    g.run_until_idle()
    assert placement.lane is Lane.SPEC and "speculative decoding (draft" in placement.reason
    assert sink.result.lane is Lane.SPEC and sink.result.finish_reason is FinishReason.LENGTH
    assert len(sink.token_ids) == 9 and sink.result.spec.emitted >= 9 and sink.result.spec.rounds > 0
    assert g.prompt_cache.stats().entries == 1  # the prompt's boundary, as the target's caches held it


def _second_turn(g):
    """A request, then a longer one that extends its prompt: both, and the second's placement and sink."""
    first = make_request("a", max_tokens=6)
    g.submit(first, CollectingSink())
    g.run_until_idle()
    longer = GenerationRequest("b", first.prompt_ids + (31, 32, 33), stop=StopCriteria(max_tokens=6))
    sink = CollectingSink()
    placement = g.submit(longer, sink)
    g.run_until_idle()
    return first, longer, placement, sink


@pytest.mark.parametrize(
    "target,kind",
    [(t, k) for t in ("tiny-llama", "tiny-qwen35-f32") for k in ("draft", "ngram")] + [("tiny-qwen35-f32", "mtp")],
)
def test_spec_lane_starts_from_the_prompt_cache_with_the_plain_greedy_tokens(tiny_path, target, kind):
    from engine.generate import generate

    model = load_model(tiny_path(target))[0]  # dense, and hybrid (its prompt boundary: an exact stored start)

    g = Gateway(model, GatewayConfig(prompt_cache_bytes=1 << 30), _speculation(model, kind))
    first, longer, placement, sink = _second_turn(g)
    assert placement.lane is Lane.SPEC and placement.cached_tokens == len(first.prompt_ids) - 1
    assert sink.token_ids == [t.token_id for t in generate(model, longer.prompt_ids, stop=longer.stop)]


def test_spec_lane_refusals_fall_back_to_the_plain_lanes_with_the_reason(model):
    from engine.request import SamplingParams

    g = Gateway(model, GatewayConfig(), _speculation(model))
    req = GenerationRequest("p", tuple(range(5, 17)), SamplingParams(presence_penalty=0.5), StopCriteria(max_tokens=4))
    placement = g.place(req)
    assert placement.lane is Lane.CONTINUOUS and placement.reason.startswith("logits processors")
    g = Gateway(
        model, GatewayConfig(kv_quantization=KVQuantization(bits=8, group_size=32, start=0)), _speculation(model)
    )
    placement = g.place(make_request("q"))
    assert placement.lane is not Lane.SPEC and placement.reason.startswith("quantized KV runs without speculation")


def test_a_spec_request_whose_consumer_leaves_is_cancelled(model):
    g = Gateway(model, GatewayConfig(), _speculation(model, "draft"))

    class Leaving(CollectingSink):
        def on_token(self, token):
            super().on_token(token)
            return len(self.tokens) < 3

    sink = Leaving()
    g.submit(make_request("c", max_tokens=20), sink)
    g.run_until_idle()
    assert sink.result.finish_reason is FinishReason.CANCELLED and sink.result.generated_tokens == 3
    assert not g.has_work


# ------------------------------------------------------- spec rows (--spec-batch)


def test_spec_batch_runs_ngram_requests_as_spec_rows_in_the_continuous_batch(model):
    from engine.generate import generate

    g = Gateway(model, GatewayConfig(spec_batch=True, prompt_cache_bytes=1 << 20), _speculation(model))
    reqs = [make_request(f"r{i}", 10 + 3 * i, 8) for i in range(3)]
    sinks = [CollectingSink() for _ in reqs]
    placements = [g.submit(r, s) for r, s in zip(reqs, sinks)]
    g.run_until_idle()
    for p, s, r in zip(placements, sinks, reqs):
        assert p.lane is Lane.CONTINUOUS and p.spec
        assert (
            "speculative decoding (ngram, up to 2 drafts per round, adaptive, trace rollback) in the continuous batch"
            in p.reason
        )
        assert s.result.lane is Lane.CONTINUOUS and s.result.spec.rounds > 0
        assert s.token_ids == [t.token_id for t in generate(model, r.prompt_ids, stop=r.stop)]
    assert g.prompt_cache.stats().entries == 3  # each row stored with the tokens its caches hold
    assert (g.active_rows, g.pending_rows, g.has_work) == (0, 0, False)


def test_spec_batch_falls_back_with_the_reason(model, tiny_path):
    from engine.request import SamplingParams

    g = Gateway(model, GatewayConfig(spec_batch=True), _speculation(model))
    req = GenerationRequest("p", tuple(range(5, 17)), SamplingParams(presence_penalty=0.5), StopCriteria(max_tokens=4))
    placement = g.place(req)
    assert placement.lane is Lane.CONTINUOUS and not placement.spec and placement.reason.startswith("logits processors")
    gemma = load_model(tiny_path("tiny-gemma3"))[0]  # sliding-window layers: a rotating cache
    placement = Gateway(gemma, GatewayConfig(spec_batch=True), _speculation(gemma)).place(make_request("w"))
    assert placement.lane is Lane.SPEC and "RotatingKVCache" in placement.reason
    assert "cannot roll back rows in the continuous batch" in placement.reason


def test_without_spec_batch_speculation_stays_on_the_spec_lane(model):
    g = Gateway(model, GatewayConfig(), _speculation(model))
    placement = g.place(make_request("s"))
    assert placement.lane is Lane.SPEC and not placement.spec and g.batcher.runner.spec is None


def test_spec_batch_on_a_hybrid_model_starts_from_the_prompt_cache_with_the_plain_greedy_tokens(tiny_path):
    from engine.generate import generate

    hybrid = load_model(tiny_path("tiny-qwen35-f32"))[0]
    g = Gateway(hybrid, GatewayConfig(spec_batch=True, prompt_cache_bytes=1 << 30), _speculation(hybrid))
    _, longer, placement, sink = _second_turn(g)
    assert placement.lane is Lane.CONTINUOUS and placement.spec and placement.cached_tokens > 0
    assert sink.result.spec.rounds > 0
    assert sink.token_ids == [t.token_id for t in generate(hybrid, longer.prompt_ids, stop=longer.stop)]
