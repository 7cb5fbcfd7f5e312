"""The fast tier's compiled prompt chunks (`KernelConfig.compiled_prefill`): each layer's chunk as compiled calls
computes, on the CPU, what the layer's own path computes bit for bit: logits, caches, block snapshots, serial
and in a batch (masked rows, a cached prefix, joiners)."""

import mlx.core as mx
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.generate import BlockSnapshots, generate
from engine.kernels import FAST, KernelConfig, install
from engine.loading import load_model
from engine.request import CachedPrefix, GenerationRequest, StopCriteria
from engine.sinks import CollectingSink

PROMPT = tuple(3 + (i * 37) % 200 for i in range(130))
STOP = StopCriteria(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-qwen35-4bit", "tiny-qwen35-f32"])
def model(request, tiny_path):
    return load_model(tiny_path(request.param))[0]


def installed(model, compiled: bool):
    install(model, KernelConfig(FAST, force=True, compiled_prefill=compiled))
    return model


def test_only_a_prompt_chunk_takes_the_compiled_layer(model):
    for compiled in (False, True):
        installed(model, compiled)
        for layer, cache in zip(model.layers, model.make_cache()):
            x = mx.zeros((1, 20, model.text_args.hidden_size), dtype=layer.input_layernorm.weight.dtype)
            ran = layer.fused_step(x, None, cache) is not None
            assert ran == compiled, (compiled, layer.is_linear)


def serial_run(model, compiled: bool):
    installed(model, compiled)
    cache, logits, snapshots = model.make_cache(), [], []
    blocks = BlockSnapshots(24, lambda n, layers: snapshots.append((n, layers)))
    taps = generate(
        model,
        PROMPT,
        stop=STOP,
        cache=cache,
        blocks=blocks,
        prefill_step_size=48,
        tap=lambda s: logits.append(s.logits),
    )
    tokens = [t.token_id for t in taps]
    states = [[a for c in layers if c is not None for a in c.state] for _, layers in snapshots]
    return tokens, logits, [a for c in cache for a in c.state], [n for n, _ in snapshots], states


def test_a_serial_prompt_in_chunks_computes_the_layers_own_path_bit_for_bit(model):
    plain, compiled = serial_run(model, False), serial_run(model, True)
    assert compiled[0] == plain[0] and compiled[3] == plain[3] and plain[3]
    for got, want in zip(compiled[1] + compiled[2], plain[1] + plain[2]):
        assert mx.array_equal(got, want).item()
    for got, want in zip(compiled[4], plain[4]):
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def batch_run(model, compiled: bool):
    # a fresh prompt and one from a cached 23-token prefix join in one prefill group (right-padded, masked),
    # with 16-token block snapshots falling inside the 40-token forwards
    installed(model, compiled)
    prompts = {"fresh": PROMPT[:100], "hit": PROMPT[10:90]}
    prefix = model.make_cache()
    list(generate(model, prompts["hit"][:23], stop=StopCriteria(max_tokens=1, ignore_eos=True), cache=prefix))
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=4, prefill_chunk=40), keep_caches=True, snapshot_block=16)
    sinks = {rid: CollectingSink() for rid in prompts}
    b.submit(GenerationRequest("fresh", prompts["fresh"], stop=STOP), sinks["fresh"])
    b.submit(
        GenerationRequest("hit", prompts["hit"], stop=STOP), sinks["hit"], CachedPrefix(prompts["hit"][:23], prefix)
    )
    b.run_until_idle()
    out = {}
    for rid, sink in sinks.items():
        entries = sink.result.caches
        states = [a for e in entries for c in e.cache for a in c.state]
        snaps = [a for e in entries for _, layers in e.snapshots for c in layers if c is not None for a in c.state]
        out[rid] = (sink.token_ids, states, snaps)
    return out


def test_a_batch_with_a_cached_prefix_computes_the_layers_own_path_bit_for_bit(model):
    plain, compiled = batch_run(model, False), batch_run(model, True)
    for rid, (tokens, states, snaps) in plain.items():
        got_tokens, got_states, got_snaps = compiled[rid]
        assert got_tokens == tokens and len(got_states) == len(states) and len(got_snaps) == len(snaps) > 0, rid
        for got, want in zip(got_states + got_snaps, states + snaps):
            assert mx.array_equal(got, want).item(), rid
