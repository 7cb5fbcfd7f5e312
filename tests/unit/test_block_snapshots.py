"""Block snapshots kept from inside the prefill's forwards: with the prompt cache on, a cold prompt runs the
forwards it runs with the cache off, and a start from a snapshot computes what a cold start does, on the exact
tier (the per-token recurrence) and the fast tier (the chunked rule)."""

import mlx.core as mx
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.cache import cache_nbytes
from engine.cache.prompt_cache import PromptCache
from engine.gateway import Gateway, GatewayConfig
from engine.generate import BlockSnapshots, generate, prefill
from engine.kernels import FAST, KernelConfig, install
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.loading import load_model
from engine.models.gated_delta import gated_delta_update
from engine.request import CachedPrefix, GenerationRequest, StopCriteria
from engine.sinks import CollectingSink

SYSTEM = tuple(3 + (i * 37) % 200 for i in range(600))  # a 600-token system prompt two requests share
STOP = StopCriteria(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def exact(tiny_path):
    return load_model(tiny_path("tiny-qwen35-f32"))[0]


@pytest.fixture(scope="module")
def fast(tiny_path):
    model = load_model(tiny_path("tiny-qwen35-f32"))[0]
    install(model, KernelConfig(FAST, force=True))
    assert model.layers[0].linear_attn.chunked_rule is chunked_gated_delta
    return model


@pytest.fixture(scope="module")
def fast32(tiny_path):  # the fast tier with mlx-lm's float32 state (--state-dtype float32; float16 by default)
    model = load_model(tiny_path("tiny-qwen35-f32"))[0]
    install(model, KernelConfig(FAST, force=True, state_dtype="float32"))
    return model


def same(a: mx.array, b: mx.array, bitwise: bool) -> bool:
    return mx.array_equal(a, b).item() if bitwise else mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("state_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_the_chunked_rule_keeps_the_recurrence_states_at_any_count(state_dtype, masked):
    mx.random.seed(0)
    b, t, hk, hv, dk, dv = 2, 150, 2, 4, 16, 8
    q, k = mx.random.normal((b, t, hk, dk)), 0.3 * mx.random.normal((b, t, hk, dk))
    v, a, beta = mx.random.normal((b, t, hv, dv)), mx.random.normal((b, t, hv)), mx.random.normal((b, t, hv))
    A_log, dt_bias = 0.1 * mx.random.normal((hv,)), mx.ones(hv)
    mask = mx.arange(t)[None] < mx.array([[t], [120]]) if masked else None
    state = mx.zeros((b, hv, dv, dk), dtype=state_dtype)
    counts = [1, 5, 63, 64, 65, 100, 128, 149, 150]
    exact, chunked = dict.fromkeys(counts), dict.fromkeys(counts)
    _, last = gated_delta_update(q, k, v, a, beta, A_log, dt_bias, state, mask, marks=exact)
    _, last_chunked = gated_delta_update(
        q, k, v, a, beta, A_log, dt_bias, state, mask, chunked=chunked_gated_delta, marks=chunked
    )
    tolerance = 1e-5 if state_dtype == mx.float32 else 2e-2
    for n in counts:
        assert exact[n].dtype == chunked[n].dtype == state_dtype, n
        assert mx.allclose(exact[n], chunked[n], atol=tolerance).item(), n
    assert mx.array_equal(exact[t], last).item() and mx.array_equal(chunked[t], last_chunked).item()


@pytest.mark.parametrize("which", ["exact", "fast"])
def test_a_snapshot_holds_the_state_of_a_prefill_cut_there(which, request):
    model = request.getfixturevalue(which)
    prompt = mx.array(list(SYSTEM[:200]))
    snapshots = {}
    prefill(model, model.make_cache(), prompt, step_size=96, blocks=BlockSnapshots(40, snapshots.__setitem__))
    assert list(snapshots) == [40, 80, 120, 160]  # inside chunks (96: 40, 80; 192: 120, 160), none at the ends
    for n, layers in snapshots.items():
        cut = model.make_cache()
        prefill(model, cut, prompt[: n + 1])
        for kept, c in zip(layers, cut):
            if kept is not None:
                for x, y in zip(kept.state, c.state):
                    # the exact tier: the same per-token steps; the fast tier: the state inside a chunk (G_l S0 +
                    # U^T diag(G_l / G) K) against a chunk run to its end, equal to rounding
                    assert x.dtype == y.dtype and same(x, y, which == "exact"), (which, n)


def forwards(model, monkeypatch):
    """Record the token shape of every forward the model runs."""
    shapes, hidden = [], type(model).hidden

    def spy(self, inputs, cache=None):
        shapes.append(tuple(inputs.shape))
        return hidden(self, inputs, cache)

    monkeypatch.setattr(type(model), "hidden", spy)
    return shapes


def req(rid, prompt):
    return GenerationRequest(rid, tuple(prompt), stop=STOP)


@pytest.mark.parametrize("chunk", [2048, 200])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("which", ["exact", "fast"])
def test_a_cold_prompt_runs_the_forwards_it_runs_with_the_cache_off(which, batch, chunk, request, monkeypatch):
    # Three blocks of 256 and then some: with the cache on, the same forwards (count and shapes) as with it off,
    # the entry keeps its 256 and 512 snapshots, and a prompt sharing 600 tokens starts from 512 with the tokens
    # of a cold start.
    model = request.getfixturevalue(which)
    shapes = forwards(model, monkeypatch)
    runs = {}
    for on in (False, True):
        config = GatewayConfig(
            batch=batch, prompt_cache_bytes=(1 << 30) * on, prompt_cache_block=256 * on, prefill_chunk=chunk
        )
        g = Gateway(model, config)
        shapes.clear()
        g.submit(req("a", SYSTEM + (7, 8, 9)), CollectingSink())
        g.run_until_idle()
        runs[on] = list(shapes)
        if on:
            sink = CollectingSink()
            placement = g.submit(req("b", SYSTEM + (11, 12)), sink)
            g.run_until_idle()
            assert placement.cached_tokens == 512 and g.prompt_cache.stats().block_hits == 1
            assert g.prompt_cache.lookup(SYSTEM[:300] + (5,)).tokens == SYSTEM[:256]
            monkeypatch.undo()
            assert sink.token_ids == [t.token_id for t in generate(model, SYSTEM + (11, 12), stop=STOP)]
    assert runs[True] == runs[False]
    prefills = [s for s in runs[True] if s[1] > 1]
    assert [s[1] for s in prefills] == ([602] if chunk == 2048 else [200, 200, 200, 2])


@pytest.mark.parametrize("chunk, bitwise", [(2048, True), (200, False)])
@pytest.mark.parametrize("which", ["exact", "fast", "fast32"])
def test_a_start_from_a_snapshot_gives_the_cold_logits(which, chunk, bitwise, request):
    # 512 is a 64-token chunk's end in a 602-token forward (a float32 state there is a cold start's bit for bit);
    # in 200-token forwards it falls inside one (equal to rounding on the fast tier, exact on the other). The fast
    # tier's default 16-bit state is kept rounded at a snapshot, so equal to rounding at a chunk's end too.
    model = request.getfixturevalue(which)
    first, other = SYSTEM + (7, 8, 9), SYSTEM + (11, 12)
    cache, fed, snapshots = model.make_cache(), [], []
    blocks = BlockSnapshots(256, lambda n, layers: snapshots.append((n, layers)))
    list(generate(model, first, stop=STOP, cache=cache, fed=fed, blocks=blocks, prefill_step_size=chunk))
    assert [n for n, _ in snapshots] == [256, 512]
    pc = PromptCache(1 << 30)
    pc.insert(CachedPrefix(first + tuple(fed), cache, tuple(snapshots)))
    hit = pc.lookup(other)
    assert len(hit.tokens) == 512

    def logits(cache=None, cached=0):
        out = []
        taps = generate(model, other, stop=STOP, cache=cache, cached_tokens=cached, tap=lambda s: out.append(s.logits))
        list(taps)
        return out

    for cold, warm in zip(logits(), logits(hit.cache, 512)):
        assert same(cold, warm, which == "exact" or (bitwise and which == "fast32"))


@pytest.mark.parametrize("which", ["exact", "fast"])
def test_batched_joiners_keep_their_own_boundaries_inside_shared_chunks(which, request):
    # Two joiners in one prefill group, one from a cached 23-token prefix: their 16-token boundaries fall at
    # other counts into the same 40-token forwards, and each snapshot holds the state of its prompt cut there.
    model = request.getfixturevalue(which)
    prompts = {"fresh": SYSTEM[:100], "hit": SYSTEM[200:300]}
    prefix = model.make_cache()
    prefill(model, prefix, mx.array(list(prompts["hit"][:24])))
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4, prefill_chunk=40), keep_caches=True, snapshot_block=16)
    sinks = {rid: CollectingSink() for rid in prompts}
    b.submit(req("fresh", prompts["fresh"]), sinks["fresh"])
    b.submit(req("hit", prompts["hit"]), sinks["hit"], CachedPrefix(prompts["hit"][:23], prefix))
    b.run_until_idle()
    for rid, prompt in prompts.items():
        (entry,) = [c for c in sinks[rid].result.caches if c.snapshots]
        assert [n for n, _ in entry.snapshots] == list(range(16 if rid == "fresh" else 32, 99, 16)), rid
        assert_cut_states(model, prompt, entry.snapshots, which == "exact")


def assert_cut_states(model, prompt, snapshots, bitwise: bool):
    """Each snapshot (count, layers) holds the state of `prompt` prefilled alone up to it (and its next token)."""
    for n, layers in snapshots:
        cut = model.make_cache()
        prefill(model, cut, mx.array(list(prompt[: n + 1])))
        for kept, c in zip(layers, cut):
            if kept is not None:
                for x, y in zip(kept.state, c.state):
                    assert same(x, y, bitwise), n


def test_the_copies_held_for_the_prompt_cache_stay_within_its_budget(exact):
    # Four 100-token prompts in one group: unbounded, each keeps 6 block snapshots (16..96) and its boundary.
    # Bounded, the earliest copies are made and no others (the rest would be refused by the prompt cache or
    # evict what fits): room for 8.5 snapshots gives r0 its 6, r1 two and nobody a boundary; room for all 24
    # and one boundary gives r0 alone its boundary.
    prompts = {f"r{i}": SYSTEM[i * 100 : i * 100 + 100] for i in range(4)}

    def run(budget):
        held = []
        b = ContinuousBatcher(
            exact,
            SchedulerConfig(max_rows=4),
            keep_caches=True,
            snapshot_block=16,
            keep_budget=None if budget is None else lambda: budget,
        )
        sinks = {rid: CollectingSink() for rid in prompts}
        for rid, prompt in prompts.items():
            b.submit(req(rid, prompt), sinks[rid])
        while b.step():
            held.append(sum(b._copied.values()))
        return sinks, held

    sinks, _ = run(None)
    snapshots = {rid: [n for c in s.result.caches for n, _ in c.snapshots] for rid, s in sinks.items()}
    assert snapshots == {rid: list(range(16, 99, 16)) for rid in prompts}
    assert all(len(s.result.caches) == 2 for s in sinks.values())  # the boundary, then the final caches
    one = sinks["r0"].result.caches[0]  # the boundary (prompt body), its snapshots on the final entry
    boundary = cache_nbytes(one.cache)
    state = cache_nbytes([c for c in sinks["r0"].result.caches[1].snapshots[0][1] if c is not None])
    assert boundary > state
    all_six = list(range(16, 99, 16))
    for budget, want, entries in (
        (8 * state + state // 2, {"r0": all_six, "r1": [16, 32], "r2": [], "r3": []}, [1, 1, 1, 1]),
        (24 * state + boundary, dict.fromkeys(prompts, all_six), [2, 1, 1, 1]),
    ):
        sinks, held = run(budget)
        assert {rid: [n for c in s.result.caches for n, _ in c.snapshots] for rid, s in sinks.items()} == want
        assert [len(s.result.caches) for s in sinks.values()] == entries  # a boundary where it fitted, then final
        assert max(held) <= budget
