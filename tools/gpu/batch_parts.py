"""Where a batched decode step of qwen27b goes, part by part: the device time of each part's kernel at M rows.

    python3 -m tools.gpu.batch_parts --rows 1,8,16,32,64 [--staged RW=1 --staged 64:RW=1,W=4,MG=2 ...]

Times (median us a call, many calls an evaluation, weights warm) the fast tier's launches of qwen27b's
layers at M activation rows ([M, 1, K], as a batched decode step gives them) beside MLX's quantized matmul
on the same rows as one [M, K] matrix and the launch on dense bf16 copies of the weights (` dense`,
`quantized_gemv.dense`): the MLP's gate and up (one gated launch; MLX: two products), the
down projection with its residual, a DeltaNet layer's output projection with its residual and its four
input projections in one launch (gate and up also as the model runs them, prenormed: x the norm's output and
the sums of squares' parts from the launch before); and the DeltaNet step kernel at M batch rows, its state
in float32 and in float16 (` f16`), each read into registers or staged in shared memory first (` staged`). Then
the sum a step makes of them (64 MLPs and output projections, 48 DeltaNet layers' inputs and cores): set
against the whole step (`tools.gpu.step_kernels --time`), the rest is what these parts leave out.
`--staged SPEC` (repeatable, as `tools.gpu.step_kernels --staged`) times the parts again with the staged
launches (2-64 rows) laid out by SPEC; `python3 -m tools.kernel_resources --parts ... --cache-dir DIR` compiles
their kernels ahead on a machine with nvcc, for MLX_PTX_CACHE_DIR=DIR here.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import gated_delta_step
from engine.kernels.quantized_gemv import quantized_matmuls
from engine.kernels.quantized_gemv.dense import dense_launch
from engine.kernels.quantized_gemv.layer import KernelQuantizedLinear
from engine.kernels.quantized_gemv.staged import MIN_ROWS
from harness.kernels.bench import BenchConfig, random_quantized, time_us
from tools.gpu.step_kernels import parse_staged, staged_layout

HIDDEN, INTERMEDIATE, VALUE_DIM = 5120, 17408, 6144
HK, HV, DK, DV = 16, 48, 128, 128  # qwen27b's DeltaNet heads


def dense_layer(w: mx.array, scales: mx.array, biases: mx.array) -> KernelQuantizedLinear:
    """A 4-bit (group 64) layer of these arrays in the fast tier's form, its dense copy kept and evaluated."""
    q = nn.QuantizedLinear(w.shape[1] * 8, w.shape[0], bias=False, group_size=64, bits=4)
    q.weight, q.scales, q.biases = w, scales, biases
    layer = KernelQuantizedLinear.from_module(q, True, keep_dense=True)
    mx.eval(layer.kept.weight)
    return layer


def parts(m: int, cfg: BenchConfig, only: frozenset = frozenset()) -> dict[str, float]:
    """Each part's median us a call at M rows (`only`: these parts, by name; empty: all)."""

    def timed(name, call):
        if not only or name in only:
            res[name] = time_us(call, cfg)

    def rows(k: int) -> mx.array:
        return mx.random.normal((m, 1, k)).astype(mx.bfloat16)

    x5, x17, x6 = rows(HIDDEN), rows(INTERMEDIATE), rows(VALUE_DIM)
    residual = mx.zeros((m, 1, HIDDEN), dtype=mx.bfloat16)
    gate_up = [random_quantized(INTERMEDIATE, HIDDEN, 4, 64) for _ in range(2)]
    down = random_quantized(HIDDEN, INTERMEDIATE, 4, 64)
    out = random_quantized(HIDDEN, VALUE_DIM, 4, 64)
    inputs = [random_quantized(n, HIDDEN, 4, 64) for n in (2 * HK * DK + HV * DV, HV * DV, HV, HV)]
    mx.eval(x5, x17, x6, residual)

    def mlx(x, matrices):  # every product (a list: all of them are evaluated and timed)
        flat = x.reshape(m, -1)
        return [mx.quantized_matmul(flat, *w, transpose=True, group_size=64, bits=4) for w in matrices]

    res: dict[str, float] = {}
    timed("gate+up", lambda: quantized_matmuls(x5, gate_up, 64, 4, gated=True)[0])
    # as in the model: x is the norm's output and the down projection's launch left the sums of squares' parts
    ssq_parts = mx.abs(mx.random.normal((m, 160)))
    timed(
        "gate+up prenormed", lambda: quantized_matmuls(x5, gate_up, 64, 4, gated=True, prenormed=(ssq_parts, 1e-6))[0]
    )
    timed("gate+up MLX", lambda: mlx(x5, gate_up))
    timed("down+residual", lambda: quantized_matmuls(x17, [down], 64, 4, residual=residual)[0])
    timed("down MLX", lambda: mlx(x17, [down]))
    timed("out+residual", lambda: quantized_matmuls(x6, [out], 64, 4, residual=residual)[0])
    timed("out MLX", lambda: mlx(x6, [out]))
    timed("inputs", lambda: quantized_matmuls(x5, inputs, 64, 4)[0])
    timed("inputs MLX", lambda: mlx(x5, inputs))
    # the same launches on dense bf16 copies of the weights as ENGINE_DENSE_DECODE_ROWS runs them
    # (quantized_gemv.dense: a cuBLAS GEMM a layer, the stages as MLX operations), reading 4x the weight bytes
    if not only or any(name.endswith(" dense") for name in only):
        kept = {
            name: [dense_layer(*w) for w in matrices]
            for name, matrices in (("gate+up", gate_up), ("down", [down]), ("out", [out]), ("inputs", inputs))
        }
        timed("gate+up dense", lambda: dense_launch(x5, kept["gate+up"], gated=True, prenormed=(ssq_parts, 1e-6)))
        timed("down dense", lambda: dense_launch(x17, kept["down"], residual=residual))
        timed("out dense", lambda: dense_launch(x6, kept["out"], residual=residual))
        timed("inputs dense", lambda: dense_launch(x5, kept["inputs"]))
    # the DeltaNet step's inputs (a 64-row float32 state alone is 200 MB): made only where a delta part is timed
    if not only or any(name.startswith("delta step") for name in only):
        channels = 2 * HK * DK + HV * DV
        qkv, z = rows(channels), rows(HV * DV)
        a, b = (mx.random.normal((m, 1, HV)).astype(mx.bfloat16) for _ in range(2))
        conv_state = mx.random.normal((m, 3, channels)).astype(mx.bfloat16)
        state = 0.1 * mx.random.normal((m, HV, DV, DK))
        conv_w = mx.random.normal((channels, 4, 1)).astype(mx.bfloat16)
        A_log, dt_bias, norm_w = mx.zeros(HV), mx.ones(HV).astype(mx.bfloat16), mx.ones(DV).astype(mx.bfloat16)
        mx.eval(qkv, z, a, b, conv_state, state, conv_w)
        # the state in float32 and float16, read into registers (the default) or staged in shared memory first
        for dtype, name in ((mx.float32, ""), (mx.float16, " f16")):
            s = state.astype(dtype)
            for staged in (False, True):
                timed(
                    "delta step" + name + " staged" * staged,
                    lambda s=s, staged=staged: gated_delta_step.delta_step(
                        qkv, z, a, b, conv_state, s, conv_w, A_log, dt_bias, norm_w, 1e-6, HK, DK, staged=staged
                    )[2],
                )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,64", help="comma-separated activation rows (default 1,8,16,32,64)")
    p.add_argument("--calls", type=int, default=50, help="calls an evaluation (default 50)")
    p.add_argument(
        "--parts",
        default="",
        help="comma-separated parts to time (default all; e.g. 'gate+up,delta step' under ncu), no step sum then",
    )
    p.add_argument(
        "--staged",
        action="append",
        default=[],
        metavar="SPEC",
        help="also time the parts with the staged launches laid out by SPEC (tools.gpu.step_kernels' form)",
    )
    p.add_argument(
        "--layouts-only",
        action="store_true",
        help="time the --staged layouts only, not the tree's launches first (under ncu: its first kernels are theirs)",
    )
    args = p.parse_args()
    if args.layouts_only and not args.staged:
        p.error("--layouts-only needs a --staged layout")
    only = frozenset(filter(None, (v.strip() for v in args.parts.split(","))))
    cfg = BenchConfig(repeats=5, calls=args.calls)
    layouts = [(None, {}, "")] * (not args.layouts_only) + [(*parse_staged(v), f" [{v}]") for v in args.staged]
    for m in (int(v) for v in args.rows.split(",")):
        for keep, fields, label in layouts:
            if fields and (m < MIN_ROWS or (keep is not None and m not in keep)):
                continue
            with staged_layout(fields):
                res = parts(m, cfg, only)
            line = f"M={m}{label}: " + " | ".join(f"{k} {v:.1f}" for k, v in res.items())
            if not only:
                step = 64 * (res["gate+up"] + res["down+residual"] + res["out+residual"]) + 48 * (
                    res["inputs"] + res["delta step"]
                )
                line += f" | these parts a step {step / 1e3:.1f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
