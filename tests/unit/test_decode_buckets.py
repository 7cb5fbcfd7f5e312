"""Buckets: ghost rows fill the decode batch, and padding the prefill chunks, to a few shapes; no token changes."""

import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.runner import BatchRunner, bucket, chunk_buckets
from engine.batch.scheduler import SchedulerConfig
from engine.gateway import GatewayConfig
from engine.generate import KVQuantization
from engine.loading import load_model
from engine.request import GenerationRequest, SamplingParams, StopCriteria
from engine.sinks import CollectingSink

BUCKETS = (1, 2, 4, 8)


def request(rid, prompt_len, max_tokens, sampling=SamplingParams()):
    prompt = tuple(range(3 + prompt_len % 7, 3 + prompt_len % 7 + prompt_len))
    return GenerationRequest(rid, prompt, sampling, StopCriteria(max_tokens=max_tokens, ignore_eos=True))


def staggered(model, buckets, chunks=(), budget=None, groups=()):
    """Rows joining and leaving at different steps (1 to 6 decoding, 3 taking token 0 at once), one of them
    sampled with a seed; the tokens of each, and the decode shapes the batch took."""
    b = ContinuousBatcher(
        model,
        SchedulerConfig(max_rows=8, prefill_batch=3, prefill_chunk=16, prefill_budget=budget),
        decode_buckets=buckets,
        chunk_buckets=chunks,
        group_buckets=groups,
    )
    shapes = set()
    decode = b.runner.decode

    def spy():
        shapes.add(len(b.runner.rows) + b.runner.ghosts)
        return decode()

    b.runner.decode = spy
    sinks = {}
    arrivals = [
        [request("a", 9, 12)],
        [request("b", 23, 9), request("c", 5, 4)],
        [],
        [request("d", 14, 7, SamplingParams(temperature=0.9, seed=5)), request("e", 3, 10), request("f", 4, 6)],
        [],
        [],
    ]
    for wave in arrivals:
        for r in wave:
            sinks[r.request_id] = CollectingSink()
            b.submit(r, sinks[r.request_id])
        for _ in range(2):
            b.step()
    b.run_until_idle()
    assert (b.active_rows, b.runner.num_rows, b.runner.ghosts) == (0, 0, 0)
    prefills = {shape[2] for shape in b.runner.shapes if shape[0] == "prefill"}
    assert not chunks or prefills <= set(chunks)
    groups_run = {shape[1] for shape in b.runner.shapes if shape[0] == "prefill"}
    assert groups_run <= set(groups) if groups else 3 in groups_run
    firsts = {shape[1] for shape in b.runner.shapes if shape[0] == "first"}  # the token-0 forwards' rows
    assert firsts <= set(buckets) if buckets else 3 in firsts
    return {rid: s.token_ids for rid, s in sinks.items()}, shapes


@pytest.mark.parametrize("name", ["tiny-qwen35", "tiny-qwen3", "tiny-gemma3"])
def test_ghost_rows_change_no_token(tiny_path, name):
    # Every row's math is its own on these backends: the rows' tokens are those of the batch without ghosts.
    model = load_model(tiny_path(name))[0]
    plain, plain_shapes = staggered(model, ())
    padded, padded_shapes = staggered(model, BUCKETS)
    assert padded == plain
    assert staggered(model, BUCKETS, (8, 12, 16))[0] == plain  # prefill chunks padded too
    assert staggered(model, BUCKETS, (8, 12, 16), budget=10)[0] == plain  # and shared out, 5 tokens a joiner
    assert staggered(model, BUCKETS, (8, 12, 16), budget=10, groups=(1, 2, 4))[0] == plain  # groups of 3 filled to 4
    assert all(len(ids) > 0 for ids in plain.values())
    assert {3, 5} & plain_shapes and padded_shapes <= set(BUCKETS)  # only the padded batch kept to the buckets


def test_the_batch_fills_to_its_bucket(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=8, prefill_batch=8), decode_buckets=BUCKETS)
    sizes = []
    decode = b.runner.decode

    def spy():
        kv = next(c for c in b.runner.cache if getattr(c, "parts", None) is not None)  # an attention layer's
        sizes.append((len(b.runner.rows), b.runner.ghosts, kv.parts[0].shape[0]))
        return decode()

    b.runner.decode = spy
    for i, n in enumerate((3, 6, 9)):
        b.submit(request(f"r{i}", 5 + i, n), CollectingSink())
    b.run_until_idle()
    for rows, ghosts, cache_rows in sizes:
        assert rows + ghosts == bucket(rows, BUCKETS) == cache_rows
    assert {rows for rows, _, _ in sizes} == {3, 2, 1} and {g for _, g, _ in sizes} == {1, 0}


def test_bucket_and_settings():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 9]
    assert bucket(3, ()) == 3
    assert chunk_buckets(2048)[:6] == (16, 24, 32, 48, 64, 96) and chunk_buckets(2048)[-1] == 2048
    assert chunk_buckets(100) == (16, 24, 32, 48, 64, 96, 100)
    with pytest.raises(ValueError, match="counts >= 1"):
        BatchRunner(None, decode_buckets=(0, 4))
    with pytest.raises(ValueError, match="quantized KV"):
        BatchRunner(None, kv=KVQuantization(bits=8, group_size=64, start=0), decode_buckets=(1, 2))
    with pytest.raises(ValueError, match="quantized KV"):
        GatewayConfig(decode_buckets=(1, 2), kv_quantization=KVQuantization(bits=8, group_size=64, start=0))
    with pytest.raises(ValueError, match="quantized KV"):
        GatewayConfig(prefill_groups=(1, 2), kv_quantization=KVQuantization(bits=8, group_size=64, start=0))
    with pytest.raises(ValueError, match="quantized KV"):
        BatchRunner(None, kv=KVQuantization(bits=8, group_size=64, start=0), group_buckets=(1, 2))


def test_a_prefill_budget_is_shared_by_the_joiners():
    cfg = SchedulerConfig(prefill_chunk=16, prefill_budget=24)
    assert [cfg.chunk(n) for n in (0, 1, 2, 3, 30)] == [16, 16, 12, 8, 1]
    assert SchedulerConfig(prefill_chunk=16).chunk(5) == 16
    # with chunk buckets a share is rounded down to one, so a forward pads none of its chunks
    buckets = SchedulerConfig(prefill_chunk=2048, prefill_budget=2048, chunk_buckets=chunk_buckets(2048))
    assert [buckets.chunk(n) for n in (1, 2, 3, 31, 200)] == [
        2048,
        1024,
        512,
        64,
        16,
    ]  # 200: below the first, the first (its forward pads to it anyway)
    assert [buckets.chunk(n, cap) for n, cap in ((1, 0), (1, 100), (4, 100), (1, 4096))] == [0, 96, 24, 2048]
    with pytest.raises(ValueError, match="prefill_budget"):
        SchedulerConfig(prefill_budget=0)


def test_with_no_row_decoding_the_joiners_share_the_idle_budget():
    idle = SchedulerConfig(
        prefill_chunk=2048, prefill_budget=2048, idle_prefill_budget=4096, chunk_buckets=chunk_buckets(2048)
    )
    # 32 prompts of 128 tokens reaching an idle server: one [32, 128] forward, not two [32, 64]
    assert [idle.chunk(n, idle=True) for n in (1, 2, 32, 64)] == [2048, 2048, 128, 64]
    assert [idle.chunk(n) for n in (1, 2, 32, 64)] == [2048, 1024, 64, 32]
    assert idle.chunk(32, cap=0, idle=True) == 0
    # it never lowers the budget, and without a budget (whole chunks each) it changes nothing
    assert SchedulerConfig(prefill_budget=2048, idle_prefill_budget=512).chunk(8, idle=True) == 256
    assert SchedulerConfig(prefill_chunk=16, idle_prefill_budget=24).chunk(3, idle=True) == 16
    with pytest.raises(ValueError, match="idle_prefill_budget"):
        SchedulerConfig(idle_prefill_budget=0)
    fast, exact = GatewayConfig.for_tier("fast"), GatewayConfig.for_tier("exact")
    assert fast.idle_prefill_budget == 2 * fast.prefill_budget and exact.idle_prefill_budget is None
    assert GatewayConfig.for_tier("fast", prefill_budget=512, idle_prefill_budget=0).idle_prefill_budget is None


def test_ghosts_leave_the_kept_caches_and_cancellations_alone(tiny_path):
    # What a finished row leaves for the prompt cache is its own caches, ghosts or not; a cancelled row
    # leaves the batch and the others' tokens stay.
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.cache import cache_arrays

    model = load_model(tiny_path("tiny-qwen35"))[0]

    def run(buckets):
        b = ContinuousBatcher(model, SchedulerConfig(max_rows=8), keep_caches=True, decode_buckets=buckets)
        sinks = {}
        for r in (request("x", 7, 6), request("y", 12, 9), request("z", 4, 30)):
            sinks[r.request_id] = CollectingSink()
            b.submit(r, sinks[r.request_id])
        for _ in range(4):
            b.step()
        b.cancel("z")
        b.run_until_idle()
        assert b.runner.ghosts == 0 and b.runner.num_rows == 0
        kept = {
            rid: [a for _, a in tree_flatten(cache_arrays(s.result.caches[-1].cache))]
            for rid, s in sinks.items()
            if s.result.caches
        }
        return {rid: s.token_ids for rid, s in sinks.items()}, kept

    (plain, plain_kept), (padded, padded_kept) = run(()), run(BUCKETS)
    assert padded == plain and plain["z"] and len(plain["z"]) < 30
    assert plain_kept.keys() == padded_kept.keys() and plain_kept
    for rid in plain_kept:
        assert len(plain_kept[rid]) == len(padded_kept[rid]) > 0
        assert all(mx.array_equal(a, b).item() for a, b in zip(plain_kept[rid], padded_kept[rid])), rid
