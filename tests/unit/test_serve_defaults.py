"""What `engine serve` resolves from its defaults: the batch cap, the decode buckets, the warm-up."""

from pathlib import Path

import pytest

from engine.batch.runner import chunk_buckets, power_buckets
from engine.gateway import FAST_PREFILL_ITL, Gateway, GatewayConfig, default_batch
from engine.kernels import EXACT, FAST, on_cuda
from engine.loading import load_model
from engine.request import GenerationRequest, StopCriteria
from engine.server.main import ServeConfig
from engine.sinks import CollectingSink
from engine.warmup import default_warmup, warm_dense_rows, warm_up


def test_defaults_fit_the_device():
    assert default_batch() == (64 if on_cuda() else 8)
    assert default_warmup() == ("full" if on_cuda() else "quick")
    assert ServeConfig().gateway_config().batch == default_batch()


def test_decode_buckets_auto_pads_the_fast_tier_only():
    assert power_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and power_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    cfg = ServeConfig(batch=16)
    assert cfg.gateway_config(FAST).decode_buckets == (1, 2, 4, 8, 16)
    assert cfg.gateway_config(EXACT).decode_buckets == ()  # bit-exact with mlx-lm at every row count
    assert cfg.gateway_config(FAST).prefill_buckets == chunk_buckets(cfg.prefill_chunk)
    assert cfg.gateway_config(EXACT).prefill_buckets == ()
    assert ServeConfig(prefill_buckets=()).gateway_config(FAST).prefill_buckets == ()
    assert (cfg.gateway_config(FAST).prefill_budget, cfg.gateway_config(EXACT).prefill_budget) == (
        cfg.prefill_chunk,
        None,
    )
    assert ServeConfig(prefill_budget=0).gateway_config(FAST).prefill_budget is None
    assert ServeConfig(prefill_budget=512).gateway_config(EXACT).prefill_budget == 512
    # prefill pacing beside decoding rows: the fast tier's; off on the exact tier (mlx-lm's whole chunks)
    assert (cfg.gateway_config(FAST).prefill_itl, cfg.gateway_config(EXACT).prefill_itl) == (FAST_PREFILL_ITL, None)
    assert ServeConfig(prefill_itl=0).gateway_config(FAST).prefill_itl is None
    assert ServeConfig(kv_bits=8).gateway_config(FAST).prefill_itl is None  # a first chunk of full-precision keys
    assert ServeConfig(prefill_itl=4.0).gateway_config(EXACT).prefill_itl == 4.0
    assert ServeConfig(batch=16, kv_bits=8).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=1).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=16, decode_buckets=()).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=16, decode_buckets=(4, 16)).gateway_config(EXACT).decode_buckets == (4, 16)
    with pytest.raises(ValueError, match="quantized KV"):
        ServeConfig(batch=16, kv_bits=8, decode_buckets=(4, 16)).gateway_config(FAST)
    # the fast tier prefills up to 32 prompts together, in groups of powers of two; the exact tier 8, as mlx-lm
    assert cfg.gateway_config(FAST).prefill_groups == (1, 2, 4, 8, 16, 32)
    assert (cfg.gateway_config(FAST).prefill_batch, cfg.gateway_config(EXACT).prefill_batch) == (32, 8)
    assert ServeConfig(prefill_batch=4).gateway_config(FAST).prefill_groups == (1, 2, 4)
    assert ServeConfig(prefill_batch=4).gateway_config(EXACT).prefill_batch == 4
    assert cfg.gateway_config(EXACT).prefill_groups == ()
    assert ServeConfig(batch=16, kv_bits=8).gateway_config(FAST).prefill_groups == ()
    assert ServeConfig(prefill_groups=()).gateway_config(FAST).prefill_groups == ()


def requests(stages) -> int:
    return sum(st.requests for st in stages)


@pytest.mark.parametrize("mode, requests", [("off", 0), ("quick", 2), ("full", 2 + 8)])
def test_warmups(tiny_path, mode, requests):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    gateway = Gateway(model, GatewayConfig(batch=8, decode_buckets=(1, 2, 4, 8)))
    lines = []
    stages = warm_up(gateway, mode, log=lines.append)
    assert sum(st.requests for st in stages) == requests
    assert [st.name for st in stages] == {"off": [], "quick": ["first requests"], "full": ["decode rows 1-10"]}[mode]
    assert lines == [st.line() for st in stages] and all(st.shapes > 0 and st.seconds > 0 for st in stages)
    decoded = {shape[1] for shape in gateway.shapes if shape[0] == "decode"}
    assert decoded == ({1, 2, 4, 8} if mode == "full" else {2} if mode == "quick" else set())
    gateway.mark_ready()
    assert gateway.shapes_at_ready == len(gateway.shapes)


def test_the_dense_copies_warm_up_takes_every_decode_row_count_again(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    gateway = Gateway(model, GatewayConfig(batch=4, decode_buckets=(1, 2, 4), prompt_cache_bytes=1 << 20))
    lines = []
    (stage,) = warm_dense_rows(gateway, log=lines.append)
    assert (stage.name, stage.requests, lines) == ("decode rows on dense copies 1-4", 4, [stage.line()])
    assert {shape[1] for shape in gateway.shapes if shape[0] == "decode"} == {1, 2, 4}
    assert gateway.prompt_cache.stats().entries == 0
    assert warm_dense_rows(Gateway(model, GatewayConfig(batch=1))) == []  # no continuous lane


def test_the_full_warmup_runs_a_prompt_of_each_chunk_bucket(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    gateway = Gateway(
        model,
        GatewayConfig(batch=4, decode_buckets=(1, 2, 4), prefill_buckets=(16, 24, 32), prompt_cache_bytes=1 << 20),
    )
    # 16 and 24 tokens, and 15 and 23 right-padded to them; 32 tokens do not fit a 30-token context
    assert requests(warm_up(gateway, "full", context=30)) == 2 + 4 + 4
    assert {("prefill", 1, n, padded) for n in (16, 24) for padded in (False, True)} <= gateway.shapes
    assert gateway.prompt_cache.stats().entries == 0  # a client's prompt never reuses the warm-up's


@pytest.mark.parametrize(
    "block, idle, warmup_requests",
    [
        # 5 chunk buckets, filled and a token short, and a prompt of two 64-token chunks and a 15-token one, then
        # groups: 2 prompts of 16-32 tokens, 3 of 16 (a share of 21 rounds down to bucket 16), 5 of 16
        (0, None, 2 + 8 + 5 + 5 + 1 + 2 * 3 + 3 * 1 + 5 * 1),
        # block snapshots every 24 tokens cut no chunk (kept from inside the forwards): the same warm-up
        (24, None, 2 + 8 + 5 + 5 + 1 + 2 * 3 + 3 * 1 + 5 * 1),
        # an idle budget of 128: the groups take longer chunks, 2 prompts of 16-64 tokens, 3 of 16-32, 5 of 16-24
        (0, 128, 2 + 8 + 5 + 5 + 1 + 2 * 5 + 3 * 3 + 5 * 2),
    ],
)
def test_after_the_full_warmup_a_burst_takes_no_new_shape(tiny_path, block, idle, warmup_requests):
    # Decode rows, prefill chunks and prefill groups padded to their buckets, and a warm-up that runs each
    # prefill group bucket at every chunk bucket a group of its size can take, right-padded: a burst of prompts of
    # any length, arriving at once, runs only the warm-up's forward shapes, with the prompt cache's block
    # snapshots as without.
    model = load_model(tiny_path("tiny-qwen35"))[0]
    config = GatewayConfig(
        batch=8,
        prefill_chunk=64,
        prefill_budget=64,
        idle_prefill_budget=idle,
        decode_buckets=power_buckets(8),
        prefill_buckets=chunk_buckets(64),
        prefill_groups=(1, 2, 4, 8),
        prompt_cache_bytes=(1 << 24) * (block > 0),
        prompt_cache_block=block,
    )
    gateway = Gateway(model, config)
    assert requests(warm_up(gateway, "full")) == warmup_requests
    assert {("prefill", 2, 24, True), ("prefill", 4, 16, True), ("prefill", 8, 16, True)} <= gateway.shapes
    gateway.mark_ready()
    before = set(gateway.shapes)
    sinks = []
    for i, n in enumerate((5, 17, 30, 44, 9, 63, 2, 100)):
        sinks.append(CollectingSink())
        gateway.submit(
            GenerationRequest(
                f"burst-{i}",
                tuple(7 + (i * 31 + j) % 500 for j in range(n)),
                stop=StopCriteria(max_tokens=3, ignore_eos=True),
            ),
            sinks[-1],
        )
    gateway.run_until_idle()
    assert all(len(s.token_ids) == 3 for s in sinks)
    assert gateway.shapes == before, gateway.shapes - before


def test_the_warmup_keeps_to_the_kv_budget(tiny_path):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    probe = Gateway(model, GatewayConfig(batch=4))
    budget = probe.layout.row_bytes(17, 2)  # a 16-token chunk's prompt fits, a 300-token one's does not
    gateway = Gateway(
        model, GatewayConfig(batch=4, decode_buckets=(1, 2, 4), prefill_buckets=(16, 300), kv_budget=budget)
    )
    assert requests(warm_up(gateway, "full")) == 2 + 4 + 2  # 16 tokens and 15 right-padded to them


def test_with_a_kernel_cache_the_full_warmup_first_builds_every_bucket_unrun(tiny_path, monkeypatch):
    # the decode buckets' and short chunks' forwards are built but not run, so their kernels compile together
    # (the CPU has none to compile); nothing of them stays: the warm-up's and a request's tokens are as without
    from engine.kernels.cuda_source import BUILDS
    from engine.kernels.kernel_cache import KernelCache

    model = load_model(tiny_path("tiny-qwen35"))[0]
    config = GatewayConfig(batch=4, prefill_chunk=64, decode_buckets=(1, 2, 4), prefill_buckets=(16, 24, 32, 64))
    outputs = []
    for cache in (None, KernelCache(Path("/nonexistent"), lambda source, kernel: (b"", ""))):
        monkeypatch.setattr(BUILDS, "cache", cache)
        gateway = Gateway(model, config)
        lines = []
        stages = warm_up(gateway, "full", log=lines.append)
        assert [st.name for st in stages][0] == ("kernel builds" if cache else "decode rows 1-6")
        sink = CollectingSink()
        gateway.submit(
            GenerationRequest("after", tuple(range(5, 40)), stop=StopCriteria(max_tokens=6, ignore_eos=True)), sink
        )
        gateway.run_until_idle()
        outputs.append(sink.token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_the_cuda_buffer_cache_is_64_gib_at_most_half_the_device():
    from engine.device import CUDA_MLX_CACHE, cuda_cache_limit

    assert CUDA_MLX_CACHE == 64 << 30
    assert cuda_cache_limit({"total_memory": 143 << 30}) == 64 << 30  # an H200
    assert cuda_cache_limit({"memory_size": 80 << 30}) == 40 << 30
    assert cuda_cache_limit({"device_name": "a GPU"}) == 64 << 30  # no memory reported


def test_serve_turns_mlx_s_cache_thrashing_check_off_before_it_loads(monkeypatch):
    # MLX's check counts a cache's misses over the process's life and raises at twice its capacity: in a long-lived
    # server, every step meeting a new graph topology past that would fail
    import os

    import engine.server.main as server_main
    from engine.cli import main
    from engine.device import THRASHING_CHECK, serve_environment

    seen = {}
    monkeypatch.delenv(THRASHING_CHECK, raising=False)
    monkeypatch.setattr(server_main, "serve", lambda cfg: seen.setdefault("check", os.environ.get(THRASHING_CHECK)))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/tmp/engine-test-kernels")
    main(["serve", "--model", "tiny-qwen35"])
    assert seen == {"check": "0"}
    given = {THRASHING_CHECK: "1"}
    serve_environment(given)
    assert given == {THRASHING_CHECK: "1"}  # a value the user set stays
