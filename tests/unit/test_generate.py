import math

import mlx.core as mx
import pytest

from engine.engine import Engine
from engine.generate import KVQuantization, generate
from engine.loading import load_model
from engine.request import FinishReason, SamplingParams, StopCriteria


@pytest.fixture(scope="module")
def qwen35(tiny_path):
    return load_model(tiny_path("tiny-qwen35"))[0]


def _ids(tokens):
    return [t.token_id for t in tokens]


def test_max_tokens_and_length_finish(qwen35):
    out = list(generate(qwen35, [1, 2, 3], stop=StopCriteria(max_tokens=5)))
    assert len(out) == 5 and out[-1].finish_reason is FinishReason.LENGTH
    assert all(t.finish_reason is None for t in out[:-1])


def test_eos_stops_unless_ignored(qwen35):
    free = _ids(generate(qwen35, [4, 5, 6], stop=StopCriteria(max_tokens=12)))
    eos = free[4]
    out = list(generate(qwen35, [4, 5, 6], stop=StopCriteria(max_tokens=12, eos_ids=frozenset([eos]))))
    assert _ids(out) == free[: free.index(eos) + 1]
    assert out[-1].is_stop and out[-1].finish_reason is FinishReason.STOP
    ignored = list(
        generate(qwen35, [4, 5, 6], stop=StopCriteria(max_tokens=12, eos_ids=frozenset([eos]), ignore_eos=True))
    )
    assert _ids(ignored) == free and ignored[-1].finish_reason is FinishReason.LENGTH


def test_stop_sequence_is_withheld(qwen35):
    free = _ids(generate(qwen35, [7, 8], stop=StopCriteria(max_tokens=16)))
    seq = tuple(free[5:7])
    start = next(i for i in range(len(free)) if tuple(free[i : i + 2]) == seq)
    out = list(generate(qwen35, [7, 8], stop=StopCriteria(max_tokens=16, stop_sequences=(seq,))))
    assert _ids(out[:-1]) == free[:start]
    assert out[-1].is_stop and out[-1].finish_reason is FinishReason.STOP


def test_logprobs_and_top_logprobs_agree(qwen35):
    params = SamplingParams(logprobs=True, top_logprobs=5)
    out = list(generate(qwen35, [9, 10, 11], sampling=params, stop=StopCriteria(max_tokens=6)))
    for t in out:
        assert len(t.top_logprobs) == 5
        best = t.top_logprobs[0]
        # greedy takes the best logprob; bf16 logprobs can tie, so compare values, then membership
        assert math.isclose(best.logprob, t.logprob)
        assert t.token_id in {x.token_id for x in t.top_logprobs if x.logprob == best.logprob}
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_tap_sees_every_forward_and_the_hidden_state(qwen35):
    taps = []
    list(generate(qwen35, list(range(1, 40)), stop=StopCriteria(max_tokens=4), tap=taps.append))
    assert len(taps) == 4
    assert taps[0].logits.shape == (1, 4096) and taps[0].hidden.shape == (1, 1, 128)
    assert mx.array_equal(qwen35.logits(taps[0].hidden)[:, -1, :], taps[0].logits).item()


def test_prefill_chunks_do_not_change_greedy_tokens(qwen35):
    prompt = list(range(3, 303))
    a = _ids(generate(qwen35, prompt, stop=StopCriteria(max_tokens=8)))
    b = _ids(generate(qwen35, prompt, stop=StopCriteria(max_tokens=8), prefill_step_size=64))
    assert a == b


def test_prefill_progress_is_reported(qwen35):
    seen = []
    list(
        generate(
            qwen35,
            list(range(100)),
            stop=StopCriteria(max_tokens=1),
            prefill_step_size=32,
            on_prefill=lambda done, total: seen.append((done, total)),
        )
    )
    assert seen == [(32, 100), (64, 100), (96, 100), (99, 100)]


def test_seeded_sampling_is_reproducible(qwen35):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    a = _ids(generate(qwen35, [1, 2], sampling=params, stop=StopCriteria(max_tokens=10)))
    b = _ids(generate(qwen35, [1, 2], sampling=params, stop=StopCriteria(max_tokens=10)))
    assert a == b


def test_caller_cache_is_filled(qwen35):
    cache = qwen35.make_cache()
    list(generate(qwen35, list(range(20)), stop=StopCriteria(max_tokens=5), cache=cache))
    # prompt (20) + the 4 tokens fed back; the 5th token is never fed back
    assert cache[3].offset == 24 and cache[0].offset == 24


def test_bad_requests_are_rejected(qwen35):
    with pytest.raises(ValueError):
        list(generate(qwen35, [], stop=StopCriteria(max_tokens=2)))
    with pytest.raises(ValueError):
        StopCriteria(max_tokens=0)


def test_kv_quantization_refuses_sliding_window_models(tiny_path):
    gemma = load_model(tiny_path("tiny-gemma3"))[0]
    with pytest.raises(ValueError, match="sliding"):
        list(generate(gemma, [1, 2, 3], stop=StopCriteria(max_tokens=2), kv_quantization=KVQuantization(bits=4)))


def test_engine_api_round_trip(tiny_path):
    eng = Engine.load(model_path=tiny_path("tiny-llama"))
    ids = eng.tokenizer.encode("Hello world")
    out = list(eng.generate(ids, max_tokens=8, ignore_eos=True))
    assert len(out) == 8 and isinstance(eng.tokenizer.decode([t.token_id for t in out]), str)
    assert eng.eos_ids


def test_mtp_head_is_loaded_and_runs(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    assert model.has_mtp
    hidden = model.hidden(mx.array([[1, 2, 3]]))
    emb = model.language_model.model.embed_tokens(mx.array([[2, 3, 4]]))
    out = model.language_model.mtp(hidden, emb)
    assert model.logits(out).shape == (1, 3, 4096)
