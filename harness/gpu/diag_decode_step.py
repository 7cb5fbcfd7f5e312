"""Where a B=1 decode step of a real model goes, per kernel configuration (`CONFIGS`: the exact tier; the
fast tier without the DeltaNet step kernel, with it, with it and the compiled attention step, with the
norms and SwiGLU on the GEMV launches' inputs, with the residual adds and SwiGLU on their outputs, those
and the norms' scale on their outputs, or the norms taken by the launches before them):
host graph build, a synchronous step (build + device), the pipelined rate the engine's decode loop
reaches, that loop's parts (build, submit, wait: a wait near zero means the host is the bound) and the
step's graph nodes by operation.

    source .device-kit/b/env.sh && python3 harness/gpu/diag_decode_step.py [--model qwen27b]

MLX's CUDA backend records kernels into CUDA graphs of MLX_MAX_OPS_PER_BUFFER operations (default 20) and
keeps MLX_CUDA_GRAPH_CACHE_SIZE instantiated graphs (default 100, all dropped when it overflows); both are
read once per process, so `PART=graphs bash harness/gpu/kernels_qwen27b.sh` runs this once per setting.
"""

import argparse
import os
import statistics
import time

import mlx.core as mx

from engine.engine import Engine
from engine.kernels import EXACT, FAST, attention_decode, gated_delta_decode, install, quantized_gemv
from engine.kernels.quantized_gemv import Fusion
from harness.gpu.diag_decode_host import VIEWS, step_nodes
from harness.gpu.results import save_json


UNFUSED, EPILOGUES = Fusion(), Fusion(residual=True, gated=True)
NORM_SCALE = Fusion(residual=True, gated=True, norm_scale=True)
NORM_OUT = Fusion(residual=True, gated=True, norm_out=True)
# The attention layers' decode step: none, compiled around MLX's attention, or with the attention kernels
OFF, COMPILED, KERNELS = "off", "compiled", "kernels"
# tier, the DeltaNet step kernel, the attention step, the stages inside the GEMV launches
CONFIGS = {
    EXACT: (EXACT, False, OFF, UNFUSED),
    FAST: (FAST, False, OFF, UNFUSED),
    "fast_step_kernel": (FAST, True, OFF, UNFUSED),
    "fast_step_kernel_attention": (FAST, True, COMPILED, UNFUSED),
    "fast_step_kernel_fused": (FAST, True, OFF, Fusion(norm=True, swiglu=True, residual=True)),
    "fast_epilogues": (FAST, True, COMPILED, EPILOGUES),  # residual adds and the SwiGLU after the products
    "fast_norm_scale": (FAST, True, COMPILED, NORM_SCALE),  # and the norms
    "fast_attention_kernels": (FAST, True, KERNELS, NORM_SCALE),  # and the attention as two kernels
    "fast_residual_gated": (FAST, True, KERNELS, EPILOGUES),  # "fast_default" in the fourteenth session's files
    "fast_norm_out": (FAST, True, KERNELS, NORM_OUT),  # and the norms taken by the launches before (the default)
}


def measure(eng: Engine, prompt: list, tokens: int) -> dict:
    list(eng.generate(prompt, max_tokens=8, ignore_eos=True))  # warm: compiles this shape's kernels
    stamps = []
    for _ in eng.generate(prompt, max_tokens=tokens, ignore_eos=True):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    model = eng.model
    cache = eng.make_cache()
    logits = model(mx.array([prompt]), cache)
    mx.eval(logits)
    token = mx.argmax(logits[:, -1:], axis=-1)
    build, step = [], []
    for _ in range(24):
        t0 = time.perf_counter()
        logits = model(token, cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.eval(token)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        step.append((t2 - t0) * 1e3)
    return {
        "pipelined_ms": statistics.median(gaps) * 1e3,
        "tok_s": 1 / statistics.median(gaps),
        "build_ms": statistics.median(build[4:]),
        "sync_step_ms": statistics.median(step[4:]),
        **pipelined_parts(model, cache, token),
    }


def pipelined_parts(model, cache, token: mx.array, steps: int = 24) -> dict:
    """The engine's pipelined loop (build step n+1, submit it, then wait for step n's token) with each part
    timed. A wait near zero means the host is the bound: the device finishes a step before the host has
    built and submitted the next one. Submitting (`mx.async_eval`) is where MLX encodes and launches the
    step's kernels on the host."""
    def build(tok):
        return mx.argmax(model(tok, cache)[:, -1:], axis=-1)

    current = build(token)
    mx.async_eval(current)
    parts = {"build": [], "submit": [], "wait": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        following = build(current)
        t1 = time.perf_counter()
        mx.async_eval(following)
        t2 = time.perf_counter()
        current.item()
        t3 = time.perf_counter()
        for name, value in (("build", t1 - t0), ("submit", t2 - t1), ("wait", t3 - t2)):
            parts[name].append(value * 1e3)
        current = following
    mx.eval(current)
    return {f"loop_{name}_ms": statistics.median(values[4:]) for name, values in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--configs", default="exact,fast_step_kernel", help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=2, help="times through the configurations, alternating (the machine drifts)")
    p.add_argument("--label", default="", help="added to the JSON's name (e.g. the MLX_* settings of the run)")
    args = p.parse_args()
    configs = args.configs.split(",")
    eng = Engine.load(args.model, with_tokenizer=False)
    prompt = [(i * 7919) % 50000 + 10 for i in range(256)]
    results = {"env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}
    for name in configs * args.rounds:
        tier, gated_delta_decode.USE_STEP_KERNEL, attention, quantized_gemv.FUSE = CONFIGS[name]
        attention_decode.ENABLED, attention_decode.KERNELS = attention != OFF, attention == KERNELS
        install(eng.model, EXACT)  # the next install traces its layer steps afresh (FUSE is read then)
        ks = install(eng.model, tier)
        r = measure(eng, prompt, args.tokens)
        r["gemv_layers"] = ks.quantized_linears
        nodes = step_nodes(eng.model)
        r["operations"], r["views"] = sum(nodes.values()), sum(n for op, n in nodes.items() if op in VIEWS)
        r["operation_counts"] = dict(nodes.most_common())
        results.setdefault(name, []).append(r)
        print(f"{args.model}{' ' + args.label if args.label else ''} {name}: {r['tok_s']:.1f} tok/s pipelined ({r['pipelined_ms']:.2f} ms/step), "
              f"sync step {r['sync_step_ms']:.2f} ms, host build {r['build_ms']:.2f} ms, "
              f"loop: build {r['loop_build_ms']:.2f} + submit {r['loop_submit_ms']:.2f} + wait {r['loop_wait_ms']:.2f} ms, "
              f"{ks.quantized_linears} kernel layers, {ks.attention_kernel_layers} attention kernel layers, "
              f"{r['operations']} operations ({r['views']} views)", flush=True)
        save_json(f"decode-step-{args.model}{'-' + args.label if args.label else ''}.json", results)


if __name__ == "__main__":
    main()
