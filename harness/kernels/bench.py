"""Microbenchmarks of the fast tier's kernels against MLX's operations, on a
registry model's exact shapes.

- Quantized GEMV / small-M GEMM: every distinct [N, K] of the model's linear
  layers (random weights quantized with the model's bits and group size),
  M = 1..16 rows: built-in `mx.quantized_matmul` vs ours; median time,
  effective GB/s (weights, scales, biases, activations and output bytes once
  each), the fraction of the machine's bandwidth, max |difference| against
  the built-in result.
- Projections that share an input (gate and up, q/k/v, a DeltaNet layer's
  four inputs): MLX's operation once per matrix vs ours once for the group,
  as the fast tier runs them (`engine.models.base.project`).
- Prompt chunks (`tokens - 1` rows) through each matrix the fast tier runs as
  dequantize + one GEMM (`dense_matmul`): MLX's quantized matmul vs that;
  median time, TFLOP/s, max |difference|.
- Gated DeltaNet prefill: the per-token recurrence (the exact tier, as mlx-lm
  runs it off Apple GPUs) vs the chunked form, T tokens with the model's head
  geometry; median time, speedup, max |difference| of outputs and state.

Timing: `calls` independent calls per `mx.eval`, after `warmup` evaluations
(the first call compiles kernels), median over `repeats`; the clock covers
the evaluation of calls built beforehand (`time_us`). Independent calls can
run side by side on the device (MLX's CUDA graphs order only what depends),
which hides a launch that leaves SMs idle; in a decode step each matrix
waits for the one before. So at M = 1 the GEMV is also timed serially
(`serial_us`): each call adds its product to the previous call's output, as
a residual layer does (MLX: the matmul and an add; ours: the residual in the
launch, as the fast tier runs o_proj and down). The GEMV calls
rotate over copies of the weights, at least `cold_bytes` of them, so no
matrix is timed from the L2 (50 MB on the H200): a decode step streams the
whole model from HBM. (On qwen27b's 47 MB matrices it changed little: MLX
59.1 us warm, 60.3 cold.)
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import on_cuda
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.kernels.quantized_gemv import (
    DENSE_MIN_ROWS,
    LAYER_MAX_ROWS,
    dense_matmul,
    quantized_matmul,
    quantized_matmuls,
    refusal,
)
from engine.models import model_module
from engine.models.gated_delta import normalize_qk, recurrence
from engine.registry import ModelSpec
from harness.kernels.bench_config import BenchConfig

BUILTIN, KERNEL = "mlx", "kernel"


class _Speedup:
    """The speedup of a result with builtin_us and kernel_us (None where the kernel did not run)."""

    @property
    def speedup(self) -> float | None:
        return None if self.kernel_us is None else self.builtin_us / self.kernel_us


class _Rates(_Speedup):
    """And the effective GB/s of a result with bytes_moved."""

    def gbs(self, us: float | None) -> float | None:
        return None if us is None else self.bytes_moved / us / 1e3


@dataclass(frozen=True)
class GemvResult(_Rates):
    n: int
    k: int
    m: int
    bits: int
    group_size: int
    layers: int  # how many of the model's layers have this shape
    builtin_us: float
    kernel_us: float | None
    bytes_moved: int
    max_abs_diff: float | None
    max_abs_ref: float
    note: str = ""
    serial_builtin_us: float | None = None  # each call waiting for the one before (M = 1 only)
    serial_kernel_us: float | None = None


@dataclass(frozen=True)
class GroupResult(_Rates):
    """Matrices that share an input: MLX's operation once per matrix vs one launch of ours for all."""

    label: str
    rows: tuple[int, ...]  # N of each matrix
    k: int
    m: int
    layers: int  # how many of the model's modules have this group
    builtin_us: float
    kernel_us: float | None
    bytes_moved: int
    note: str = ""


@dataclass(frozen=True)
class PrefillResult(_Speedup):
    """A prompt chunk through one matrix: MLX's quantized matmul vs dequantize + one GEMM (`dense_matmul`)."""

    n: int
    k: int
    m: int
    layers: int
    builtin_us: float
    kernel_us: float | None
    max_abs_diff: float | None
    note: str = ""

    def tflops(self, us: float | None) -> float | None:
        return None if us is None else 2 * self.n * self.k * self.m / us / 1e6


@dataclass(frozen=True)
class DeltaResult:
    tokens: int
    heads_k: int
    heads_v: int
    dk: int
    dv: int
    builtin_ms: float
    kernel_ms: float
    max_abs_diff_y: float
    max_abs_diff_state: float

    @property
    def speedup(self) -> float:
        return self.builtin_ms / self.kernel_ms


@dataclass(frozen=True)
class Verdict:
    """One of the issue's done-criteria, checked on a run's results."""

    criterion: str
    measured: float | None
    target: float
    ok: bool | None  # None: not measured here (e.g. no CUDA)
    note: str = ""


def _check(criterion: str, measured: float | None, target: float, at_least: bool = True) -> Verdict:
    ok = None if measured is None else (measured >= target if at_least else measured <= target)
    return Verdict(criterion, measured, target, ok)


# A batched decode's matrix products at these row counts read their weights at BATCHED_FRACTION of the memory's
# peak or more on every shape (a decode step of 16-64 rows at its bandwidth floor)
BATCHED_ROWS = (16, 32, 64)
BATCHED_FRACTION = 0.70


def verdicts(gemv: Sequence[GemvResult], delta: Sequence[DeltaResult], peak_gbs: float | None = None) -> list[Verdict]:
    """GEMV at M = 1 on the model's main matrix (the largest shape used by more than one layer):
    >= 2500 GB/s and >= 7x MLX; M = 8 at most 1.5x the M = 1 time; at each of BATCHED_ROWS timed, every
    shape's bytes at BATCHED_FRACTION of `peak_gbs` or more (the slowest shape's fraction); 1024-token chunked
    DeltaNet prefill >= 20x the recurrence. With `peak_gbs`, a speedup target that would need more
    than the machine's bandwidth says so."""
    out = []
    shared = [r for r in gemv if r.layers > 1]
    if shared:
        n, k = max(((r.n, r.k, r.layers) for r in shared), key=lambda t: (t[0] * t[1], t[2]))[:2]
        by_m = {r.m: r for r in shared if (r.n, r.k) == (n, k)}
        one, eight = by_m.get(1), by_m.get(8)
        if one:
            out.append(_check(f"GEMV {n}x{k} M=1 GB/s", one.gbs(one.kernel_us), 2500))
            speedup = _check(f"GEMV {n}x{k} M=1 speedup vs MLX", one.speedup, 7)
            needed = 7 * one.gbs(one.builtin_us)
            if peak_gbs and needed > peak_gbs:
                speedup = dataclasses.replace(
                    speedup,
                    note=f"unreachable here: 7x MLX's {needed / 7:.0f} GB/s is "
                    f"{needed:.0f} GB/s, above the {peak_gbs:.0f} GB/s peak",
                )
            out.append(speedup)
        if one and eight:
            ratio = eight.kernel_us / one.kernel_us if one.kernel_us and eight.kernel_us else None
            out.append(_check(f"GEMV {n}x{k} M=8 time / M=1 time", ratio, 1.5, at_least=False))
    if peak_gbs:
        for m in BATCHED_ROWS:
            rows = [r for r in gemv if r.m == m]
            if rows:
                fractions = [None if r.kernel_us is None else r.gbs(r.kernel_us) / peak_gbs for r in rows]
                worst = None if None in fractions else min(fractions)
                out.append(_check(f"GEMV every shape M={m} fraction of {peak_gbs:.0f} GB/s", worst, BATCHED_FRACTION))
    for r in delta:
        if r.tokens == 1024:
            out.append(_check("chunked DeltaNet 1024-token prefill speedup", r.speedup, 20))
    return out


def time_us(fn: Callable[[], mx.array], cfg: BenchConfig, include_build: bool = False) -> float:
    """Median microseconds per call to evaluate `cfg.calls` calls. By default their graph is built before
    the clock starts: the device's time and MLX's launch of each kernel, not Python building the call (a
    decode step builds its next graph while the device runs this one). `include_build` times both, for
    work whose graph building is part of its cost (the per-token DeltaNet loop of a prefill)."""
    for _ in range(cfg.warmup):
        mx.eval([fn() for _ in range(cfg.calls)])
    samples = []
    for _ in range(cfg.repeats):
        mx.synchronize()
        start = time.perf_counter()
        outs = [fn() for _ in range(cfg.calls)]
        if not include_build:
            mx.synchronize()
            start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        samples.append((time.perf_counter() - start) / cfg.calls * 1e6)
    return statistics.median(samples)


def serial_us(step: Callable[[mx.array], mx.array], start: mx.array, cfg: BenchConfig) -> float:
    """Median microseconds per call of `cfg.calls` calls, each `step` taking the previous call's output
    (the first `start`): none can start before the one before it ends, as in a decode step."""

    def chain() -> mx.array:
        out = start
        for _ in range(cfg.calls):
            out = step(out)
        return out

    return time_us(chain, dataclasses.replace(cfg, calls=1)) / cfg.calls


def model_args(spec: ModelSpec):
    config = dataclasses.asdict(spec.geometry)
    return model_module(spec.model_type).ModelArgs.from_dict(config)


def lazy_model(spec: ModelSpec, quantized: bool = False) -> nn.Module:
    """The registry model built from its geometry, never evaluated: no weights are made, so
    shapes and graph building can be looked at for qwen27b on any machine."""
    model = model_module(spec.model_type).Model(model_args(spec))
    if quantized and spec.quantization:
        nn.quantize(model, group_size=spec.quantization.group_size, bits=spec.quantization.bits)
    return model


def linear_shapes(spec: ModelSpec) -> Counter:
    """[N, K] of every linear layer -> how many layers have it."""
    model = lazy_model(spec)
    shapes: Counter = Counter()
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear):
            shapes[tuple(module.weight.shape)] += 1
    return shapes


# The layers the models pass together to engine.models.base.project (one launch in the fast tier).
PROJECTION_GROUPS = {
    "gate+up": ("gate_proj", "up_proj"),
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "DeltaNet inputs": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}


def projection_groups(spec: ModelSpec) -> Counter:
    """(label, (N of each matrix), K) of every group of linear layers that share an input -> how many
    modules have it."""
    model = lazy_model(spec)
    groups: Counter = Counter()
    for _, module in model.named_modules():
        for label, names in PROJECTION_GROUPS.items():
            layers = [getattr(module, name, None) for name in names]
            if all(isinstance(layer, nn.Linear) for layer in layers):
                groups[(label, tuple(layer.weight.shape[0] for layer in layers), layers[0].weight.shape[1])] += 1
    return groups


def weight_copies(w: mx.array, scales: mx.array, biases: mx.array, cfg: BenchConfig) -> Callable[[], tuple]:
    """A function returning the next of enough separate copies of (w, scales, biases) to cover
    `cfg.cold_bytes`, round robin: each call then reads its weights from memory, not from cache."""
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    count = min(cfg.max_copies, max(1, -(-cfg.cold_bytes // nbytes)))
    copies = [(w, scales, biases)] + [(w + 0, scales + 0, biases + 0) for _ in range(count - 1)]
    mx.eval(copies)
    turn = itertools.cycle(copies)
    return lambda: next(turn)


def rounded_reference(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """x times the quantized matrix transposed with each weight rounded once to bf16, round(q * scale + bias) (the
    staged kernel's rounded arithmetic), summed in float32 on the CPU."""
    with mx.stream(mx.cpu):
        f32 = mx.float32
        dense = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size, bits)
        return x.astype(f32) @ dense.astype(mx.bfloat16).astype(f32).T


def rounding_bound(want: mx.array) -> mx.array:
    """How far the quantized matmul's sums may lie from a float32 reference `want`: the bf16 output's rounding
    (2^-8 relative) and 1e-4 of the largest value, far more than float32 sums in another order add."""
    return 2.0**-8 * mx.abs(want) + 1e-4 * mx.abs(want).max()


def random_quantized(n: int, k: int, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """(w, scales, biases) of a random [N, K] bf16 matrix with a linear layer's scale, evaluated."""
    quantized = mx.quantize((mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16), group_size=group_size, bits=bits)
    mx.eval(quantized)
    return tuple(quantized)


def _kernel_refusal(x: mx.array, matrices: Sequence[tuple], group_size: int, bits: int) -> str | None:
    """Why our kernel's side of a comparison is not timed here (None when it is)."""
    why = next(filter(None, (refusal(x, w, s, group_size, bits) for w, s, _ in matrices)), None)
    return why or (None if on_cuda() else "needs MLX's CUDA backend")


def bench_gemv(n: int, k: int, m: int, bits: int, group_size: int, layers: int, cfg: BenchConfig) -> GemvResult:
    w, scales, biases = random_quantized(n, k, bits, group_size)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    mx.eval(x)
    weights = weight_copies(w, scales, biases, cfg)

    def builtin():
        return mx.quantized_matmul(x, *weights(), transpose=True, group_size=group_size, bits=bits)

    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    moved = w.nbytes + scales.nbytes + biases.nbytes + x.nbytes + ref.nbytes
    builtin_us = time_us(builtin, cfg)
    serial = m == 1
    serial_builtin = serial_us(lambda r: r + builtin(), ref, cfg) if serial else None
    why = _kernel_refusal(x, [(w, scales, biases)], group_size, bits)
    kernel_us = diff = serial_kernel = None
    if why is None:

        def kernel():
            return quantized_matmul(x, *weights(), group_size, bits)

        ours = quantized_matmul(x, w, scales, biases, group_size, bits)
        diff = mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        kernel_us = time_us(kernel, cfg)
        if serial:
            serial_kernel = serial_us(
                lambda r: quantized_matmuls(x, [weights()], group_size, bits, residual=r)[0], ref, cfg
            )
    return GemvResult(
        n=n,
        k=k,
        m=m,
        bits=bits,
        group_size=group_size,
        layers=layers,
        builtin_us=builtin_us,
        kernel_us=kernel_us,
        bytes_moved=moved,
        max_abs_diff=diff,
        max_abs_ref=mx.abs(ref).max().item(),
        note=why or "",
        serial_builtin_us=serial_builtin,
        serial_kernel_us=serial_kernel,
    )


def bench_group(
    label: str, rows: Sequence[int], k: int, m: int, bits: int, group_size: int, layers: int, cfg: BenchConfig
) -> GroupResult:
    matrices = [random_quantized(n, k, bits, group_size) for n in rows]
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    mx.eval(x)
    # Each matrix rotates over its own copies; the small ones stop at max_copies, so they may stay cached.
    copies = [weight_copies(*matrix, cfg) for matrix in matrices]

    def builtin():
        return [mx.quantized_matmul(x, *c(), transpose=True, group_size=group_size, bits=bits) for c in copies]

    moved = sum(a.nbytes for matrix in matrices for a in matrix) + x.nbytes + 2 * m * sum(rows)
    builtin_us = time_us(builtin, cfg)
    why = _kernel_refusal(x, matrices, group_size, bits)
    kernel_us = None if why else time_us(lambda: quantized_matmuls(x, [c() for c in copies], group_size, bits), cfg)
    return GroupResult(
        label=label,
        rows=tuple(rows),
        k=k,
        m=m,
        layers=layers,
        builtin_us=builtin_us,
        kernel_us=kernel_us,
        bytes_moved=moved,
        note=why or "",
    )


def bench_prefill(n: int, k: int, m: int, bits: int, group_size: int, layers: int, cfg: BenchConfig) -> PrefillResult:
    w, scales, biases = random_quantized(n, k, bits, group_size)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    mx.eval(x)
    once = dataclasses.replace(cfg, calls=1, warmup=1)  # compute-bound: one copy of the weights, one call a sample

    def builtin():
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    def dense():
        return dense_matmul(x, w, scales, biases, group_size, bits)

    builtin_us = time_us(builtin, once)
    if not on_cuda():
        return PrefillResult(
            n, k, m, layers, builtin_us, None, None, "the fast tier runs it only on MLX's CUDA backend"
        )
    diff = mx.abs(dense().astype(mx.float32) - builtin().astype(mx.float32)).max().item()
    return PrefillResult(n, k, m, layers, builtin_us, time_us(dense, once), diff)


def delta_inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, dtype=mx.bfloat16, seed: int = 0):
    """Random inputs with the model's ranges: normalized q, k; decays in (0, 1); beta in (0, 1)."""
    key = mx.random.key(seed)
    kq, kk, kv, kg, kb = mx.random.split(key, 5)
    q = mx.random.normal((1, tokens, hk, dk), key=kq).astype(dtype)
    k = mx.random.normal((1, tokens, hk, dk), key=kk).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, tokens, hv, dv), key=kv).astype(dtype)
    g = mx.exp(-0.3 * mx.exp(0.5 * mx.random.normal((1, tokens, hv), key=kg)))
    beta = mx.sigmoid(mx.random.normal((1, tokens, hv), key=kb)).astype(dtype)
    state = mx.zeros((1, hv, dv, dk), dtype=mx.float32)
    return q, k, v, g, beta, state


def bench_delta(tokens: int, hk: int, hv: int, dk: int, dv: int, cfg: BenchConfig) -> DeltaResult:
    args = delta_inputs(tokens, hk, hv, dk, dv)
    mx.eval(args)
    slow = dataclasses.replace(cfg, calls=1, repeats=max(3, cfg.repeats // 2), warmup=1)
    y_ref, s_ref = recurrence(*args)
    chunked_args = (*args[:3], mx.log(args[3]), *args[4:])
    y, s = chunked_gated_delta(*chunked_args)
    return DeltaResult(
        tokens=tokens,
        heads_k=hk,
        heads_v=hv,
        dk=dk,
        dv=dv,
        builtin_ms=time_us(lambda: recurrence(*args)[0], slow, include_build=True) / 1e3,
        kernel_ms=time_us(lambda: chunked_gated_delta(*chunked_args)[0], slow, include_build=True) / 1e3,
        max_abs_diff_y=mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item(),
        max_abs_diff_state=mx.abs(s - s_ref).max().item(),
    )


@dataclass(frozen=True)
class KernelBench:
    gemv: list[GemvResult]
    groups: list[GroupResult]
    prefill: list[PrefillResult]
    delta: list[DeltaResult]


def run_kernel_bench(
    spec: ModelSpec,
    cfg: BenchConfig,
    on_result: Callable[[object], None] | None = None,
) -> KernelBench:
    quant = spec.quantization
    bits, group = (quant.bits, quant.group_size) if quant else (4, 64)
    out = KernelBench([], [], [], [])

    def done(results: list, r) -> None:
        results.append(r)
        if on_result:
            on_result(r)

    shapes: Sequence = sorted(linear_shapes(spec).items(), key=lambda kv: -kv[0][0] * kv[0][1])
    if cfg.max_shapes:
        shapes = shapes[: cfg.max_shapes]
    for (n, k), layers in shapes:
        for m in cfg.rows:
            done(out.gemv, bench_gemv(n, k, m, bits, group, layers, cfg))
    for (label, rows, k), layers in projection_groups(spec).items():
        for m in (m for m in cfg.rows if m <= LAYER_MAX_ROWS):  # above it the layers run MLX's op one by one
            done(out.groups, bench_group(label, rows, k, m, bits, group, layers, cfg))
    g = spec.geometry
    # Prompt chunks of `tokens - 1` rows (the last prompt token runs as the first decode step) through the
    # matrices the fast tier runs as dequantize + GEMM; not the head, which a prefill runs on one position.
    chunk_rows = [t - 1 for t in cfg.tokens if DENSE_MIN_ROWS is not None and t - 1 >= DENSE_MIN_ROWS]
    for (n, k), layers in shapes:
        if n != g.vocab_size:
            for m in chunk_rows:
                done(out.prefill, bench_prefill(n, k, m, bits, group, layers, cfg))
    if g.linear_num_value_heads:
        for t in cfg.tokens:
            done(
                out.delta,
                bench_delta(
                    t,
                    g.linear_num_key_heads,
                    g.linear_num_value_heads,
                    g.linear_key_head_dim,
                    g.linear_value_head_dim,
                    cfg,
                ),
            )
    return out
