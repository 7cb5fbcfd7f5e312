"""Scored prompts (`echo` with `logprobs`): each prompt token's logprob is the log-softmax of the engine's own
logits for the position before it, bit for bit, on both lanes, from the prefill's forward."""

import mlx.core as mx
import pytest

from engine.gateway import Gateway, GatewayConfig
from engine.loading import load_model
from engine.prompt_logprobs import log_softmax
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen35"])
def model(request, tiny_path):
    return load_model(tiny_path(request.param))[0]


def reference(model, prompt: tuple[int, ...], chunk: int) -> mx.array:
    """Log-softmax of the engine's logits at positions 0..n-2, the prompt's prefill chunks as they run."""
    cache, rows = model.make_cache(), []
    for start in range(0, len(prompt) - 1, chunk):
        piece = prompt[start : min(start + chunk, len(prompt) - 1)]
        rows.append(log_softmax(model.logits(model.hidden(mx.array(piece)[None], cache))[0]))
    return mx.concatenate(rows)


def scored(gateway: Gateway, prompts: list[tuple[int, ...]], top: int = 2) -> list:
    sinks = [CollectingSink() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        request = GenerationRequest(
            f"r{i}", prompt, stop=StopCriteria(max_tokens=2, ignore_eos=True), prompt_logprobs=top
        )
        gateway.submit(request, sink)
    gateway.run_until_idle()
    return [s.result.prompt_logprobs for s in sinks]


def check(model, prompt, got, chunk, top=2):
    want = reference(model, prompt, chunk)
    assert [t.token_id for t in got] == list(prompt[1:])
    assert [t.logprob for t in got] == [want[i, t].item() for i, t in enumerate(prompt[1:])]
    for i, t in enumerate(got):
        best = sorted(range(want.shape[1]), key=lambda v: -want[i, v].item())[:top]
        assert [a.token_id for a in t.top_logprobs] == best
        assert [a.logprob for a in t.top_logprobs] == [want[i, v].item() for v in best]


@pytest.mark.parametrize("batch", [1, 4])
def test_scored_prompts_equal_the_log_softmax_of_the_engines_logits(model, batch):
    prompts = [tuple(range(3 + i, 3 + i + n)) for i, n in enumerate((9, 14, 5, 2))]
    gateway = Gateway(model, GatewayConfig(batch=batch, prefill_chunk=8))
    for prompt, got in zip(prompts, scored(gateway, prompts)):
        check(model, prompt, got, chunk=8)


def test_a_scored_prompt_starts_cold_whatever_the_prompt_cache_holds(model):
    gateway = Gateway(model, GatewayConfig(batch=4, prefill_chunk=64))
    prompt = tuple(range(7, 27))
    first, second = scored(gateway, [prompt, prompt])[0], scored(gateway, [prompt])[0]
    assert first == second and len(second) == len(prompt) - 1


def test_a_one_token_prompt_has_nothing_to_score(model):
    assert scored(Gateway(model, GatewayConfig(batch=4)), [(5,)]) == [()]


def test_padded_chunks_and_ghost_rows_score_only_the_real_positions(model):
    """The fast tier's shapes: chunks padded to a bucket, groups filled with ghost joiners (bit for bit on the CPU)."""
    prompts = [tuple(range(3 + i, 3 + i + n)) for i, n in enumerate((9, 14, 5))]
    config = GatewayConfig(
        batch=4, prefill_chunk=8, prefill_buckets=(4, 8), prefill_groups=(1, 2, 4), decode_buckets=(1, 2, 4)
    )
    for prompt, got in zip(prompts, scored(Gateway(model, config), prompts)):
        want = reference(model, prompt, chunk=8)
        assert [t.token_id for t in got] == list(prompt[1:])
        assert [t.logprob for t in got] == [want[i, t].item() for i, t in enumerate(prompt[1:])]
