"""Where a B=1 decode step of a real model goes, per kernel configuration (`CONFIGS`): host graph build, a
synchronous step (build + device), the pipelined rate the engine's decode loop reaches, that loop's parts
(build, submit, wait: a wait near zero means the host is the bound) and the step's graph nodes by operation.

    python3 -m tools.gpu.decode_step [--model qwen27b] [--configs exact,fast] [--rounds 2]

The fast configurations take ENGINE_FUSE and ENGINE_GEMV_LAUNCH as `engine serve` does. MLX's CUDA backend
reads its graph settings (MLX_MAX_OPS_PER_BUFFER, MLX_CUDA_GRAPH_CACHE_SIZE) once a process, so compare
those one process each (`--label` names the run).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import time
from collections import Counter
from dataclasses import replace

import mlx.core as mx

from engine.engine import Engine
from engine.kernels import EXACT, FAST, KernelConfig, install
from engine.kernels.quantized_gemv import Fusion
from tools.gpu.results import save_json

VIEWS = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "Split", "Flatten", "Unflatten"}


def step_nodes(model) -> Counter:
    """Operations in one decode step's graph (after a short evaluated prefill), by primitive name."""
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4]]), cache)
    mx.eval([c.state for c in cache])
    logits = model(mx.array([[5]]), cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, logits, *[a for c in cache for a in c.state])
    return Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', dot.getvalue()))


EPILOGUES = Fusion(residual=True, gated=True)


def configs() -> dict[str, KernelConfig]:
    """The configurations by name: the exact tier; the fast tier without its decode kernels, with the DeltaNet
    step kernel, with the compiled attention step, with the GEMV launches' output stages, with the norms'
    scale on their outputs, and the default (the norms taken by the launches before them)."""
    fast = KernelConfig.from_env(FAST)
    plain = KernelConfig(FAST, fusion=Fusion(), launches=fast.launches, delta_step_kernel=False, attention_step=False)
    return {
        EXACT: KernelConfig(EXACT),
        "fast_plain": plain,
        "fast_step_kernel": replace(plain, delta_step_kernel=True),
        "fast_attention": replace(plain, delta_step_kernel=True, attention_step=True, attention_kernels=False),
        "fast_epilogues": replace(fast, fusion=EPILOGUES),
        "fast_norm_scale": replace(fast, fusion=replace(EPILOGUES, norm_scale=True)),
        FAST: fast,
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
    p.add_argument("--configs", default="exact,fast", help="comma-separated, of " + ", ".join(configs()))
    p.add_argument(
        "--rounds", type=int, default=2, help="times through the configurations, alternating (the machine drifts)"
    )
    p.add_argument("--label", default="", help="added to the JSON's name (e.g. the MLX_* settings of the run)")
    args = p.parse_args()
    table = configs()
    names = args.configs.split(",")
    unknown = set(names) - set(table)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)} (choose from {', '.join(table)})")
    eng = Engine.load(args.model, with_tokenizer=False)
    prompt = [(i * 7919) % 50000 + 10 for i in range(256)]
    results = {"env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}
    for name in names * args.rounds:
        ks = install(eng.model, table[name])  # traces the layer steps afresh
        r = measure(eng, prompt, args.tokens)
        r["gemv_layers"] = ks.quantized_linears
        nodes = step_nodes(eng.model)
        r["operations"], r["views"] = sum(nodes.values()), sum(n for op, n in nodes.items() if op in VIEWS)
        r["operation_counts"] = dict(nodes.most_common())
        results.setdefault(name, []).append(r)
        print(
            f"{args.model}{' ' + args.label if args.label else ''} {name}: {r['tok_s']:.1f} tok/s pipelined ({r['pipelined_ms']:.2f} ms/step), "
            f"sync step {r['sync_step_ms']:.2f} ms, host build {r['build_ms']:.2f} ms, "
            f"loop: build {r['loop_build_ms']:.2f} + submit {r['loop_submit_ms']:.2f} + wait {r['loop_wait_ms']:.2f} ms, "
            f"{ks.quantized_linears} kernel layers, {ks.attention_kernel_layers} attention kernel layers, "
            f"{r['operations']} operations ({r['views']} views)",
            flush=True,
        )
        save_json(f"decode-step-{args.model}{'-' + args.label if args.label else ''}.json", results)


if __name__ == "__main__":
    main()
