"""Kernel tiers: selection and fallback (everywhere), the kernels' numerics (CUDA only for the GEMV).

On a CUDA machine: `python3 -m pytest -q tests/unit/test_kernels.py` (harness/gpu/README.md).
"""

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from tf32 import rerun_without_tf32

from engine.kernels import EXACT, FAST, KernelConfig, KernelSet, install, on_cuda
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.kernels.gated_delta_prepare import chunk_prepare
from engine.kernels.gated_delta_states import chunk_states
from engine.kernels.quantized_gemv import (
    BITS,
    DENSE_MIN_ROWS,
    GROUP_SIZES,
    LAYER_MAX_ROWS,
    LAYER_MIN_OUTPUTS,
    KernelQuantizedLinear,
    LaunchConfig,
    dense_matmul,
    launch_bounds,
    launch_config,
    quantized_matmul,
    quantized_matmuls,
    refusal,
    staged,
    tile_k,
)
from engine.kernels.quantized_gemv.fusion import Fusion
from engine.kernels.quantized_gemv.layer import _takes
from engine.kernels.quantized_gemv.layouts import StagedLayouts
from engine.kernels.quantized_gemv.staged import MIN_ROWS as STAGED_MIN_ROWS
from engine.kernels.quantized_gemv.staged import StagedConfig, in_turn, shared_request, splits, staged_config
from engine.kernels.quantized_gemv.staged import takes as staged_takes
from engine.models.base import project
from engine.models.gated_delta import CHUNKED_MIN_TOKENS, gated_delta_update, recurrence
from harness.kernels.bench import delta_inputs, rounded_reference, rounding_bound

cuda_only = pytest.mark.cuda  # the kernels are built only on MLX's CUDA backend: skipped elsewhere (conftest)
FAST_ANYWHERE = KernelConfig(FAST, force=True)  # the fast tier off CUDA too (its quantized layers then run MLX's op)


def make_quantized(n=64, k=128, bits=4, group_size=64, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    layer = nn.Linear(k, n, bias=False)
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = make_quantized(n=2048)
        self.layers = [make_quantized(seed=1), nn.Linear(8, 8)]  # 64 outputs: stays on MLX's kernel


def test_fast_tier_off_cuda_keeps_exact_and_says_why():
    if on_cuda():
        pytest.skip("on CUDA the fast tier applies")
    m = Tiny()
    ks = install(m, KernelConfig(FAST))
    assert ks == KernelSet(tier=EXACT, requested=FAST, reason=ks.reason)
    assert "CUDA" in ks.reason
    assert type(m.proj) is nn.QuantizedLinear


def test_install_swaps_quantized_layers_and_back_without_copying_weights():
    m = Tiny()
    weight = m.proj.weight
    ks = install(m, FAST_ANYWHERE)
    assert ks.tier == FAST and ks.quantized_linears == (1 if on_cuda() else 0)  # off CUDA every layer falls back
    assert isinstance(m.proj, KernelQuantizedLinear) and isinstance(m.layers[0], KernelQuantizedLinear)
    assert type(m.layers[1]) is nn.Linear
    assert m.proj.weight is weight
    assert install(m, KernelConfig(EXACT)).tier == EXACT
    assert type(m.proj) is nn.QuantizedLinear and m.proj.weight is weight


def test_small_matrices_keep_mlx_kernel():
    small = KernelQuantizedLinear.from_module(make_quantized(n=64), use_kernel=True)
    big = KernelQuantizedLinear.from_module(make_quantized(n=2048), use_kernel=True)
    assert not small.use_kernel and "64 outputs" in small.kernel_refusal
    assert big.use_kernel and big.kernel_refusal is None


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown kernel tier"):
        KernelConfig(tier="turbo")


def test_kernel_layer_falls_back_to_mlx_off_cuda_bit_exact():
    if on_cuda():
        pytest.skip("on CUDA the kernel runs")
    q = make_quantized()
    x = mx.random.normal((1, 3, 128)).astype(mx.bfloat16)
    assert mx.array_equal(KernelQuantizedLinear.from_module(q, use_kernel=False)(x), q(x)).item()


def test_rows_past_the_kernel_run_as_one_matrix(monkeypatch):
    # MLX's quantized matmul takes a batch [B, 1, K] as B one-row products, each reading all the weights:
    # the layer hands it the rows as one [B, K] matrix.
    q = make_quantized(n=256, k=128)
    layer = KernelQuantizedLinear.from_module(q, use_kernel=False)
    x = mx.random.normal((5, 1, 128)).astype(mx.bfloat16)
    want = q(x.reshape(5, 128)).reshape(5, 1, 256)
    shapes, real = [], mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **kw: shapes.append(x.shape) or real(x, *a, **kw))
    got = layer(x)
    assert shapes == [(5, 128)] and got.shape == (5, 1, 256)
    assert mx.array_equal(got, want).item()


def test_projections_off_cuda_run_each_layer_as_mlx_does():
    # Off CUDA (and in the exact tier) `project` is each layer's own call: the graph mlx-lm builds.
    layers = [make_quantized(n=n, seed=n) for n in (2048, 64, 48)]
    x = mx.random.normal((1, 2, 128)).astype(mx.bfloat16)
    want = [q(x) for q in layers]
    for got in (
        project(x, *layers),
        project(x, *[KernelQuantizedLinear.from_module(q, use_kernel=False) for q in layers]),
    ):
        assert len(got) == 3 and all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_kernel_layer_takes_bf16_rows_up_to_the_limit_of_its_input_size():
    q = make_quantized(n=2048, k=128)
    assert _takes(mx.zeros((1, LAYER_MAX_ROWS, 128), dtype=mx.bfloat16), q)
    assert not _takes(mx.zeros((1, LAYER_MAX_ROWS + 1, 128), dtype=mx.bfloat16), q)
    assert not _takes(mx.zeros((1, 128), dtype=mx.float32), q)
    assert not _takes(mx.zeros((1, 256), dtype=mx.bfloat16), q)


def test_small_matrices_may_join_a_group():
    small = KernelQuantizedLinear.from_module(make_quantized(n=48), use_kernel=True)
    assert small.groupable and not small.use_kernel
    assert not KernelQuantizedLinear.from_module(make_quantized(n=48), use_kernel=False).groupable


@pytest.mark.parametrize(
    "shape, dtype, bits, group, expect",
    [
        ((1, 128), mx.bfloat16, 4, 64, None),
        ((16, 128), mx.bfloat16, 8, 32, None),
        ((65, 128), mx.bfloat16, 4, 64, "65 rows"),
        ((1, 128), mx.float32, 4, 64, "float32 activations"),
        ((1, 128), mx.bfloat16, 4, 128, "group size 128"),
        ((1, 128), mx.bfloat16, 3, 32, "3-bit"),
    ],
)
def test_gate_of_the_gemv_kernel(shape, dtype, bits, group, expect):
    q = make_quantized(bits=bits if bits in (4, 8) else 4, group_size=group if group in (32, 64) else 64)
    x = mx.zeros(shape, dtype=dtype)
    why = refusal(x, q.weight, q.scales, group, bits)
    assert why == expect if expect is None else expect in why


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_gemv_k_tiles_fit_inside_one_group(bits, group):
    # The kernel scales each k-tile's products by one group's scale: a tile must not straddle groups, and any
    # input size MLX can quantize (a multiple of the group size) must be whole tiles.
    assert group % tile_k(group, bits) == 0


@pytest.mark.parametrize(
    "kernels",
    [
        {},
        pytest.param({"states": chunk_states}, marks=cuda_only, id="states_kernel"),
        pytest.param({"states": chunk_states, "prepare": chunk_prepare}, marks=cuda_only, id="both_kernels"),
    ],
)
@pytest.mark.parametrize(
    "t, hk, hv, masked", [(1, 2, 2, False), (63, 2, 4, False), (130, 2, 4, True), (300, 4, 8, False)]
)
def test_chunked_delta_rule_matches_the_recurrence(t, hk, hv, masked, kernels):
    # (`kernels`: the rule's parts as CUDA launches, gated_delta_states' and gated_delta_prepare's)
    q, k, v, g, beta, state = delta_inputs(t, hk, hv, 32, 16, dtype=mx.float32, seed=t)
    state = state + 0.1
    mask = (mx.arange(t) >= t // 3)[None] if masked else None
    y_ref, s_ref = recurrence(q, k, v, g, beta, state, mask)
    y, s = chunked_gated_delta(q, k, v, mx.log(g), beta, state, mask, **kernels)
    # Same inputs, float32 throughout, another order of the sums: agreement to float32 rounding. On CUDA
    # MLX runs float32 matrix products as TF32 by default (MLX_ENABLE_TF32=1: 10-bit mantissa inputs), and
    # the chunked form is matrix products where the recurrence is elementwise: there ~1e-3 relative.
    tol = 2e-3 if on_cuda() else 1e-5
    assert mx.abs(s - s_ref).max().item() < tol
    if masked:  # outputs at padded positions are not used; compare the real ones
        y, y_ref = y[:, t // 3 :], y_ref[:, t // 3 :]
    assert mx.abs(y - y_ref).max().item() < tol


def test_chunked_delta_rule_takes_a_decay_that_underflowed_to_zero():
    # A head that forgets at once (exp(A) * softplus(a + dt_bias) > ~87) has g == 0 in float32: the chunked
    # form takes log g (-inf here, or any finite value below its floor) and must not turn that into NaN where
    # the recurrence simply clears the state.
    q, k, v, g, beta, state = delta_inputs(70, 1, 2, 8, 8, dtype=mx.float32)
    g[:, 10] = 0.0
    g[:, 40:50] = 0.0
    log_g = mx.log(g)
    log_g[:, 60] = -1e30
    g[:, 60] = 0.0
    y_ref, s_ref = recurrence(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, log_g, beta, state)
    tol = 2e-3 if on_cuda() else 1e-4
    assert mx.abs(y - y_ref).max().item() < tol
    assert mx.abs(s - s_ref).max().item() < tol


def test_delta_update_uses_chunked_only_for_long_inputs_without_trace():
    calls = []

    def spy(*args):
        calls.append(args[0].shape[1])
        return chunked_gated_delta(*args)

    q, k, v, _, _, state = delta_inputs(CHUNKED_MIN_TOKENS, 2, 2, 16, 16, dtype=mx.float32)
    a = mx.zeros(q.shape[:3])
    b = mx.zeros(q.shape[:3])
    A_log, dt_bias = mx.zeros(2), mx.ones(2)
    gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, chunked=spy)
    gated_delta_update(q[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1], A_log, dt_bias, state, chunked=spy)
    gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, trace=[], chunked=spy)
    assert calls == [CHUNKED_MIN_TOKENS]


@cuda_only
@pytest.mark.parametrize("bits, group", [(4, 64), (4, 32), (8, 64), (8, 32)])
# M: every decode row bucket (1, 2, 4, 8, 16, 32, 64) and the counts just past or short of one (3, 9, 17, 33,
# 63: a partial 8-row block), so the one-row launch, the staged kernel's 2-64 rows and its layouts by row count
# (wide from 33, rounded weights from 32); N: a partial 16-row tile (48 with two tiles per block, 1000) and K
# with >= 256 k-tiles (17408, another launch shape; 1536 unsplit). Each case compiles a kernel.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9, 16, 17, 32, 33, 63, 64])
@pytest.mark.parametrize("n, k", [(48, 5120), (1000, 1536), (4096, 17408)])
def test_gemv_kernel_matches_mlx(bits, group, m, n, k):
    q = make_quantized(n=n, k=k, bits=bits, group_size=group, seed=m)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    if staged_takes(m, k, group, bits, Fusion()) and staged_config(m, k, group, bits).rounded:
        exact = rounded_reference(
            x, q.weight, q.scales, q.biases, group, bits
        )  # from a batch of 32 rows the weights enter rounded (RW=1)
    else:
        with mx.stream(mx.cpu):  # float32 on the CPU (no TF32); weights dequantized in float32, not rounded
            f32 = mx.float32
            w = mx.dequantize(q.weight, q.scales.astype(f32), q.biases.astype(f32), group, bits)
            exact = x.astype(f32) @ w.T
    out = quantized_matmul(x, q.weight, q.scales, q.biases, group, bits).astype(mx.float32)
    # The only rounding that matters is the bf16 output (half an ulp, at most 2^-8 relative); float32 sums in
    # any order add far less. (MLX's own kernel is not held to this: it rounds dequantized weights to bf16,
    # ~5e-3 off at K = 5120 on this data, which is why the fast tier is not bit-exact with it either way.)
    tol = rounding_bound(exact)
    assert mx.all(mx.abs(out - exact) <= tol).item(), mx.abs(out - exact).max().item()


def test_dense_matmul_computes_the_quantized_layer():
    q = make_quantized(n=256, k=128, dtype=mx.float32)  # float32: both sides sum in float32
    x = mx.random.normal((3, 40, 128))
    want = q(x)
    # On CUDA MLX runs float32 matmuls as TF32 (10-bit mantissas in, unless MLX_ENABLE_TF32=0): measured
    # 5e-5 of max on the H200, bounded here by TF32's unit roundoff. The layer never takes this path in
    # float32 (DENSE_DTYPES); bf16 layers measured equal to MLX's quantized matmul on an H200.
    bound = 2.0**-11 if on_cuda() else 1e-5
    got = dense_matmul(x, q.weight, q.scales, q.biases, q.group_size, q.bits)
    assert mx.abs(got - want).max().item() <= bound * mx.abs(want).max().item()


def test_prompt_chunks_past_the_kernels_rows_take_the_dense_path(monkeypatch):
    import engine.kernels.quantized_gemv.layer as layer_module

    calls = []
    monkeypatch.setattr(layer_module, "dense_matmul", lambda x, *_: calls.append(x.shape) or x)  # a spy
    assert DENSE_MIN_ROWS == LAYER_MAX_ROWS + 1  # MLX's quantized matmul takes no prompt chunk
    never = KernelQuantizedLinear.from_module(make_quantized(n=1024, k=64), True, dense_min_rows=None)
    large = KernelQuantizedLinear.from_module(make_quantized(n=1024, k=64), use_kernel=True)
    small = KernelQuantizedLinear.from_module(make_quantized(n=48, k=64), use_kernel=True)
    off_cuda = KernelQuantizedLinear.from_module(make_quantized(n=1024, k=64), use_kernel=False)
    in_float32 = KernelQuantizedLinear.from_module(make_quantized(n=1024, k=64, dtype=mx.float32), True)
    chunk = mx.zeros((1, DENSE_MIN_ROWS, 64), dtype=mx.bfloat16)
    for layer in (off_cuda, in_float32, never):
        layer(chunk)
    assert calls == []
    large(chunk[:, :-1])  # one row short: the kernel's rows (here, below its outputs, MLX's matmul)
    assert calls == []
    large(chunk)
    small(chunk)  # a matrix of few outputs too
    assert calls == [chunk.shape, chunk.shape]


def test_kept_dense_weights_give_the_dense_path_s_products_bit_for_bit():
    # keep_dense: the dequantized copy made once gives what dequantizing per chunk gives, and stays out of the
    # module's parameters; a re-install drops it
    q = make_quantized(n=256, k=128)
    per_chunk = KernelQuantizedLinear.from_module(q, True, min_outputs=0)
    kept = KernelQuantizedLinear.from_module(q, True, min_outputs=0, keep_dense=True)
    assert per_chunk.kept is None and kept.kept is not None
    assert "kept" not in kept and set(dict(tree_flatten(kept.parameters()))) == set(dict(tree_flatten(q.parameters())))
    x = mx.random.normal((2, DENSE_MIN_ROWS, 128)).astype(mx.bfloat16)
    assert mx.array_equal(kept(x), per_chunk(x)).item()
    assert KernelQuantizedLinear.from_module(q, False, keep_dense=True).kept is None  # no dense path off the kernel


def test_a_model_with_kept_dense_weights_prefills_the_same_logits():
    from engine.engine import Engine

    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    config = replace(_stand_in(lambda x, layers, **_: tuple(q.mlx_matmul(x) for q in layers)), dense_min_rows=8)
    prompt = mx.array([list(range(3, 40))])
    runs = []
    for keep in (False, True):
        install(model, replace(config, keep_dense=keep))
        kept = [m for _, m in model.named_modules() if getattr(m, "kept", None) is not None]
        assert bool(kept) == keep
        runs.append(model(prompt, model.make_cache()))
    assert mx.array_equal(*runs).item()
    install(model, KernelConfig(EXACT))
    assert not any(getattr(m, "kept", None) is not None for _, m in model.named_modules())


def test_chunks_below_a_raised_dense_threshold_run_the_kernel_in_pieces():
    # dense_min_rows above the kernel's rows: a chunk between them goes through the launch in pieces of at most
    # LAYER_MAX_ROWS rows (here a stand-in launch computing MLX's product), and equals the layer's product
    q = make_quantized(n=256, k=128)
    launched = []

    def launch(x, layers, **stages):
        launched.append(x.shape)
        return (layers[0].mlx_matmul(x),)

    layer = KernelQuantizedLinear.from_module(q, True, min_outputs=0, dense_min_rows=200, launch=launch)
    x = mx.random.normal((2, 75, 128)).astype(mx.bfloat16)
    assert mx.array_equal(layer(x), q(x)).item()
    assert launched == [(1, 64, 128), (1, 64, 128), (1, 22, 128)]
    launched.clear()
    layer(x[:, :30])  # 60 rows: one launch
    assert launched == [(2, 30, 128)]


@cuda_only
def test_kernel_layer_runs_the_compiled_kernel():
    q = make_quantized(n=2048, k=512)
    layer = KernelQuantizedLinear.from_module(q, use_kernel=True)
    for m in (1, LAYER_MAX_ROWS, LAYER_MAX_ROWS + 1):
        x = mx.random.normal((1, m, 512)).astype(mx.bfloat16)
        want = quantized_matmul(x, q.weight, q.scales, q.biases, 64, 4) if m <= LAYER_MAX_ROWS else q(x)
        assert mx.array_equal(layer(x), want).item()


@cuda_only
@pytest.mark.parametrize("bits, group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("m", [1, 5, 9, 33])
@pytest.mark.parametrize("rows", [(2048, 1024), (1500, 512, 48, 48), (4096,), (12288, 1024)])
def test_one_launch_for_several_matrices_equals_one_each(bits, group, m, rows):
    # Each matrix's blocks compute exactly what its own launch does: identical results.
    qs = [make_quantized(n=n, k=1536, bits=bits, group_size=group, seed=i) for i, n in enumerate(rows)]
    x = mx.random.normal((1, m, 1536)).astype(mx.bfloat16)
    together = quantized_matmuls(x, [(q.weight, q.scales, q.biases) for q in qs], group, bits)
    for q, y in zip(qs, together):
        assert mx.array_equal(y, quantized_matmul(x, q.weight, q.scales, q.biases, group, bits)).item()
    layers = [KernelQuantizedLinear.from_module(q, use_kernel=True) for q in qs]
    projected = project(x, *layers)
    want = together if m <= LAYER_MAX_ROWS and sum(rows) >= LAYER_MIN_OUTPUTS else [q(x) for q in layers]
    assert all(mx.array_equal(a, b).item() for a, b in zip(projected, want))


@cuda_only
@pytest.mark.parametrize("bits, group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("m", [1, 5, 9, 17, 64])
def test_gated_launch_gives_the_swiglu_of_both_products(bits, group, m):
    # A block computes the same gate and up rows it would in a plain launch (same sums, bit for bit), then
    # rounds them to bf16, silu(gate) to bf16 and the product to bf16: two roundings of 2^-8 each from
    # silu(gate) * up computed in float32 on the bf16 products (expf's error is far below).
    gate_q, up_q = (make_quantized(n=2048, k=1536, bits=bits, group_size=group, seed=s) for s in (1, 2))
    pair = [(q.weight, q.scales, q.biases) for q in (gate_q, up_q)]
    x = mx.random.normal((1, m, 1536)).astype(mx.bfloat16)
    gate, up = quantized_matmuls(x, pair, group, bits)
    (y,) = quantized_matmuls(x, pair, group, bits, gated=True)
    assert y.shape == gate.shape and y.dtype == mx.bfloat16
    g32, u32 = gate.astype(mx.float32), up.astype(mx.float32)
    want = g32 * mx.sigmoid(g32) * u32
    assert mx.all(mx.abs(y.astype(mx.float32) - want) <= 2.0**-7 * mx.abs(want)).item()


def test_fused_stages_refuse_what_they_cannot_take():
    # Checked before any kernel is built, so on every backend.
    qs = [make_quantized(n=n, k=128, seed=i) for i, n in enumerate((64, 64, 32))]
    triples = [(q.weight, q.scales, q.biases) for q in qs]
    x = mx.zeros((1, 1, 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="two matrices of one shape"):
        quantized_matmuls(x, triples[:1], 64, 4, gated=True)
    with pytest.raises(ValueError, match="two matrices of one shape"):
        quantized_matmuls(x, triples[1:], 64, 4, gated=True)
    with pytest.raises(ValueError, match="norm_scale takes the norm"):
        quantized_matmuls(x, triples[:2], 64, 4, norm_scale=True)
    with pytest.raises(ValueError, match="a residual or norm_out goes with one matrix"):
        quantized_matmuls(x, triples[:2], 64, 4, residual=mx.zeros((1, 1, 64), dtype=mx.bfloat16))
    next_w = mx.ones((64,), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="a residual or norm_out goes with one matrix"):
        quantized_matmuls(x, triples[:2], 64, 4, norm_out=next_w)
    with pytest.raises(ValueError, match="one value a row"):
        quantized_matmuls(x, triples[2:], 64, 4, norm_out=next_w)
    parts = mx.zeros((1, 4), dtype=mx.float32)
    with pytest.raises(ValueError, match="prenormed takes"):
        quantized_matmuls(
            x, triples[:1], 64, 4, prenormed=(parts, 1e-6), norm=(mx.ones((128,), dtype=mx.bfloat16), 1e-6)
        )
    with pytest.raises(ValueError, match="prenormed takes"):
        quantized_matmuls(x, triples[:1], 64, 4, prenormed=(parts.astype(mx.bfloat16), 1e-6))


@cuda_only
@pytest.mark.parametrize("m", [1, 5, 17, 32, 64])
@pytest.mark.parametrize("k", [1536, 6144])
def test_norm_out_hands_the_next_launch_its_norm(m, k):
    # Fusion.norm_out: the launch's result is its plain residual launch's, bit for bit; hw is bf16(h * nw) as
    # engine_mul2 rounds; the blocks' parts of the sums of squares add up to sum(h^2) (float32, another order).
    # Fusion.prenormed on hw then equals norm_scale on h up to the order of those float32 sums, which moves
    # the scale by ~2^-20 and so a bf16 output by at most one rounding (2^-7 of |y|). K 6144 from 9 rows: the
    # staged kernel splits K and the sums' launch runs the stages. From 2 rows prenormed runs on the staged
    # kernel, whose warps add a row's k-tiles in k order, and norm_scale on the register kernel: its launch here
    # has each warp add every k-tile too (its default at 2-8 rows splits K over 2 warps: other float32 sums of
    # the products, which near-zero outputs do not survive within one rounding).
    n = 2048
    proj = make_quantized(n=n, k=k, seed=7)
    mats = [make_quantized(n=1024, k=n, seed=s) for s in (8, 9)]
    pair = [(q.weight, q.scales, q.biases) for q in mats]
    out = mx.random.normal((1, m, k)).astype(mx.bfloat16)
    x = (4 * mx.random.normal((1, m, n))).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((n,))).astype(mx.bfloat16)
    f32 = mx.float32
    h, hw, ssq = quantized_matmuls(out, [(proj.weight, proj.scales, proj.biases)], 64, 4, residual=x, norm_out=nw)
    (plain,) = quantized_matmuls(out, [(proj.weight, proj.scales, proj.biases)], 64, 4, residual=x)
    assert mx.array_equal(h, plain).item()
    assert mx.array_equal(hw, (h.astype(f32) * nw.astype(f32)).astype(mx.bfloat16)).item()
    assert ssq.dtype == f32 and ssq.shape[0] == m
    assert mx.allclose(ssq.sum(axis=-1), (h.astype(f32) ** 2).sum(axis=-1).reshape(m), rtol=1e-5).item()

    got = quantized_matmuls(hw, pair, 64, 4, prenormed=(ssq, 1e-6))
    in_order = LaunchConfig(2, 1, 4, row_groups=2) if m >= STAGED_MIN_ROWS else None
    want = quantized_matmuls(h, pair, 64, 4, in_order, norm=(nw, 1e-6), norm_scale=True)
    for y, w in zip(got, want):
        assert mx.all(mx.abs(y.astype(f32) - w.astype(f32)) <= 2.0**-7 * mx.abs(w.astype(f32))).item()
    # gated: the same sums and scale as the launch above, then silu(gate) * up (test_gated_launch's bound)
    (y,) = quantized_matmuls(hw, pair, 64, 4, gated=True, prenormed=(ssq, 1e-6))
    g32, u32 = got[0].astype(f32), got[1].astype(f32)
    expect = g32 * mx.sigmoid(g32) * u32
    assert mx.all(mx.abs(y.astype(f32) - expect) <= 2.0**-7 * mx.abs(expect)).item()


def _stage_names(stages: dict) -> tuple:
    # the stages a `run_kernel` call asks for, by name
    return tuple(sorted(k for k, v in stages.items() if v is not None and v is not False))


def _reference_launch(
    x, layers, norm=None, residual=None, gated=False, norm_scale=False, norm_out=None, prenormed=None
):
    # quantized_gemv.run_kernel's results from MLX operations (the stages residual_mlp asks for), so the
    # plumbing runs on any backend: norm_out's parts as one block's
    from engine.kernels.quantized_gemv.dense import stages

    ys = [
        mx.quantized_matmul(
            x, q["weight"], q["scales"], q["biases"], transpose=True, group_size=q.group_size, bits=q.bits
        )
        for q in layers
    ]  # as q(x) off CUDA (no bias); on CUDA q(x) is a launch
    return stages(x, ys, residual, gated, norm_out, prenormed)


def _stand_in(launch_as, calls=None, taken=None):
    """A fast-tier config whose GEMV launches all go through `launch_as(x, layers, **stages)`, on any backend and
    for matrices of every size (the tiny models' are below the kernel's minimum); `calls` gets each launch's
    stages by name, `taken` the norm weights norm_out takes."""

    def launch(x, layers, **stages):
        if calls is not None:
            calls.append(_stage_names(stages))
        if taken is not None and stages.get("norm_out") is not None:
            taken.append(stages["norm_out"])
        return launch_as(x, layers, **stages)

    return KernelConfig(FAST, force=True, gemv_min_outputs=0, gemv_stand_in=launch)


def test_residual_mlp_takes_the_norm_in_the_projection_launch():
    # The plumbing of Fusion.norm_out / prenormed in a decoder layer (which launch gets which norm weight, eps,
    # result and residual), with the launches as MLX operations: against the layer's MLP half after the
    # residual projection, to the rounding of a norm taken as norm_scale takes it (2^-5 of the values).
    from engine.engine import Engine
    from engine.kernels import layer_launches
    from engine.kernels.quantized_gemv import Fusion

    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    calls = []
    install(model, _stand_in(_reference_launch, calls))
    layer = model.layers[0]
    proj = layer.linear_attn.out_proj
    out = mx.random.normal((1, 1, proj.weight.shape[1] * 32 // proj.bits)).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, layer.post_attention_layernorm.weight.shape[0])).astype(mx.bfloat16)
    (got,) = layer_launches.residual_mlp(layer, out, proj, x, Fusion(residual=True, gated=True, norm_out=True))
    assert calls == [("norm_out", "residual"), ("gated", "prenormed"), ("residual",)]
    want = layer_launches.mlp_half(layer, layer_launches.residual_projection(out, proj, x, Fusion()), Fusion())
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = mx.abs(want.astype(mx.float32)).max()
    assert mx.all(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)) <= 2.0**-5 * scale).item()


def _handoff_decode(launch_as):
    # A tiny Qwen3.5's decode (6 forced tokens) with the fast tier's layer steps, the epilogues without and
    # with Fusion.norm_out, every GEMV launch through `launch_as(x, layers, **stages)`: the logits of each,
    # and of the norm_out run's first step (where the compiled steps are traced, and the attention kernels'
    # step runs as it does every step) the launches' stages and the norm weights norm_out took, in order.
    from dataclasses import replace

    from engine.engine import Engine
    from engine.kernels.quantized_gemv import Fusion

    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    calls, taken = [], []
    config = _stand_in(launch_as, calls, taken)

    def decode(fusion):
        install(model, replace(config, fusion=fusion))
        cache = model.make_cache()
        model(mx.array([list(range(3, 11))]), cache)
        calls.clear(), taken.clear()
        logits = [model(mx.array([[20]]), cache)[0, -1]]
        first = list(calls), list(taken)
        logits += [model(mx.array([[t]]), cache)[0, -1] for t in range(21, 26)]
        mx.eval(logits)
        install(model, KernelConfig(EXACT))
        return logits, first

    want, _ = decode(Fusion(residual=True, gated=True))
    got, (first_calls, first_taken) = decode(Fusion(residual=True, gated=True, norm_out=True))
    layers = model.layers
    # every layer's output projection takes its MLP norm, every down launch but the last the next layer's
    # input norm; every gate+up launch and every layer's input projections but the first's take one
    launches = Counter(first_calls)
    assert launches[("norm_out", "residual")] == 2 * len(layers) - 1
    assert launches[("gated", "prenormed")] == len(layers)
    assert launches[("prenormed",)] == len(layers) - 1
    norms = [
        w for a, b in zip(layers, layers[1:]) for w in (a.post_attention_layernorm.weight, b.input_layernorm.weight)
    ]
    assert [id(w) for w in first_taken] == [id(w) for w in norms + [layers[-1].post_attention_layernorm.weight]]
    return want, got


def _as_accurate(want, got) -> bool:
    """Whether the norm_out run is as accurate as the run with every norm an operation of its own, both against
    the float32 reference of the same forced tokens, by the numerics gate's criterion (harness.kernels.gate)."""
    from engine.synth import ensure_model
    from harness.kernels.float_reference import reference_logits
    from harness.kernels.gate import KL_RATIO, KL_SLACK, TOP1_MARGIN, score

    (ref,) = reference_logits(ensure_model("tiny-qwen35-4bit"), [list(range(3, 11)) + list(range(20, 26))], [9], 6)
    apart, handed = score(ref, mx.stack(want)), score(ref, mx.stack(got))
    return (
        handed.mean_kl <= KL_RATIO * apart.mean_kl + KL_SLACK
        and handed.top1_agreement >= apart.top1_agreement - TOP1_MARGIN
    )


def test_layers_hand_the_next_layer_its_input_norm():
    # Fusion.norm_out across layers (engine.kernels.norm_handoff): each layer step's down launch also takes
    # the next layer's input norm, and that layer's input projections take it as prenormed. The launches run
    # as MLX operations (_reference_launch), so the plumbing runs on any backend, against the same steps with
    # every norm an operation of its own. The norms then scale the products instead of the activations (one
    # bf16 rounding moved), which on this random-weight model moves the logits by up to 0.035 of the largest
    # against each other, as far as a wrong norm does (0.042): so each run is scored against the float32
    # reference (mean KL 6.8e-4 against 6.6e-4 measured), and which norm each launch takes is checked above.
    assert _as_accurate(*_handoff_decode(_reference_launch))


@cuda_only
def test_layers_hand_the_next_layer_its_input_norm_in_the_kernels():
    # The same with the GEMV kernel's launches, the tiny model's (below the kernel's minimum rows) included:
    # the parts come from the blocks of the launch before.
    from engine.kernels.quantized_gemv import run_kernel

    assert _as_accurate(*_handoff_decode(run_kernel))


def test_a_layer_takes_only_the_norm_left_for_its_own_input():
    from engine.kernels.norm_handoff import LayerLink, NormSlot

    first, second = nn.RMSNorm(8), nn.RMSNorm(8)
    slot = NormSlot()
    giver, taker = LayerLink(slot, first, second), LayerLink(slot, second, None)
    h, hw, ssq = mx.ones((1, 1, 8)), mx.zeros((1, 1, 8)), mx.zeros((1, 1))
    assert giver.pass_on((h, hw, ssq)) is h
    assert taker.take(mx.ones((1, 1, 8))) == ()  # another array, equal or not
    giver.pass_on((h, hw, ssq))
    assert LayerLink(slot, first, None).take(h) == ()  # another layer's norm
    giver.pass_on((h, hw, ssq))
    parts = taker.take(h)
    assert len(parts) == 2 and parts[0] is hw and parts[1] is ssq
    assert taker.take(h) == ()  # taken once
    assert taker.pass_on((h,)) is h and slot.h is None  # the last layer leaves nothing


@cuda_only
@pytest.mark.parametrize("m", [1, 5, 9, 33])
def test_norm_scale_takes_the_norm_after_the_products(m):
    # Fusion.norm_scale: r * sum_k w_k bf16(x_k nw_k), r = rsqrt(mean(x^2) + eps) from the block's own loads,
    # against the products of MLX's rms_norm output a_k = bf16(nw_k bf16(x_k r)) (as engine_norm2 rounds).
    # Both approximate x_k nw_k r: a_k within two bf16 roundings (2^-8 each), r bf16(x_k nw_k) within one, so
    # the products differ by at most 3 * 2^-8 < 2^-6 of sum |w| |a| (float32 sums and rsqrt far below), and
    # the bf16 outputs add an ulp each (2^-7 of |y| for both). Also with the gated SwiGLU after it.
    k = 1536
    qs = [make_quantized(n=n, k=k, seed=i) for i, n in enumerate((2048, 2048, 1024))]
    triples = [(q.weight, q.scales, q.biases) for q in qs]
    x = (4 * mx.random.normal((1, m, k))).astype(mx.bfloat16)
    norm_w = (1 + 0.1 * mx.random.normal((k,))).astype(mx.bfloat16)
    normed = mx.fast.rms_norm(x, norm_w, 1e-6)

    def bound(q, a, y):
        with mx.stream(mx.cpu):
            w = mx.abs(mx.dequantize(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32), 64, 4))
            return 2.0**-6 * (mx.abs(a.astype(mx.float32)) @ w.T) + 2.0**-7 * mx.abs(y.astype(mx.float32))

    fused = quantized_matmuls(x, triples, 64, 4, norm=(norm_w, 1e-6), norm_scale=True)
    for q, y, want in zip(qs, fused, quantized_matmuls(normed, triples, 64, 4)):
        assert y.shape == want.shape
        assert mx.all(mx.abs(y.astype(mx.float32) - want.astype(mx.float32)) <= bound(q, normed, want)).item()

    # gated: a block sums and scales the gate and up rows as the launch above does (same loads, same order),
    # so against silu(gate) * up of its results the bound is test_gated_launch's
    (y,) = quantized_matmuls(x, triples[:2], 64, 4, norm=(norm_w, 1e-6), gated=True, norm_scale=True)
    g32, u32 = fused[0].astype(mx.float32), fused[1].astype(mx.float32)
    want = g32 * mx.sigmoid(g32) * u32
    assert mx.all(mx.abs(y.astype(mx.float32) - want) <= 2.0**-7 * mx.abs(want)).item()


@cuda_only
@pytest.mark.parametrize("m", [1, 5, 33])
def test_residual_in_the_launch_equals_the_add_after_it(m):
    # The product rounded to bf16, added to the residual in float32 and rounded: what MLX's bf16 add does.
    q = make_quantized(n=2048, k=1536)
    x = mx.random.normal((1, m, 1536)).astype(mx.bfloat16)
    residual = mx.random.normal((1, m, 2048)).astype(mx.bfloat16)
    (y,) = quantized_matmuls(x, [(q.weight, q.scales, q.biases)], 64, 4, residual=residual)
    assert mx.array_equal(y, residual + quantized_matmul(x, q.weight, q.scales, q.biases, 64, 4)).item()


def test_gemv_stages_by_name():
    from engine.kernels.quantized_gemv import Fusion

    assert Fusion.parse("residual, gated") == Fusion(residual=True, gated=True)
    assert Fusion.parse("none") == Fusion.parse("") == Fusion()
    for f in (
        Fusion(),
        Fusion(residual=True, gated=True, norm_scale=True),
        Fusion(residual=True, gated=True, norm_out=True),
    ):
        assert Fusion.parse(f.names()) == f
    with pytest.raises(ValueError, match="unknown GEMV stages"):
        Fusion.parse("residual,fused")
    with pytest.raises(ValueError, match=r"unknown GEMV stages \['norm', 'swiglu'\]"):  # measured slower, not built
        Fusion.parse("norm,swiglu")
    with pytest.raises(ValueError, match="name norm_out"):
        Fusion.parse("residual,prenormed")


def test_the_environment_sets_the_stages_and_launch_shapes_of_a_config():
    from engine.kernels.quantized_gemv import DEFAULT_FUSION

    assert KernelConfig.from_env(FAST, {}).fusion == DEFAULT_FUSION and KernelConfig.from_env(FAST, {}).launches == {}
    config = KernelConfig.from_env(FAST, {"ENGINE_FUSE": "gated,norm_scale", "ENGINE_GEMV_LAUNCH": "5120x17408=8,1,4"})
    assert config.fusion.names() == "gated,norm_scale" and config.launches == {(5120, 17408): LaunchConfig(8, 1, 4)}
    assert config.settings()["launches"] == "5120x17408=8,1,4" and config.settings()["fusion"] == "gated,norm_scale"
    with pytest.raises(ValueError, match=r"unknown GEMV stages \['turbo'\]"):
        KernelConfig.from_env(FAST, {"ENGINE_FUSE": "turbo"})
    with pytest.raises(ValueError, match="ENGINE_GEMV_LAUNCH"):
        KernelConfig.from_env(FAST, {"ENGINE_GEMV_LAUNCH": "5120x17408=8"})
    assert not KernelConfig.from_env(FAST, {}).compiled_prefill
    assert KernelConfig.from_env(FAST, {"ENGINE_COMPILED_PREFILL": "1"}).settings()["compiled_prefill"] is True
    with pytest.raises(ValueError, match="ENGINE_COMPILED_PREFILL must be 0 or 1"):
        KernelConfig.from_env(FAST, {"ENGINE_COMPILED_PREFILL": "yes"})
    assert KernelConfig.from_env(FAST, {}).scan_tokens == 0
    assert KernelConfig.from_env(FAST, {"ENGINE_SCAN_TOKENS": "128"}).settings()["scan_tokens"] == 128
    with pytest.raises(ValueError, match="ENGINE_SCAN_TOKENS must be a whole number"):
        KernelConfig.from_env(FAST, {"ENGINE_SCAN_TOKENS": "-1"})
    assert KernelConfig.from_env(FAST, {}).attention_group_rows == 0
    assert KernelConfig.from_env(FAST, {"ENGINE_ATTENTION_GROUP_ROWS": "16"}).settings()["attention_group_rows"] == 16
    with pytest.raises(ValueError, match="ENGINE_ATTENTION_GROUP_ROWS must be a whole number"):
        KernelConfig.from_env(FAST, {"ENGINE_ATTENTION_GROUP_ROWS": "some"})
    assert KernelConfig.from_env(FAST, {"ENGINE_KEEP_DENSE": "1"}).settings()["keep_dense"] is True
    assert KernelConfig.from_env(FAST, {"ENGINE_KEEP_DENSE": "auto"}).settings()["keep_dense"] == "auto"
    assert not KernelConfig.from_env(FAST, {"ENGINE_KEEP_DENSE": "auto"}).keep_dense  # none made at load
    with pytest.raises(ValueError, match="ENGINE_KEEP_DENSE must be 0, 1 or auto"):
        KernelConfig.from_env(FAST, {"ENGINE_KEEP_DENSE": "on"})


def test_the_installed_layers_take_the_config():
    from engine.engine import Engine

    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    table = {(2048, 5120): LaunchConfig(8, 1, 4)}
    ks = install(model, KernelConfig(FAST, force=True, launches=table, dense_min_rows=None, gemv_min_outputs=64))
    layers = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear)]
    assert layers and all(q.launches == frozenset(table.items()) and q.dense_min_rows is None for q in layers)
    assert all(q.min_outputs == 64 for q in layers)
    assert ks.settings["dense_min_rows"] is None and ks.settings["launches"] == "2048x5120=8,1,4"
    ks = install(model, KernelConfig(FAST, force=True, delta_step_kernel=False, attention_step=False))
    assert ks.attention_step_layers == ks.step_kernel_layers == 0
    assert all(layer.fused_step is None for layer in model.layers if not layer.is_linear)
    install(model, KernelConfig(EXACT))
    assert not any(isinstance(m, KernelQuantizedLinear) for _, m in model.named_modules())


def test_a_register_cap_names_its_kernel_apart():
    # MLX caches compiled kernels by name and template values: a capped kernel must not reuse the plain one.
    plain, capped = LaunchConfig(4, 1, 4), LaunchConfig(4, 1, 4, min_blocks=8)
    assert plain.template() != capped.template()
    assert "__launch_bounds__(128, 8)" in launch_bounds(128, 8) and launch_bounds(128, 0) == ""


@cuda_only
@pytest.mark.parametrize("config", [LaunchConfig(4, 1, 4, 8), LaunchConfig(4, 1, 4, 9), LaunchConfig(4, 2, 4, 5)])
def test_register_capped_gemv_equals_the_plain_one(config):
    # The cap changes register allocation (and spills), not the arithmetic: identical results.
    q = make_quantized(n=3000, k=5120)
    x = mx.random.normal((1, 1, 5120)).astype(mx.bfloat16)
    plain = LaunchConfig(config.warps, config.row_tiles, config.batch)
    args = (x, q.weight, q.scales, q.biases, 64, 4)
    assert mx.array_equal(quantized_matmul(*args, config=config), quantized_matmul(*args, config=plain)).item()


def test_one_row_launch_shapes_by_size():
    # H200 timings at M = 1: launches of few rows take more warps a block; large ones two row tiles a block,
    # at most 96 registers a thread (five blocks an SM); the rest (4, 1, 4).
    assert launch_config(1, 5120, 64, 4, rows=17408) == LaunchConfig(4, 2, 4, 5)
    assert launch_config(1, 5120, 64, 4, rows=2 * 17408) == LaunchConfig(4, 2, 4, 5)  # gate + up
    assert launch_config(1, 5120, 64, 4, rows=12288) == LaunchConfig(4, 1, 4)
    assert launch_config(1, 17408, 64, 4, rows=5120) == LaunchConfig(8, 1, 4, 3)  # one wave: 3 blocks an SM
    assert launch_config(1, 6144, 64, 4, rows=5120) == LaunchConfig(8, 1, 4)


def test_gemv_launch_setting_replaces_one_row_launch_shapes():
    import engine.kernels.quantized_gemv as qg

    table = qg.parse_launches(" 5120x17408=8,1,4 ; 5120x6144=16,1,4,2;")
    assert table == {(5120, 17408): LaunchConfig(8, 1, 4), (5120, 6144): LaunchConfig(16, 1, 4, 2)}
    assert [c.setting() for c in table.values()] == ["8,1,4", "16,1,4,2"]  # as diagnostics write them
    assert qg.parse_launches(qg.launches_setting(table)) == table
    assert launch_config(1, 17408, 64, 4, rows=5120, launches=table) == LaunchConfig(8, 1, 4)
    assert launch_config(1, 6144, 64, 4, rows=5120, launches=table) == LaunchConfig(16, 1, 4, 2)
    assert launch_config(2, 17408, 64, 4, rows=5120, launches=table) == LaunchConfig(2, 1, 4)  # one-row launches only
    assert launch_config(1, 5120, 64, 4, rows=17408, launches=table) == LaunchConfig(4, 2, 4, 5)
    for bad in (
        "5120x17408=8,1",
        "5120=8,1,4",
        "5120x17408=0,1,4",
        "5120x17408=8,1,4,2,2",
        "5120x17408=8,1,4,-1",
        "axb=1,1,1",
    ):
        with pytest.raises(ValueError, match="ENGINE_GEMV_LAUNCH"):
            qg.parse_launches(bad)


@cuda_only
@pytest.mark.parametrize("n", [17408, 3000])
def test_two_row_tiles_equal_one_at_m1(n):
    # Rows per block change which block sums a row, not the sum: identical results.
    q = make_quantized(n=n, k=5120)
    x = mx.random.normal((1, 1, 5120)).astype(mx.bfloat16)
    args = (x, q.weight, q.scales, q.biases, 64, 4)
    one, two = (
        quantized_matmul(*args, config=LaunchConfig(4, 1, 4)),
        quantized_matmul(*args, config=LaunchConfig(4, 2, 4)),
    )
    assert mx.array_equal(one, two).item()


@cuda_only
@pytest.mark.parametrize("m", [17, 40, 64])
@pytest.mark.parametrize("stages", ["plain", "residual", "gated"])
def test_slices_of_the_activation_rows_change_no_bit(m, stages):
    # Warps that split the activation rows (m_groups) sum each row exactly as one warp of all rows does (same
    # K split and batch: those set which k-tiles a warp adds); nor do more row tiles a warp (RT) change a
    # bit, or, where a warp adds every k-tile (no K split), another batch (U).
    q, up = make_quantized(n=3000, k=5120, seed=1), make_quantized(n=3000, k=5120, seed=2)
    x = mx.random.normal((m, 5120)).astype(mx.bfloat16)
    residual = mx.random.normal((m, 3000)).astype(mx.bfloat16)

    def run(config):
        matrices = [(q.weight, q.scales, q.biases)] + (stages == "gated") * [(up.weight, up.scales, up.biases)]
        return quantized_matmuls(
            x, matrices, 64, 4, config, residual=residual if stages == "residual" else None, gated=stages == "gated"
        )[0]

    split_k = [
        LaunchConfig(4, 1, 4, row_groups=2),
        LaunchConfig(8, 1, 4, 1, row_groups=2, m_groups=2),
        LaunchConfig(16, 1, 4, 1, row_groups=2, m_groups=4),
        LaunchConfig(32, 1, 4, 1, row_groups=2, m_groups=8),
        LaunchConfig(8, 2, 4, 2, row_groups=2, m_groups=2),
        LaunchConfig(8, 4, 4, 1, m_groups=4),
    ]
    whole_k = [
        LaunchConfig(2, 1, 1, row_groups=2),
        LaunchConfig(4, 4, 1, 2, row_groups=2, m_groups=2),
        LaunchConfig(4, 2, 2, 4, m_groups=4),
    ]
    for first, *others in (split_k, whole_k):
        whole = run(first)
        for sliced in others:
            assert mx.array_equal(whole, run(sliced)).item(), (first, sliced)


@cuda_only
@pytest.mark.parametrize("m", [9, 17, 40, 64])
@pytest.mark.parametrize("stages", ["plain", "residual", "gated"])
def test_staged_kernel_sums_as_the_register_kernel_without_a_k_split(m, stages):
    # From MIN_ROWS rows the staged kernel takes a launch; unsplit (K 5120), each row's k-tiles are added in k
    # order with the register kernel's arithmetic, so it equals a register launch whose warps add every k-tile;
    # its chunks, stages, warps and row tiles change no bit, and a split K stays within the float32 bound.
    q, up = make_quantized(n=3000, k=5120, seed=1), make_quantized(n=3000, k=5120, seed=2)
    x = mx.random.normal((m, 5120)).astype(mx.bfloat16)
    residual = mx.random.normal((m, 3000)).astype(mx.bfloat16)

    def run(config=None):
        matrices = [(q.weight, q.scales, q.biases)] + (stages == "gated") * [(up.weight, up.scales, up.biases)]
        return quantized_matmuls(
            x, matrices, 64, 4, config, residual=residual if stages == "residual" else None, gated=stages == "gated"
        )[0]

    staged = run(replace(staged_config(m, 5120, 64, 4), rounded=0, splits=1))
    assert mx.array_equal(staged, run(LaunchConfig(2, 1, 1, row_groups=2))).item()
    for layout in (
        StagedConfig(warps=8, row_tiles=1),
        StagedConfig(warps=2, row_tiles=4),
        StagedConfig(stages=2),
        StagedConfig(stages=4),
        StagedConfig(chunk_tiles=4),
        StagedConfig(m_groups=2),
        StagedConfig(m_groups=4, stages=2),
    ):
        assert mx.array_equal(staged, run(layout)).item(), layout
    whole = staged.astype(mx.float32)
    split = run(StagedConfig(splits=2)).astype(mx.float32)
    assert mx.all(mx.abs(split - whole) <= 2.0**-7 * mx.abs(whole) + 1e-3).item()


@cuda_only
@pytest.mark.parametrize("m", [9, 17, 33, 63])
@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(m_groups=2),
        dict(m_groups=4, stages=2),
        dict(m_groups=2, splits=2),
        dict(min_blocks=2, m_groups=2, stages=2),
        dict(warps=2, m_groups=2),
        dict(warps=8, row_tiles=2),
        dict(warps=4, m_groups=2),
    ],
)
def test_staged_layouts_match_float32(m, layout):
    # Each staged layout against the float32 product (test_gemv_kernel_matches_mlx's bound): splits add the
    # same float32 sums in another order; m groups and register caps change no sum.
    q = make_quantized(n=1000, k=6144, seed=m)
    x = mx.random.normal((m, 6144)).astype(mx.bfloat16)
    with mx.stream(mx.cpu):
        f32 = mx.float32
        exact = x.astype(f32) @ mx.dequantize(q.weight, q.scales.astype(f32), q.biases.astype(f32), 64, 4).T
    out = quantized_matmul(x, q.weight, q.scales, q.biases, 64, 4, config=StagedConfig(**layout)).astype(mx.float32)
    tol = rounding_bound(exact)
    assert mx.all(mx.abs(out - exact) <= tol).item(), mx.abs(out - exact).max().item()


@cuda_only
@pytest.mark.parametrize("bits, group", [(4, 64), (4, 32), (8, 64), (8, 32)])
@pytest.mark.parametrize("m", [9, 16, 17, 32, 33, 63, 64])
@pytest.mark.parametrize("n, k", [(1000, 1536), (4096, 17408)])
def test_rounded_staged_kernel_sums_the_weights_rounded_once(bits, group, m, n, k):
    # rounded = 1: each weight enters as bf16 round(q * scale + bias) (one rounding) and every product adds into
    # one float32 sum a row; against that function in float32, test_gemv_kernel_matches_mlx's bound (the bf16
    # output's rounding; float32 sums in another order add far less). The float32 model gate judges the
    # weights' rounding (harness kernels --gate-model).
    q = make_quantized(n=n, k=k, bits=bits, group_size=group, seed=m)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    want = rounded_reference(x, q.weight, q.scales, q.biases, group, bits)
    config = replace(staged_config(m, k, group, bits), rounded=1)
    out = quantized_matmul(x, q.weight, q.scales, q.biases, group, bits, config=config).astype(mx.float32)
    tol = rounding_bound(want)
    assert mx.all(mx.abs(out - want) <= tol).item(), mx.abs(out - want).max().item()


@cuda_only
@pytest.mark.parametrize("m", [17, 63])
@pytest.mark.parametrize(
    "layout",
    [
        dict(splits=2),
        dict(m_groups=2),
        dict(warps=2, m_groups=2),
        dict(stages=3),
        dict(stages=3, chunk_tiles=4),
        dict(warps=8, row_tiles=1),
        dict(min_blocks=2),
        dict(warps=8, row_tiles=2),
        dict(warps=8, row_tiles=2, m_groups=2),
        dict(warps=4, row_tiles=2, m_groups=2),
        dict(warps=2, row_tiles=4, m_groups=2),
    ],
)
def test_rounded_staged_layouts_sum_the_same_function(m, layout):
    # Unsplit, a rounded launch adds each row's k-tiles in k order whatever its warps, stages, chunks or m
    # groups: the same bits; a split K adds the same float32 sums in another order (the bound above).
    q = make_quantized(n=1000, k=6144, seed=m)
    x = mx.random.normal((m, 6144)).astype(mx.bfloat16)
    out = quantized_matmul(x, q.weight, q.scales, q.biases, 64, 4, config=StagedConfig(rounded=1, **layout))
    if "splits" not in layout:
        assert mx.array_equal(
            out, quantized_matmul(x, q.weight, q.scales, q.biases, 64, 4, config=StagedConfig(rounded=1))
        ).item()
    want = rounded_reference(x, q.weight, q.scales, q.biases, 64, 4)
    tol = rounding_bound(want)
    assert mx.all(mx.abs(out.astype(mx.float32) - want) <= tol).item()


@cuda_only
@pytest.mark.parametrize("m", [9, 40, 64])
@pytest.mark.parametrize("stages", ["residual", "gated"])
def test_rounded_staged_kernel_runs_the_fused_stages_on_its_sums(m, stages):
    # The fused stages take the rounded sums as they take the exact ones: a residual launch is its plain
    # launch's product rounded to bf16 and added; a gated one the SwiGLU of its two products (test_gated_launch's
    # bound); split or not.
    q, up = make_quantized(n=3000, k=5120, seed=1), make_quantized(n=3000, k=5120, seed=2)
    x = mx.random.normal((m, 5120)).astype(mx.bfloat16)
    residual = mx.random.normal((m, 3000)).astype(mx.bfloat16)
    f32 = mx.float32
    for n_splits in (1, 2):
        config = StagedConfig(rounded=1, splits=n_splits)
        plain = [quantized_matmuls(x, [(a.weight, a.scales, a.biases)], 64, 4, config)[0] for a in (q, up)]
        if stages == "residual":
            (y,) = quantized_matmuls(x, [(q.weight, q.scales, q.biases)], 64, 4, config, residual=residual)
            want = (residual.astype(f32) + plain[0].astype(f32)).astype(mx.bfloat16)
            assert mx.array_equal(y, want).item()
        else:
            (y,) = quantized_matmuls(x, [(a.weight, a.scales, a.biases) for a in (q, up)], 64, 4, config, gated=True)
            g32, u32 = plain[0].astype(f32), plain[1].astype(f32)
            want = g32 * mx.sigmoid(g32) * u32
            assert mx.all(mx.abs(y.astype(f32) - want) <= 2.0**-7 * mx.abs(want)).item()


def test_the_weights_enter_rounded_from_a_batch_of_32_rows(monkeypatch):
    # RW=1 from ROUNDED_ROWS rows of the batch, not of the launch: a window of W tokens over B rows (B x W rows)
    # computes what the batch's one-token steps compute, so greedy speculation keeps plain decoding's tokens.
    assert [staged_config(m, 5120, 64, 4).rounded for m in (2, 16, 31, 32, 33, 64)] == [0, 0, 0, 1, 1, 1]
    assert staged_config(64, 5120, 64, 4, batch=8).rounded == 0
    assert staged_config(64, 5120, 64, 4, StagedLayouts.parse("RW=0")).rounded == 0  # a layout still decides
    monkeypatch.setattr(staged, "matmuls", lambda x, matrices, group, bits, config, *rest: config)
    q = make_quantized(n=2048, k=5120)
    launch = [(q.weight, q.scales, q.biases)]
    for shape, rounded in (((8, 8, 5120), 0), ((16, 1, 5120), 0), ((32, 1, 5120), 1), ((32, 2, 5120), 1)):
        assert quantized_matmuls(mx.zeros(shape, dtype=mx.bfloat16), launch, 64, 4).rounded == rounded, shape
    assert quantized_matmuls(mx.zeros((40, 5120), dtype=mx.bfloat16), launch, 64, 4).rounded == 1


def test_staged_kernel_splits_long_inputs_only():
    # K past SPLIT_K_VALUES is split into the fewest even parts of at most SPLIT_K_VALUES: qwen27b's down
    # projection (17408) in 8, its output projections (6144) in 3, the projections of its hidden state in 4.
    assert [splits(k, 128) for k in (1536, 2048, 5120, 6144, 17408)] == [1, 1, 4, 3, 8]
    assert staged_config(16, 17408, 64, 4) == StagedConfig(stages=2, splits=8)
    assert staged_config(32, 1536, 64, 4) == StagedConfig(stages=2, splits=1, rounded=1)
    assert staged_config(48, 5120, 64, 4) == StagedConfig(warps=2, stages=2, m_groups=2, splits=4, rounded=1)
    assert staged_config(64, 5120, 64, 4) == StagedConfig(stages=2, splits=4, rounded=1)
    assert StagedConfig().chunk(64, 4) == 2 and StagedConfig().chunk(64, 8) == 4 and StagedConfig().chunk(32, 4) == 2
    assert staged_takes(2, 5120, 64, 4, Fusion()) and not staged_takes(1, 5120, 64, 4, Fusion())
    assert not staged_takes(16, 5120, 64, 4, Fusion(norm_scale=True)) and not staged_takes(16, 96, 64, 4, Fusion())


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("fusion", [Fusion(), Fusion(residual=True), Fusion(gated=True)], ids=lambda f: f.tag())
def test_staged_sources_store_their_products(split, fusion):
    # A launch that stores nothing leaves its output as the allocator found it, and a CUDA test comparing two
    # launches can still pass on a buffer reused from the first: an unsplit launch stores its results (with the
    # fused stages) after its loop, a split one its parts there and, in the loop, after each row block but the last.
    from engine.kernels.quantized_gemv import staged

    body = staged.source(2 if fusion.gated else 1, fusion, split)
    loop_end = body.index("multiply(it);")
    if split:
        assert body.count("part[((size_t)split * M + m) * NT") == 2 and "store(rb, m, row" not in body
        assert body.rindex("part[((size_t)split * M + m) * NT") > body.index("block_base += BR;") > loop_end
    else:
        assert body.count("store(rb, m, row, output(") == 1 and body.index("store(rb, m, row, output(") > loop_end
        assert "part[" not in body


def test_staged_launch_asks_for_shared_memory_past_48_kb():
    # MLX lets a kernel past 48 KB of shared memory (static and dynamic) only when it asks for more than 48000
    # bytes of dynamic memory: two 32-row stages (44 KB) with the prenormed parts' copy must ask for 48 KB.
    two = StagedConfig(stages=2)
    assert two.shared_bytes(32, 64, 4) == 2 * (32 * 136 * 2 + 128 * 24 * 4 + 4 * 128 * 2)
    assert shared_request(two, 32, Fusion(), 64, 4) == two.shared_bytes(32, 64, 4)
    assert shared_request(two, 32, Fusion(gated=True, prenormed=True), 64, 4) == 48 << 10
    assert shared_request(StagedConfig(stages=3), 64, Fusion(prenormed=True), 64, 4) == StagedConfig(
        stages=3
    ).shared_bytes(64, 64, 4)


def test_row_blocks_in_turn_keep_their_split_s_activations():
    # NR row blocks a block: its split's activation chunks (K / S / KC of them) stay in shared memory beside ST
    # stages of weights, scales and biases; only split launches whose threads copy rows a whole tile apart and
    # whose split's activations fit a block's shared memory.
    wide = StagedConfig(warps=2, m_groups=2, splits=4, row_blocks=4)
    x_chunk, rest = 64 * 136 * 2, 64 * 24 * 4 + 4 * 64 * 2
    assert wide.shared_bytes(64, 64, 4, 5120) == 10 * x_chunk + 2 * rest
    assert in_turn(wide, 64, 5120, 64, 4) == wide
    assert in_turn(StagedConfig(splits=4, row_blocks=2), 64, 5120, 32, 4).row_blocks == 1  # 254 KB at group 32
    assert in_turn(StagedConfig(splits=4, row_blocks=2), 16, 5120, 32, 4).row_blocks == 2
    assert in_turn(StagedConfig(row_blocks=4), 64, 5120, 64, 4).row_blocks == 1  # unsplit: results, not parts
    assert in_turn(StagedConfig(splits=4, row_blocks=4), 64, 5120, 64, 8).row_blocks == 1  # 8 copies a row
    assert StagedLayouts.parse("64:NR=4,KS=1024").fields(64) == {"row_blocks": 4, "split_values": 1024}


@cuda_only
@pytest.mark.parametrize("m", [9, 40, 64])
@pytest.mark.parametrize("layout", [dict(row_blocks=2), dict(row_blocks=3, warps=2, m_groups=2, rounded=1)])
@pytest.mark.parametrize("launch", ["plain", "gated", "three"])
def test_row_blocks_in_turn_change_no_bit(m, layout, launch):
    # A block taking its row blocks in turn adds each row's k-tiles of its split as a block of its own does:
    # the same parts, so the same bits (3000 rows: the last block's row blocks run past N; three matrices in one
    # launch: each matrix's blocks of row blocks after the one before's).
    n = {"plain": [3000], "gated": [3000, 3000], "three": [3000, 1000, 48]}[launch]
    mats = [make_quantized(n=rows, k=5120, seed=i + 1) for i, rows in enumerate(n)]
    x = mx.random.normal((m, 5120)).astype(mx.bfloat16)
    matrices = [(q.weight, q.scales, q.biases) for q in mats]
    gated = launch == "gated"
    one = StagedConfig(splits=4, **{key: v for key, v in layout.items() if key != "row_blocks"})
    want = quantized_matmuls(x, matrices, 64, 4, one, gated=gated)
    got = quantized_matmuls(x, matrices, 64, 4, replace(one, row_blocks=layout["row_blocks"]), gated=gated)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b).item()


def test_staged_m_groups_take_more_warps():
    assert StagedConfig(warps=4, m_groups=2).threads() == 256 and StagedConfig().threads() == 128
    assert StagedConfig(m_groups=2).shared_bytes(64, 64, 4) == StagedConfig().shared_bytes(64, 64, 4)


def _decode_states(model, ids, steps):
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache)
    out = []
    for _ in range(steps):
        token = mx.argmax(logits[:, -1:], axis=-1)
        logits = model(token, cache)
        out.append(logits[0, -1])
    mx.eval(out, [c.state for c in cache])
    return out, cache


def test_fused_decode_step_matches_the_layer_path():
    from engine.engine import Engine

    model = Engine.load("tiny-qwen35-f32", with_tokenizer=False).model
    ids = list(range(3, 11))  # 8 ids: prefill below CHUNKED_MIN_TOKENS, so only the decode step differs
    exact, exact_cache = _decode_states(model, ids, 12)
    # the float32 state the layer path keeps (a 16-bit state's rounding: test_a_16_bit_state_is_kept_in_its_dtype_...)
    fast_config = KernelConfig(FAST, force=True, attention_step=True, state_dtype="float32")
    assert install(model, fast_config).chunked_delta_layers > 0
    assert all(layer.fused_step is not None for layer in model.layers)  # DeltaNet and attention layers
    fast, fast_cache = _decode_states(model, ids, 12)
    install(model, KernelConfig(EXACT))
    assert all(layer.fused_step is None for layer in model.layers)
    # float32 model: the fused step computes the same float32 math with other roundings (the conv as a
    # multiply-sum, fused elementwise chains), so logits and states agree to float32 rounding.
    assert max(mx.abs(a - b).max().item() for a, b in zip(exact, fast)) < 1e-3
    for e, f in zip(exact_cache, fast_cache):
        for a, b in zip(e.state, f.state):
            assert mx.abs(a - b).max().item() < 1e-4


@pytest.mark.parametrize("prompt", [8, 40])  # below and above CHUNKED_MIN_TOKENS: the recurrence and the chunked rule
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])  # float16: the fast tier's default
def test_a_16_bit_state_is_kept_in_its_dtype_through_prefill_steps_and_traces(prompt, dtype):
    from engine.batch.kv_layout import kv_layout
    from engine.engine import Engine

    model = Engine.load("tiny-qwen35-f32", with_tokenizer=False).model
    ids = list(range(3, 3 + prompt))
    full, full_cache = _decode_states(model, ids, 12)
    wide = kv_layout(model).layers[0].fixed_bytes
    install(model, KernelConfig(FAST, force=True, state_dtype=dtype))
    try:
        half, half_cache = _decode_states(model, ids, 12)
        assert kv_layout(model).layers[0].fixed_bytes < wide
        recurrent = [c for c in half_cache if hasattr(c, "start_trace")]
        assert recurrent and all(c[1].dtype == getattr(mx, dtype) for c in recurrent)
        for c in recurrent:
            c.start_trace()
        model(mx.array([[5, 6, 7]]), half_cache)  # a traced window (speculative decoding) keeps the dtype too
        assert all(s.dtype == getattr(mx, dtype) for c in recurrent for s in c.trace.states)
    finally:
        install(model, KernelConfig(EXACT))
    assert all(c[1].dtype == mx.float32 for c in full_cache if hasattr(c, "start_trace"))
    # one rounding of the state a token, the math in float32: the logits follow the float32 state's
    assert max(mx.abs(a - b).max().item() for a, b in zip(full, half)) < 0.05
    with pytest.raises(ValueError, match="state dtype"):
        KernelConfig(FAST, state_dtype="float64")


def _delta_core_inputs(b, hk, hv, dk, dv, ks, bias_dtype):
    mx.random.seed(0)
    c, bf = 2 * hk * dk + hv * dv, mx.bfloat16
    return dict(
        qkv=mx.random.normal((b, 1, c)).astype(bf),
        z=mx.random.normal((b, 1, hv, dv)).astype(bf),
        a=mx.random.normal((b, 1, hv)).astype(bf),
        beta_logits=mx.random.normal((b, 1, hv)).astype(bf),
        conv_state=mx.random.normal((b, ks - 1, c)).astype(bf),
        state=0.1 * mx.random.normal((b, hv, dv, dk)),
        conv_w=(0.5 * mx.random.normal((c, ks, 1))).astype(bf),
        A_log=0.3 * mx.random.normal((hv,)),
        dt_bias=mx.random.normal((hv,)).astype(bias_dtype),
        norm_w=(1 + 0.1 * mx.random.normal((dv,))).astype(bf),
    )


@pytest.mark.parametrize("dk, dv", [(32, 32), (64, 128), (128, 128), (256, 256), (96, 384), (128, 512), (1024, 1024)])
def test_fused_delta_kernel_deals_every_state_row_once(dk, dv):
    from engine.kernels.gated_delta_step import launch_shape

    threads, rows = launch_shape(dk, dv)
    warps = threads // 32
    assert threads % 32 == 0 and dv <= threads <= max(512, dv) and rows * dk <= max(1024, dk)
    assert dv % (rows * warps) == 0  # the kernel's rounds: warp w, round i takes rows w + warps * (r + rows * i)
    dealt = sorted(
        w + warps * (r + rows * i) for i in range(dv // (rows * warps)) for w in range(warps) for r in range(rows)
    )
    assert dealt == list(range(dv))


def test_fused_delta_kernel_refuses_key_dims_above_value_dims():
    from engine.kernels.gated_delta_step import delta_step

    args = _delta_core_inputs(1, 1, 1, 64, 32, 4, mx.float32)
    with pytest.raises(ValueError, match="key dim 64"):
        delta_step(**args, norm_eps=1e-6, heads_k=1, dk=64)


@cuda_only
@pytest.mark.parametrize("state_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bias_dtype", [mx.float32, mx.bfloat16])
# qwen27b's heads (one round of state rows); batch rows; key dim below value dim; two value dims with more
# than one round of rows a warp (launch_shape)
@pytest.mark.parametrize(
    "b, hk, hv, dk, dv",
    [(1, 16, 48, 128, 128), (3, 2, 4, 128, 128), (1, 2, 4, 64, 128), (2, 1, 2, 256, 256), (1, 1, 1, 128, 512)],
)
def test_fused_delta_kernel_matches_the_compiled_core(state_dtype, bias_dtype, b, hk, hv, dk, dv):
    from engine.kernels.gated_delta_decode import _core
    from engine.kernels.gated_delta_step import delta_step

    args = _delta_core_inputs(b, hk, hv, dk, dv, 4, bias_dtype)
    args["state"] = args["state"].astype(state_dtype)  # read and written in its dtype, the math in float32
    want = _core(hk, hv, dk, dv, 1e-6)(
        *(
            args[n]
            for n in ("qkv", "z", "a", "beta_logits", "conv_state", "state", "conv_w", "A_log", "dt_bias", "norm_w")
        )
    )
    got = delta_step(**args, norm_eps=1e-6, heads_k=hk, dk=dk)
    assert got[2].dtype == want[2].dtype == state_dtype
    assert mx.array_equal(got[1], want[1]).item()  # the conv tail is a copy
    # The kernel sums the conv in float32; MLX's bf16 multiply-sum rounds each product, so 1 in 6 conv
    # channels differ by one bf16 ulp (a NumPy emulation of the kernel on the CPU, qwen27b's head counts:
    # output 0.7% and state 0.44% of their largest magnitude). The delta rule carries that into the state.
    for g, w in ((got[0], want[0]), (got[2], want[2])):
        g, w = g.astype(mx.float32), w.astype(mx.float32)
        assert mx.abs(g - w).max().item() <= 0.02 * mx.abs(w).max().item()


@pytest.mark.parametrize("dk, dv", [(32, 32), (64, 128), (128, 128), (256, 256), (96, 384), (128, 512), (1024, 1024)])
def test_the_staged_delta_kernel_deals_every_state_row_once(dk, dv):
    from engine.kernels.gated_delta_step import launch_shape, staged_rows

    warps, rows = launch_shape(dk, dv)[0] // 32, staged_rows(dk, dv)
    assert rows in (1, 2) and dv % (rows * warps) == 0  # rounds of `rows` a warp, as the unstaged kernel's
    dealt = sorted(
        w + warps * (r + rows * i) for i in range(dv // (rows * warps)) for w in range(warps) for r in range(rows)
    )
    assert dealt == list(range(dv))


def test_a_16_bit_state_is_staged_unless_told():
    from engine.kernels.gated_delta_step import staged_by_default

    assert [staged_by_default(d) for d in (mx.float32, mx.bfloat16, mx.float16)] == [False, True, True]


@cuda_only
@pytest.mark.parametrize("state_dtype", [mx.float32, mx.bfloat16, mx.float16])
# qwen27b's heads; batch rows; key dim below value dim; value dims with more than one round of rows a warp
@pytest.mark.parametrize(
    "b, hk, hv, dk, dv",
    [(1, 16, 48, 128, 128), (3, 2, 4, 128, 128), (1, 2, 4, 64, 128), (2, 1, 2, 256, 256), (1, 1, 1, 128, 512)],
)
def test_the_staged_delta_kernel_is_the_kernel_bit_for_bit(state_dtype, b, hk, hv, dk, dv):
    # The state staged in shared memory and read in rounds of 2 rows a warp: each row's sums in the same order
    from engine.kernels.gated_delta_step import delta_step

    args = _delta_core_inputs(b, hk, hv, dk, dv, 4, mx.bfloat16)
    args["state"] = args["state"].astype(state_dtype)
    plain = delta_step(**args, norm_eps=1e-6, heads_k=hk, dk=dk, staged=False)
    staged = delta_step(**args, norm_eps=1e-6, heads_k=hk, dk=dk, staged=True)
    for p, q in zip(plain, staged):
        assert p.dtype == q.dtype and mx.array_equal(p, q).item()


def _scan_inputs(b, t, hk, hv, dk, dv, state_dtype):
    args = _delta_core_inputs(b, hk, hv, dk, dv, 4, mx.bfloat16)
    mx.random.seed(1)
    c, bf = 2 * hk * dk + hv * dv, mx.bfloat16
    return args | dict(
        qkv=mx.random.normal((b, t, c)).astype(bf),
        z=mx.random.normal((b, t, hv * dv)).astype(bf),
        a=mx.random.normal((b, t, hv)).astype(bf),
        beta_logits=mx.random.normal((b, t, hv)).astype(bf),
        state=args["state"].astype(state_dtype),
    )


def test_the_scan_kernel_refuses_heads_whose_state_needs_two_rounds():
    from engine.kernels.gated_delta_scan import delta_scan, refusal

    assert refusal(128, 128) is None and refusal(64, 128) is None and refusal(32, 32) is None
    assert "more than one round" in refusal(256, 256) and "key dim 64" in refusal(64, 32)
    with pytest.raises(ValueError, match="more than one round"):
        delta_scan(**_scan_inputs(1, 3, 1, 1, 256, 256, mx.float32), norm_eps=1e-6, heads_k=1, dk=256)


@cuda_only
@pytest.mark.parametrize("state_dtype", [mx.float32, mx.bfloat16])
# qwen27b's heads; batch rows that stop early (one with no token at all); key dim below value dim; small heads
@pytest.mark.parametrize(
    "t, ends, hk, hv, dk, dv",
    [(7, [7], 16, 48, 128, 128), (5, [5, 3, 0], 2, 4, 128, 128), (3, [3, 2], 2, 4, 64, 128), (2, [2], 1, 2, 32, 32)],
)
def test_the_scan_kernel_is_the_step_kernel_token_after_token(state_dtype, t, ends, hk, hv, dk, dv):
    from engine.kernels.gated_delta_scan import delta_scan
    from engine.kernels.gated_delta_step import delta_step

    b = len(ends)
    args = _scan_inputs(b, t, hk, hv, dk, dv, state_dtype)
    kw = dict(norm_eps=1e-6, heads_k=hk, dk=dk)
    out, conv, state, states = delta_scan(**args, **kw, ends=mx.array(ends), trace=True)
    assert out.shape == (b, t, hv * dv) and states.shape == (t, b, hv, dv, dk) and state.dtype == state_dtype
    for r, n in enumerate(ends):
        row = {
            k: v[r : r + 1] if k in ("qkv", "z", "a", "beta_logits", "conv_state", "state") else v
            for k, v in args.items()
        }
        step_conv, step_state = row["conv_state"], row["state"]
        for p in range(n):
            one = row | dict(
                qkv=row["qkv"][:, p : p + 1],
                z=row["z"][:, p : p + 1],
                a=row["a"][:, p : p + 1],
                beta_logits=row["beta_logits"][:, p : p + 1],
                conv_state=step_conv,
                state=step_state,
            )
            step_out, step_conv, step_state = delta_step(**one, **kw)
            assert mx.array_equal(out[r : r + 1, p : p + 1], step_out).item(), (r, p)
            assert mx.array_equal(states[p, r : r + 1], step_state).item(), (r, p)
        assert mx.array_equal(state[r : r + 1], step_state).item() and mx.array_equal(conv[r : r + 1], step_conv).item()
        assert not mx.any(out[r, n:]).item()  # a row's padded positions: zeros


@cuda_only
def test_a_prompt_chunk_and_a_window_through_the_scan_kernel():
    # A prompt chunk through the scan (the layer's parts around one core launch) is as close to a float32
    # reference as the chunked rule's path; a verify window through it is the token-after-token window, bit
    # for bit.
    from engine.engine import Engine

    def run(scan_tokens: int, reference: bool = False):
        model = Engine.load("tiny-qwen35", with_tokenizer=False).model
        if reference:
            model.set_dtype(mx.float32)
        install(model, KernelConfig(EXACT) if reference else replace(FAST_ANYWHERE, scan_tokens=scan_tokens))
        cache = model.make_cache()
        prompt = model(mx.array([list(range(3, 40))]), cache)
        recurrent = [c for c in cache if hasattr(c, "start_trace")]
        for c in recurrent:
            c.start_trace()
        window = model(mx.array([[5, 9, 11, 2]]), cache)
        states = [s for c in recurrent for s in c.trace.states]
        mx.eval(prompt, window, states)
        return prompt.astype(mx.float32), window, states

    # 64: the 37-token prompt through the scan; 8: the prompt through the chunked rule, the window through the scan
    (scanned, _, _), (_, window, states), (chunked, want_window, want_states) = run(64), run(8), run(0)
    ref = run(0, reference=True)[0]
    assert mx.abs(scanned - ref).max().item() <= max(
        0.02 * mx.abs(ref).max().item(), mx.abs(chunked - ref).max().item()
    )
    assert mx.array_equal(window, want_window).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(states, want_states))


def test_the_scan_takes_prompt_chunks_without_a_record_or_left_padding():
    from engine.cache import RecurrentCache
    from engine.kernels.gated_delta_decode import scan_applies

    cache = RecurrentCache()  # no states yet: the scan starts from zeros
    chunk = mx.zeros((1, 24, 8))
    assert scan_applies(chunk, cache, 64) and not scan_applies(chunk, cache, 16) and not scan_applies(chunk, None, 64)
    assert not scan_applies(mx.zeros((1, 1, 8)), cache, 64)  # one token: the decode step's
    cache.lengths = [20]  # right padding: the row stops at its length
    assert scan_applies(chunk, cache, 64)
    cache.left_padding = [3]
    assert not scan_applies(chunk, cache, 64)
    cache.left_padding = [0]
    cache.start_trace()
    assert not scan_applies(chunk, cache, 64)  # a verify window: window_applies' path


def test_fused_decode_leaves_batched_and_traced_steps_to_the_layer():
    from engine.cache import RecurrentCache
    from engine.kernels.gated_delta_decode import applies

    x = mx.zeros((1, 1, 8))
    cache = RecurrentCache()
    assert not applies(x, None, cache)  # no states yet: the layer builds them
    cache[0], cache[1] = mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    assert applies(x, None, cache)
    assert not applies(mx.zeros((1, 2, 8)), None, cache)
    assert not applies(x, mx.ones((1, 1), dtype=mx.bool_), cache)
    cache.lengths = [1]
    assert not applies(x, None, cache)


def test_a_traced_window_of_a_few_tokens_takes_the_window_step():
    from engine.cache import RecurrentCache
    from engine.kernels.gated_delta_decode import window_applies

    cache = RecurrentCache()
    cache[0], cache[1] = mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    window = mx.zeros((1, 4, 8))
    assert not window_applies(window, None, cache)  # nothing recorded: not a verify window
    cache.start_trace()
    assert window_applies(window, None, cache)
    assert not window_applies(mx.zeros((1, 1, 8)), None, cache)  # one token: the decode step's
    assert not window_applies(mx.zeros((1, 16, 8)), None, cache)  # the chunked rule's length
    cache.lengths = [4]
    assert not window_applies(window, None, cache)


@pytest.mark.parametrize("name", ["tiny-qwen35", "tiny-qwen35-f32", "tiny-qwen35-4bit"])
def test_the_window_step_matches_the_layer_path(name, monkeypatch):
    # A speculative verify window on the fast tier: the DeltaNet layers' compiled window step (projections
    # over all its tokens, the core token after token) and the attention layers' compiled parts around their
    # own attention, against the layers' own paths (the per-token recurrence): the same output, the same state
    # after each token and the same conv inputs for the trace. Bits off CUDA (the compiled core). On CUDA the
    # two paths round differently (an H100 measured up to 0.029 of the largest value between them in bfloat16,
    # each 0.011 and 0.023 from float32), so there each of the window's values is held against a float32
    # reference of the same weights: within 0.02 of it, or no further than the layer path's.
    import engine.kernels.gated_delta_decode as decode
    from engine.engine import Engine

    window_applies = decode.window_applies

    def run(windowed: bool, reference: bool = False):
        model = Engine.load(name, with_tokenizer=False).model
        monkeypatch.setattr(decode, "window_applies", window_applies if windowed else lambda *a: False)
        if reference:
            model.set_dtype(mx.float32)
        install(model, KernelConfig(EXACT) if reference else replace(FAST_ANYWHERE, attention_step=windowed))
        cache = model.make_cache()
        model(mx.array([list(range(3, 40))]), cache)
        recurrent = [c for c in cache if hasattr(c, "start_trace")]
        for c in recurrent:
            c.start_trace()
        out = model(mx.array([[5, 9, 11, 2]]), cache)
        states = [s for c in recurrent for s in c.trace.states]
        convs = [c.trace.conv_input for c in recurrent]
        mx.eval(out, states, convs)
        assert len(states) == 4 * len(recurrent)
        return [out, *states, *convs]

    window, layer = run(True), run(False)
    if not on_cuda():
        assert all(mx.array_equal(got, want).item() for got, want in zip(window, layer))
        return
    for got, want, ref in zip(window, layer, run(False, reference=True)):
        got, want, ref = (x.astype(mx.float32) for x in (got, want, ref))
        off, layer_off = mx.abs(got - ref).max().item(), mx.abs(want - ref).max().item()
        assert off <= max(0.02 * mx.abs(ref).max().item(), layer_off)


def test_the_step_kernel_is_chosen_for_bf16_layers_only():
    from engine.engine import Engine
    from engine.kernels.gated_delta_decode import step_kernel_applies

    def delta_layer(name):
        return next(layer for layer in Engine.load(name, with_tokenizer=False).model.layers if layer.is_linear)

    assert step_kernel_applies(delta_layer("tiny-qwen35"))  # bf16, key and value heads of 32
    assert not step_kernel_applies(delta_layer("tiny-qwen35-f32"))


def test_compiled_attention_step_in_a_batch_matches_the_layer_path():
    # Batched decode (a mask, per-row offsets, rows of different lengths): the attention step compiles only
    # the per-token parts around the layer's own attention, so it takes the batch's caches as they are.
    from engine.batch.batcher import ContinuousBatcher
    from engine.batch.scheduler import SchedulerConfig
    from engine.engine import Engine
    from engine.request import GenerationRequest, StopCriteria
    from engine.sinks import CollectingSink

    if rerun_without_tf32(__file__, "test_compiled_attention_step_in_a_batch_matches_the_layer_path"):
        return  # under TF32 the float32 comparison below measured 2.2e-3 on an H200
    model = Engine.load("tiny-qwen35-f32", with_tokenizer=False).model

    def run():
        logits = {}
        batcher = ContinuousBatcher(
            model, SchedulerConfig(max_rows=4), tap=lambda rid, x: logits.setdefault(rid, []).append(x)
        )
        sinks = {}
        for rid, n in (("a", 9), ("b", 3), ("c", 6)):
            sinks[rid] = CollectingSink()
            request = GenerationRequest(rid, tuple(range(3, 3 + n)), stop=StopCriteria(max_tokens=6, ignore_eos=True))
            batcher.submit(request, sinks[rid])
        batcher.run_until_idle()
        return {rid: s.token_ids for rid, s in sinks.items()}, logits

    exact_tokens, exact = run()
    install(model, FAST_ANYWHERE)
    fast_tokens, fast = run()
    install(model, KernelConfig(EXACT))
    assert fast_tokens == exact_tokens
    # float32 model: fused elementwise chains round differently, so logits agree to float32 rounding
    diffs = [mx.abs(a - b).max().item() for rid in exact for a, b in zip(exact[rid], fast[rid])]
    assert diffs and max(diffs) < 1e-3


def test_chunked_delta_rule_gradients_match_the_recurrence_and_stay_finite():
    # Training runs through the chunked form: its gradients must be the recurrence's (to rounding), and stay
    # finite for heads whose decay is far below float32's range (no 1/g factor from a log of g).
    q, k, v, _, beta, state = delta_inputs(80, 2, 2, 16, 16, dtype=mx.float32, seed=3)
    b = mx.random.normal(beta.shape, key=mx.random.key(1))
    A_log, dt_bias = mx.log(mx.array([2.0, 16.0])), mx.ones(2)

    def loss(a, A_log, chunked):
        y, _ = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, chunked=chunked)
        return (y * y).sum()

    grad = mx.grad(loss, argnums=(0, 1))
    a = mx.random.normal(beta.shape, key=mx.random.key(2))
    ga, gA = grad(a, A_log, chunked_gated_delta)
    ra, rA = grad(a, A_log, None)
    tol = 2e-3 if on_cuda() else 1e-4
    assert mx.abs(ga - ra).max().item() < tol * (1 + mx.abs(ra).max().item())
    assert mx.abs(gA - rA).max().item() < tol * (1 + mx.abs(rA).max().item())
    for shift in (3.0, 6.0, 12.0):  # g from ~1e-25 down to exact zeros
        ga, gA = grad(a + shift, A_log, chunked_gated_delta)
        assert mx.isfinite(ga).all().item() and mx.isfinite(gA).all().item()
