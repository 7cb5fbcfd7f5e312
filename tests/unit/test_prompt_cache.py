"""The prompt cache: which prefix a lookup reuses, and that reuse gives the same tokens as computing it."""

import copy

import mlx.core as mx
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.cache.prompt_cache import PromptCache, snapshot
from engine.gateway import Gateway, GatewayConfig
from engine.generate import BlockSnapshots, KVQuantization, generate, prefill
from engine.kernels import on_cuda
from engine.loading import load_model
from engine.request import CachedPrefix, GenerationRequest, StopCriteria
from engine.sinks import CollectingSink

PROMPT = tuple(range(40, 70))


@pytest.fixture(scope="module")
def dense(tiny_path):
    return load_model(tiny_path("tiny-qwen3-f32"))[0]


@pytest.fixture(scope="module")
def hybrid(tiny_path):
    return load_model(tiny_path("tiny-qwen35-f32"))[0]


def stored(model, tokens):
    """Single-row caches holding exactly `tokens` (prefill stops before the last token it is given)."""
    cache = model.make_cache()
    prefill(model, cache, mx.array(list(tokens) + [0]))
    return CachedPrefix(tuple(tokens), cache)


def req(rid, prompt, n=6):
    return GenerationRequest(rid, tuple(prompt), stop=StopCriteria(max_tokens=n, ignore_eos=True))


def test_trimmable_entries_serve_the_longest_common_prefix(dense):
    pc = PromptCache(1 << 30)
    pc.insert(stored(dense, PROMPT[:20]))
    hit = pc.lookup(PROMPT[:12] + (999, 998))
    assert len(hit.tokens) == 12 and hit.cache[0].offset == 12
    hit = pc.lookup(PROMPT[:20])  # identical prompt: the last token is left to compute
    assert len(hit.tokens) == 19
    assert pc.lookup((5, 6, 7)) is None
    assert (pc.stats().hits, pc.stats().misses, pc.stats().cached_tokens) == (2, 1, 31)


def test_the_hit_is_a_copy(dense):
    pc = PromptCache(1 << 30)
    pc.insert(stored(dense, PROMPT[:20]))
    hit = pc.lookup(PROMPT[:10] + (5,))
    list(generate(dense, PROMPT[:10] + (5, 6, 7), stop=StopCriteria(max_tokens=3), cache=hit.cache, cached_tokens=10))
    again = pc.lookup(PROMPT[:20] + (1,))
    assert len(again.tokens) == 20 and again.cache[0].offset == 20


def test_recurrent_entries_serve_only_their_exact_boundary(hybrid):
    pc = PromptCache(1 << 30)
    pc.insert(stored(hybrid, PROMPT[:20]))
    assert pc.lookup(PROMPT[:12] + (999,)) is None  # would need a rewind
    assert pc.lookup(PROMPT[:20]) is None  # would leave no token to compute
    hit = pc.lookup(PROMPT[:20] + (7,))
    assert len(hit.tokens) == 20


class _State:
    """A draft source's state as the prompt cache sees it: a kind and a size."""

    def __init__(self, kind, nbytes=1000):
        self.kind, self.nbytes = kind, nbytes


def test_a_lookup_for_a_draft_state_takes_only_whole_entries_that_hold_one(dense):
    pc = PromptCache(1 << 30)
    plain = stored(dense, PROMPT[:20])
    with_state = stored(dense, PROMPT[:12])
    pc.insert(plain)
    pc.insert(CachedPrefix(with_state.tokens, with_state.cache, draft=_State("mtp")))
    assert pc.bytes == sum(c.nbytes for c in plain.cache + with_state.cache) + 1000
    hit = pc.lookup(PROMPT[:25], draft="mtp")  # the longer entry holds no state: the whole 12-token one
    assert len(hit.tokens) == 12 and hit.draft.kind == "mtp" and hit.draft is not pc._entries[PROMPT[:12]].draft
    assert pc.lookup(PROMPT[:10] + (1, 2), draft="mtp") is None  # not a cut of an entry: the state is at its end
    assert pc.lookup(PROMPT[:25], draft="other") is None
    hit = pc.lookup(PROMPT[:25])  # any other lookup reuses the caches as ever, without the state
    assert len(hit.tokens) == 20 and hit.draft is None


def test_budget_evicts_least_recently_used_and_refuses_oversized(dense):
    one = stored(dense, PROMPT[:10])
    size = sum(c.nbytes for c in one.cache)
    pc = PromptCache(2 * size)
    pc.insert(one)
    pc.insert(stored(dense, (3,) + PROMPT[:9]))
    pc.lookup(PROMPT[:10] + (1,))  # touch the first
    pc.insert(stored(dense, (4,) + PROMPT[:9]))
    assert len(pc) == 2 and pc.bytes <= 2 * size
    assert pc.lookup(PROMPT[:10] + (1,)) is not None and pc.lookup((3,) + PROMPT[:9] + (1,)) is None
    assert not PromptCache(size - 1).insert(stored(dense, PROMPT[:10]))


def test_a_longer_trimmable_entry_replaces_its_prefixes(dense):
    pc = PromptCache(1 << 30)
    pc.insert(stored(dense, PROMPT[:10]))
    pc.insert(stored(dense, PROMPT[:20]))
    assert len(pc) == 1


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_repeated_and_extended_prompts_reuse_the_cache_with_the_same_tokens(which, batch, request):
    model = request.getfixturevalue(which)
    g = Gateway(model, GatewayConfig(batch=batch, prompt_cache_bytes=1 << 30))
    first = CollectingSink()
    p0 = g.submit(req("a", PROMPT), first)
    g.run_until_idle()
    turn2 = PROMPT + tuple(first.token_ids) + (11, 12, 13)  # a follow-up that extends the conversation
    sinks, placements = {}, {}
    for rid, prompt in [("same", PROMPT), ("next", turn2)]:
        sinks[rid] = CollectingSink()
        placements[rid] = g.submit(req(rid, prompt), sinks[rid])
        g.run_until_idle()
    assert p0.cached_tokens == 0
    assert placements["same"].cached_tokens == len(PROMPT) - 1
    # The first request's final cache holds the prompt and the generated tokens that went through
    # the model: all of them on the batch lane, all but the last on the serial one (whose pipelined
    # decode does not launch a step past max_tokens).
    fed = len(first.token_ids) - (1 if batch == 1 else 0)
    assert placements["next"].cached_tokens == len(PROMPT) + fed
    for rid, prompt in [("same", PROMPT), ("next", turn2)]:
        plain = [t.token_id for t in generate(model, prompt, stop=req(rid, prompt).stop)]
        assert sinks[rid].token_ids == plain, rid
    assert g.prompt_cache.stats().hits == 2


def test_batched_joiners_mix_cached_and_fresh_prompts(hybrid):
    b = ContinuousBatcher(hybrid, SchedulerConfig(max_rows=4), keep_caches=True)
    pc = PromptCache(1 << 30)
    pc.insert(stored(hybrid, PROMPT[:20]))
    prompts = {"hit": PROMPT[:20] + (9, 8, 7), "fresh": (5,) + PROMPT[:25]}
    sinks = {k: CollectingSink() for k in prompts}
    b.submit(req("hit", prompts["hit"]), sinks["hit"], pc.lookup(prompts["hit"]))
    b.submit(req("fresh", prompts["fresh"]), sinks["fresh"])
    b.run_until_idle()
    for k, prompt in prompts.items():
        assert sinks[k].token_ids == [t.token_id for t in generate(hybrid, prompt, stop=req(k, prompt).stop)], k


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen35", "tiny-llama-4bit"])
@pytest.mark.parametrize("cached", [17, 200, 299])
def test_a_cached_prefix_gives_the_cold_logits_bit_for_bit(tiny_path, name, cached, request):
    """On the CPU: a prefix computed in its own forward leaves the same cache and logits as a cold prefill."""
    if name == "tiny-qwen35" and on_cuda():
        # Measured on the H200: splitting a 299-token prefill into 17 + 282 changes the hybrid model's
        # bits on CUDA (f32: the first attention layer's K/V differ by ~2e-3; bf16: logits by ~3e-3),
        # as kernels are chosen by the chunk's shape there. The dense models stayed exact. On the CPU
        # every case is exact.
        request.applymarker(
            pytest.mark.xfail(
                reason="CUDA picks kernels by each chunk's length, so whether a split changes the bits depends on the "
                "split: only 17 + 282 was measured to differ; the 200 and 299 splits may match by chance, hence not strict",
                strict=False,
            )
        )
    model = load_model(tiny_path(name))[0]
    prompt = tuple(range(50, 350))

    def logits(n_cached):
        out, cache = [], model.make_cache()
        if n_cached:
            prefill(model, cache, mx.array(list(prompt[: n_cached + 1])))
        stop = StopCriteria(max_tokens=4, ignore_eos=True)
        list(
            generate(model, prompt, stop=stop, cache=cache, cached_tokens=n_cached, tap=lambda s: out.append(s.logits))
        )
        return out

    for cold, warm in zip(logits(0), logits(cached)):
        assert mx.array_equal(cold, warm).item()


SYSTEM = tuple(3 + (i * 37) % 200 for i in range(600))  # a 600-token system prompt two requests share


def test_block_snapshots_give_the_cold_logits_bit_for_bit(hybrid):
    # A hybrid entry keeps its recurrent layers at every 256-token boundary of the prefill; a prompt that
    # shares 600 tokens with it starts from 512, its attention layers cut back from the entry's, and computes
    # the logits of a cold start.
    first, other = SYSTEM + (7, 8, 9), SYSTEM + (11, 12)
    stop = StopCriteria(max_tokens=3, ignore_eos=True)
    cache, fed, snapshots = hybrid.make_cache(), [], []
    blocks = BlockSnapshots(256, lambda n, c: snapshots.append((n, snapshot(c))))
    list(generate(hybrid, first, stop=stop, cache=cache, fed=fed, blocks=blocks))
    assert [n for n, _ in snapshots] == [256, 512]
    pc = PromptCache(1 << 30)
    pc.insert(CachedPrefix(first + tuple(fed), cache, tuple(snapshots)))
    hit = pc.lookup(other)
    assert len(hit.tokens) == 512 and pc.stats().block_hits == 1
    assert pc.lookup(SYSTEM[:300] + (5,)).tokens == SYSTEM[:256]

    def logits(cache=None, cached=0):
        out = []
        list(generate(hybrid, other, stop=stop, cache=cache, cached_tokens=cached, tap=lambda s: out.append(s.logits)))
        return out

    for cold, warm in zip(logits(), logits(hit.cache, 512)):
        assert mx.array_equal(cold, warm).item()
    again = pc.lookup(other)  # the hit was a copy: the entry serves the same start again
    assert len(again.tokens) == 512


def test_snapshots_the_entry_cannot_complete_are_dropped(hybrid):
    entry = stored(hybrid, PROMPT[:20])
    layers = snapshot(entry.cache)
    gap = [None] * len(layers)  # a snapshot without its recurrent layers cannot stand for them
    pc = PromptCache(1 << 30)
    # (which snapshot a lookup takes; the layers here are the 20-token state whatever the label)
    pc.insert(CachedPrefix(entry.tokens, entry.cache, ((8, gap), (16, layers), (20, layers))))
    assert pc.lookup(PROMPT[:12] + (999,)) is None
    assert len(pc.lookup(PROMPT[:18] + (999,)).tokens) == 16


def test_an_entry_past_the_budget_keeps_its_earliest_snapshots(hybrid):
    cache, fed, snapshots = hybrid.make_cache(), [], []
    blocks = BlockSnapshots(128, lambda n, c: snapshots.append((n, snapshot(c))))
    list(
        generate(hybrid, SYSTEM, stop=StopCriteria(max_tokens=2, ignore_eos=True), cache=cache, fed=fed, blocks=blocks)
    )
    whole = sum(c.nbytes for c in cache)
    one = sum(c.nbytes for c in snapshots[0][1] if c is not None)
    pc = PromptCache(whole + 2 * one)  # room for two of the four snapshots (128, 256, 384, 512)
    assert pc.insert(CachedPrefix(SYSTEM + tuple(fed), cache, tuple(snapshots)))
    assert pc.lookup(SYSTEM[:300] + (1,)).tokens == SYSTEM[:256]
    assert pc.lookup(SYSTEM[:500] + (1,)).tokens == SYSTEM[:256]  # 384 and 512 did not fit
    assert pc.bytes <= pc.max_bytes


@pytest.mark.parametrize("batch", [1, 4])
def test_requests_sharing_a_system_prompt_start_from_its_last_block(hybrid, batch):
    g = Gateway(hybrid, GatewayConfig(batch=batch, prompt_cache_bytes=1 << 30, prompt_cache_block=256))
    sinks, placements = {}, {}
    for rid, tail in [("a", (7, 8, 9)), ("b", (11, 12))]:
        sinks[rid] = CollectingSink()
        placements[rid] = g.submit(req(rid, SYSTEM + tail), sinks[rid])
        g.run_until_idle()
    assert placements["a"].cached_tokens == 0 and placements["b"].cached_tokens == 512
    plain = [t.token_id for t in generate(hybrid, SYSTEM + (11, 12), stop=req("b", SYSTEM).stop)]
    assert sinks["b"].token_ids == plain
    assert g.prompt_cache.stats().block_hits == 1
    off = Gateway(hybrid, GatewayConfig(batch=batch, prompt_cache_bytes=1 << 30, prompt_cache_block=0))
    for rid, tail in [("a", (7, 8, 9)), ("b", (11, 12))]:
        placed = off.submit(req(rid, SYSTEM + tail), CollectingSink())
        off.run_until_idle()
    assert placed.cached_tokens == 0  # without snapshots only exact boundaries serve


KVQ = KVQuantization(bits=8, group_size=32, start=0)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_quantized_kv_reuses_past_the_first_chunk_with_the_same_tokens(which, batch, request):
    # With quantized KV a prompt's first chunk (16 tokens here) attends to full-precision keys and all after
    # it to quantized ones: an entry serves starts past that chunk, the rest computed as a cold run would.
    model = request.getfixturevalue(which)
    g = Gateway(model, GatewayConfig(batch=batch, prompt_cache_bytes=1 << 30, prefill_chunk=16, kv_quantization=KVQ))
    assert g.prompt_cache.full_chunk == 16
    first = CollectingSink()
    g.submit(req("a", PROMPT), first)
    g.run_until_idle()
    turn2 = PROMPT + tuple(first.token_ids) + (11, 12, 13)
    prompts = {"same": PROMPT, "next": turn2, "short": PROMPT[:12] + (5, 6, 7, 8, 9, 10, 11)}
    sinks, placements = {}, {}
    for rid, prompt in prompts.items():
        sinks[rid] = CollectingSink()
        placements[rid] = g.submit(req(rid, prompt), sinks[rid])
        g.run_until_idle()
    fed = len(first.token_ids) - (1 if batch == 1 else 0)
    assert placements["same"].cached_tokens == len(PROMPT) - 1
    assert placements["next"].cached_tokens == len(PROMPT) + fed
    assert placements["short"].cached_tokens == 0  # 12 shared tokens: inside the first chunk
    for rid, prompt in prompts.items():
        plain = generate(model, prompt, stop=req(rid, prompt).stop, kv_quantization=KVQ, prefill_step_size=16)
        assert sinks[rid].token_ids == [t.token_id for t in plain], rid


def test_quantized_kv_keeps_only_entries_with_its_first_chunk(dense):
    g = Gateway(dense, GatewayConfig(batch=1, prompt_cache_bytes=1 << 30, prefill_chunk=16, kv_quantization=KVQ))
    g.submit(req("short", PROMPT[:10]), CollectingSink())  # a 9-token first chunk: not the cache's 16
    g.run_until_idle()
    assert len(g.prompt_cache) == 0
    pc = PromptCache(1 << 30, full_chunk=16)
    assert not pc.insert(stored(dense, PROMPT[:20]))  # full precision: made without quantized KV


@pytest.mark.parametrize("hit_first", [True, False])  # False: it joins the group once the fresh one ran a chunk
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_a_quantized_prefix_gives_the_cold_logits_bit_for_bit_on_both_lanes(which, hit_first, request):
    model = request.getfixturevalue(which)
    prompt, stop = tuple(range(50, 110)), StopCriteria(max_tokens=4, ignore_eos=True)

    def serial(cache=None, cached=0):
        out = []
        list(
            generate(
                model,
                prompt,
                stop=stop,
                cache=cache,
                cached_tokens=cached,
                kv_quantization=KVQ,
                prefill_step_size=16,
                tap=lambda s: out.append(s.logits),
            )
        )
        return out

    cache = model.make_cache()  # a quantized entry of the first 40 tokens, first chunk 16
    prefill(model, cache, mx.array(list(prompt[:41])), step_size=16, kv_quantization=KVQ)
    cold = serial()
    for a, b in zip(cold, serial(copy.deepcopy(cache), 40)):
        assert mx.array_equal(a, b).item()
    logits = {"hit": [], "fresh": []}
    b = ContinuousBatcher(
        model,
        SchedulerConfig(max_rows=4, prefill_chunk=16),
        kv_quantization=KVQ,
        tap=lambda rid, x: logits[rid].append(x),
    )
    hit = CachedPrefix(prompt[:40], cache, full_chunk=16)
    submits = [
        lambda: b.submit(req("hit", prompt, 4), CollectingSink(), hit),
        lambda: b.submit(req("fresh", prompt, 4), CollectingSink()),
    ]
    for submit in submits if hit_first else submits[::-1]:
        submit()
    b.run_until_idle()
    for rid in logits:
        for a, c in zip(cold, logits[rid]):
            assert mx.array_equal(a, c).item(), rid


@pytest.mark.parametrize("batch", [1, 4])
def test_quantized_kv_snapshots_start_past_the_first_chunk(hybrid, batch):
    # Block snapshots cut chunks at every 16 tokens, but not a cold prompt's first chunk (64): it stays as long
    # as mlx-lm's kv_bits makes it, so the cache changes no result; a prompt sharing 90 tokens starts at 80.
    g = Gateway(
        hybrid,
        GatewayConfig(
            batch=batch, prompt_cache_bytes=1 << 30, prefill_chunk=64, prompt_cache_block=16, kv_quantization=KVQ
        ),
    )
    assert g.prompt_cache.full_chunk == 64
    prompts = {"first": tuple(range(100, 200)), "shares-90": tuple(range(100, 190)) + (7, 8, 9)}
    for rid, prompt in prompts.items():
        sink = CollectingSink()
        placement = g.submit(req(rid, prompt), sink)
        g.run_until_idle()
        assert placement.cached_tokens == {"first": 0, "shares-90": 80}[rid]
        plain = generate(hybrid, prompt, stop=req(rid, prompt).stop, kv_quantization=KVQ, prefill_step_size=64)
        assert sink.token_ids == [t.token_id for t in plain], rid


@pytest.mark.parametrize("kv, taken", [(None, [16, 32, 48, 64, 80, 96]), (KVQ, [64, 80, 96])])
def test_block_snapshots_cut_no_chunk(hybrid, kv, taken):
    # The snapshots come from inside the forwards: the chunks are those without them; with quantized KV none is
    # taken inside a cold prompt's first chunk (the prompt cache serves no start there).
    seen, snapshots = [], []
    prefill(
        hybrid,
        hybrid.make_cache(),
        mx.array(list(range(100, 200))),
        step_size=64,
        kv_quantization=kv,
        on_progress=lambda done, total: seen.append(done),
        blocks=BlockSnapshots(16, lambda n, layers: snapshots.append(n)),
    )
    assert seen == [64, 99] and snapshots == taken
