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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--all-operations", action="store_true", help="list every operation's count, not the six commonest")
    args = p.parse_args()
    model = lazy_model(get_spec(args.model), quantized=True)
    # Evaluated stand-ins for the weights, each a zero broadcast to its shape (no memory): compiled steps
    # hold evaluated weights as constants, while an unevaluated one would pull the ops that make it into
    # every call of the step.
    model.update(tree_map(lambda a: mx.broadcast_to(mx.zeros((), dtype=a.dtype), a.shape), model.parameters()))
    mx.eval(model.parameters())
    for tier, attention_decode.ENABLED in ((EXACT, False), (FAST, False), (FAST, True)):
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


if __name__ == "__main__":
    main()
