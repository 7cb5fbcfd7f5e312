"""A row whose own sampling fails ends alone: the rest of its prefill group and the batch keep their tokens."""

import pytest

import engine.batch.runner as runner_module
from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.gateway import Gateway, GatewayConfig
from engine.generate import generate
from engine.loading import load_model
from engine.request import FinishReason, GenerationRequest, SamplingParams, StopCriteria
from engine.sampling import Sampler
from engine.sinks import CollectingSink

BAD_SEED = 666  # marks the request whose sampler the tests make fail


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path("tiny-qwen35"))[0]


def make_request(rid, prompt_len, max_tokens, sampling=SamplingParams()):
    prompt = tuple(range(3 + prompt_len % 7, 3 + prompt_len % 7 + prompt_len))
    return GenerationRequest(rid, prompt, sampling, StopCriteria(max_tokens=max_tokens, ignore_eos=True))


def good_requests():
    """A group of joiners: greedy ones (which the serial lane checks) and a seeded sampled one."""
    return [
        make_request("g1", 9, 8),
        make_request("g2", 23, 6),
        make_request("sampled", 14, 7, SamplingParams(temperature=0.9, top_p=0.9, seed=11)),
        make_request("g3", 5, 9),
    ]


def serial_ids(model, req):
    return [t.token_id for t in generate(model, req.prompt_ids, sampling=req.sampling, stop=req.stop)]


def serve(submit, step, running, group, bad=None):
    """`running` decodes first; then `group` (with `bad` in its middle) arrives together. Returns the sinks."""
    sinks = {}
    for req in running:
        sinks[req.request_id] = CollectingSink()
        submit(req, sinks[req.request_id])
    for _ in range(3):
        step()  # the running request is decoding
    arrivals = group[:2] + ([bad] if bad else []) + group[2:]
    for req in arrivals:
        sinks[req.request_id] = CollectingSink()
        submit(req, sinks[req.request_id])
    return sinks


def run_batcher(model, running, group, bad=None):
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=8))
    sinks = serve(b.submit, b.step, running, group, bad)
    b.run_until_idle()
    assert (b.active_rows, b.pending_rows, b.runner.num_rows, b.runner.joiners) == (0, 0, 0, [])
    return sinks


def assert_contained(model, with_bad, without, bad_id, error_part):
    bad = with_bad.pop(bad_id)
    assert with_bad.keys() == without.keys()
    for rid, sink in with_bad.items():
        assert sink.result.finish_reason is FinishReason.LENGTH, (rid, sink.result.error)
        assert sink.token_ids == without[rid].token_ids, rid
    assert bad.result.finish_reason is FinishReason.ERROR and error_part in bad.result.error


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_mx_random_key_refuses_fails_only_its_request(model, seed):
    """Through the gateway as the server drives it: mx.random.key raises TypeError for these seeds."""
    with pytest.raises(TypeError):
        Sampler(SamplingParams(temperature=1.0, seed=seed))
    running, group = [make_request("running", 6, 30)], good_requests()
    bad = make_request("bad", 12, 8, SamplingParams(temperature=1.0, seed=seed))

    def gateway_run(with_bad):
        g = Gateway(model, GatewayConfig(batch=8, prompt_cache_bytes=1 << 26))
        sinks = serve(g.submit, g.step, running, group, bad if with_bad else None)
        g.run_until_idle()
        return sinks

    with_bad, without = gateway_run(True), gateway_run(False)
    assert_contained(model, with_bad, without, "bad", "sampling setup failed")
    for req in [*running, *group]:
        if req.sampling.is_greedy:
            assert with_bad[req.request_id].token_ids == serial_ids(model, req), req.request_id


class _FailingSampler(Sampler):
    """The sampler of the BAD_SEED request raises at a chosen point (set up, or its n-th call)."""

    fail_at = 0  # 0: in the constructor; n >= 1: on the n-th token

    def __init__(self, params):
        super().__init__(params)
        self.calls = 0
        if params.seed == BAD_SEED and self.fail_at == 0:
            raise ValueError("sampler setup exploded")

    def __call__(self, logprobs):
        self.calls += 1
        if self.params.seed == BAD_SEED and self.calls == self.fail_at:
            raise RuntimeError("sampler exploded")
        return super().__call__(logprobs)


@pytest.mark.parametrize(
    "fail_at, error_part", [(0, "sampling setup failed: ValueError"), (1, "sampler exploded"), (3, "sampler exploded")]
)
def test_a_failing_sampler_fails_only_its_row(model, monkeypatch, fail_at, error_part):
    """At set-up (admission), at token 0 (the split's L=1 forward) or mid-decode: only that row ends."""
    monkeypatch.setattr(runner_module, "Sampler", _FailingSampler)
    monkeypatch.setattr(_FailingSampler, "fail_at", fail_at)
    running, group = [make_request("running", 6, 30)], good_requests()
    bad = make_request("bad", 12, 8, SamplingParams(temperature=1.0, seed=BAD_SEED))
    with_bad = run_batcher(model, running, group, bad)
    # Token 0 goes out at the join; a row that fails in a decode step emits nothing from that step.
    assert len(with_bad["bad"].tokens) == {0: 0, 1: 0, 3: 1}[fail_at]
    assert_contained(model, with_bad, run_batcher(model, running, group), "bad", error_part)
    for req in [*running, *group]:
        if req.sampling.is_greedy:
            assert with_bad[req.request_id].token_ids == serial_ids(model, req), req.request_id


def test_a_failing_processor_fails_only_its_row(model, monkeypatch):
    """A logits processor that raises while token 0 is sampled: the group's other rows go on."""
    real = runner_module.make_processors

    def processors(params, **options):
        if params.seed != BAD_SEED:
            return real(params, **options)

        def boom(tokens, logits):
            raise IndexError("processor exploded")

        return [boom]

    monkeypatch.setattr(runner_module, "make_processors", processors)
    group = good_requests()
    bad = make_request("bad", 12, 8, SamplingParams(seed=BAD_SEED))
    with_bad = run_batcher(model, [], group, bad)
    assert not with_bad["bad"].tokens
    assert_contained(model, with_bad, run_batcher(model, [], group), "bad", "processor exploded")
