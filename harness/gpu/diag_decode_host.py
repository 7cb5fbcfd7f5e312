"""Host cost of one decode step: how long building the step's graph takes, per kernel tier.

    python harness/gpu/diag_decode_host.py [--model qwen27b] [--steps 16]

The model is built from the registry geometry (quantized as the registry
says) with zero stand-ins for its weights and never run, so this runs on the
CPU for qwen27b too:
what is timed is only the Python and graph construction of each decode step
(the part the pipelined decode loop must hide behind device work), and the
operations in the step's graph, each of which MLX handles on the host when it
evaluates the step. Off CUDA the fast tier's GEMV layers build MLX's op
instead of the kernel.

--stand-in-kernels: as on CUDA, every CUDA kernel call replaced by a stand-in
that makes its outputs (zeros), so the fast tier's kernel paths are built on
the CPU: their Python and graph building without MLX's CUDA backend (which
adds its own cost per kernel call: ~7 us against ~4 an MLX op on the H200,
reports/gpu/launch-overhead.txt). Also prints how much of a step the DeltaNet
and the attention layers' steps take.
"""

import argparse
import io
import re
import statistics
import time
from collections import Counter

import mlx.core as mx
from mlx.utils import tree_map

from engine.kernels import EXACT, FAST, attention_decode, install
from engine.registry import get_spec
from harness.kernel_bench import lazy_model


def step_build_ms(model, steps: int) -> list[float]:
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4]]), cache)  # a short prefill, never evaluated
    token = mx.array([[5]])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        times.append((time.perf_counter() - start) * 1e3)
    return times


# Operations that only make a view of their input: nodes the host handles, but no kernel runs.
VIEWS = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "Split", "Flatten", "Unflatten"}


def step_nodes(model) -> Counter:
    """Operations in one decode step's graph (after a short evaluated prefill), by primitive name.
    Compiled functions appear as their fused nodes; off the GPU, MLX's fast ops (RMS norm, RoPE,
    attention) appear as the operations of their fallbacks."""
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4]]), cache)
    mx.eval([c.state for c in cache])
    logits = model(mx.array([[5]]), cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, logits, *[a for c in cache for a in c.state])
    return Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', dot.getvalue()))


def stand_in_kernels() -> None:
    """Every `mx.fast.cuda_kernel` a stand-in making zeros of the output shapes, and the kernel paths chosen
    as on CUDA (`engine.kernels.on_cuda`)."""
    import engine.kernels

    def cuda_kernel(name, input_names, output_names, source, header="", **_):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **__):
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return call

    mx.fast.cuda_kernel = cuda_kernel
    engine.kernels.on_cuda = lambda: True


def layer_split_ms(model, steps: int) -> dict[str, float]:
    """Median ms a step spent in the DeltaNet and the attention layers' decode steps (`fused_step`)."""
    spent: dict[str, list[float]] = {"DeltaNet": [], "attention": []}
    for _, module in model.named_modules():
        step = getattr(module, "fused_step", None)
        if step is not None:
            kind = "DeltaNet" if getattr(module, "is_linear", False) else "attention"

            def timed(*args, _step=step, _kind=kind):
                start = time.perf_counter()
                out = _step(*args)
                spent[_kind].append(time.perf_counter() - start)
                return out

            module.fused_step = timed
    step_build_ms(model, steps)
    layers = {kind: len(v) // steps for kind, v in spent.items()}
    return {kind: statistics.median(v) * layers[kind] * 1e3 for kind, v in spent.items() if v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--all-operations", action="store_true", help="list every operation's count, not the six commonest")
    p.add_argument("--stand-in-kernels", action="store_true",
                   help="build the fast tier's CUDA kernel paths on the CPU, each kernel call a stand-in")
    args = p.parse_args()
    if args.stand_in_kernels:
        stand_in_kernels()
    model = lazy_model(get_spec(args.model), quantized=True)
    # Evaluated stand-ins for the weights, each a zero broadcast to its shape (no memory): compiled steps
    # hold evaluated weights as constants, while an unevaluated one would pull the ops that make it into
    # every call of the step.
    # With the stand-in kernels the weights are bf16, as a synthesized model's (the kernels refuse others),
    # and only the fast tier's kernel paths are built.
    def stand_in(a: mx.array) -> mx.array:
        dtype = mx.bfloat16 if args.stand_in_kernels and mx.issubdtype(a.dtype, mx.floating) else a.dtype
        return mx.broadcast_to(mx.zeros((), dtype=dtype), a.shape)

    model.update(tree_map(stand_in, model.parameters()))
    mx.eval(model.parameters())
    tiers = ((FAST, True),) if args.stand_in_kernels else ((EXACT, False), (FAST, False), (FAST, True))
    for tier, attention_decode.ENABLED in tiers:
        ks = install(model, tier, force=True)
        times = step_build_ms(model, args.steps)[2:]
        nodes = step_nodes(model)
        views = sum(n for name, n in nodes.items() if name in VIEWS)
        label = tier + (" with the compiled attention step" if attention_decode.ENABLED else "")
        shown = nodes.most_common(None if args.all_operations else 6)
        print(f"{args.model} {label}: {statistics.median(times):.2f} ms per decode step graph "
              f"(min {min(times):.2f}, {ks.quantized_linears} kernel GEMV layers, "
              f"{ks.chunked_delta_layers} delta layers); {sum(nodes.values())} operations, {views} of them views; "
              f"{'' if args.all_operations else 'most: '}{', '.join(f'{name} {n}' for name, n in shown)}", flush=True)
        if tier == FAST and attention_decode.ENABLED:
            split = layer_split_ms(model, args.steps)
            print("  of which the layers' steps: " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()), flush=True)


if __name__ == "__main__":
    main()
