"""Whether a GEMV launch that asks the L2 for the start of the next launch's rows makes a chain of launches
faster: an MLP's gate+up launch then its down launch (with the residual), layer after layer, qwen27b's
shapes at M = 1, each launch waiting for the one before as in a decode step, the layers' weights distinct
and larger than the L2 together (so every launch reads from HBM unless prefetched).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gemv_prefetch.py

Each variant (`quantized_matmuls`' prefetch: the bytes of each next row, before the block's loads or after
its stores) is timed in ROUNDS rounds, the variants alternating within a round; the table gives each
variant's median microseconds per layer (two launches) and its ratio to no prefetch. The results are the
same bits with and without (checked once per variant). Rows also go to $OUT/gemv-prefetch.json.
"""

import os
import statistics

import mlx.core as mx

from engine.kernels.quantized_gemv import quantized_matmuls
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, random_quantized, serial_us

HIDDEN, INTERMEDIATE = 5120, 17408  # qwen27b
LAYERS = int(os.environ.get("LAYERS", "6"))  # 150 MB each at 4 bits
ROUNDS = int(os.environ.get("ROUNDS", "3"))
# (label, prefetch bytes a row (0: none), before the block's loads)
VARIANTS = [("none", 0, False), ("end 512", 512, False), ("end 1024", 1024, False), ("end 2048", 2048, False),
            ("start 512", 512, True), ("start 1024", 1024, True)]  # fmt: skip


def layers():
    out = []
    for _ in range(LAYERS):
        gate, up = random_quantized(INTERMEDIATE, HIDDEN, 4, 64), random_quantized(INTERMEDIATE, HIDDEN, 4, 64)
        out.append((gate, up, random_quantized(HIDDEN, INTERMEDIATE, 4, 64)))
    return out


def chain_step(weights, nbytes: int, at_start: bool):
    """One layer a call, round robin: h -> h + down(swiglu(gate(h), up(h))), each launch prefetching the next."""
    turn = [0]

    def step(h: mx.array) -> mx.array:
        i = turn[0]
        turn[0] = (i + 1) % len(weights)
        gate, up, down = weights[i]
        nxt = weights[(i + 1) % len(weights)]
        ask = dict(prefetch_bytes=nbytes, prefetch_at_start=at_start) if nbytes else {}
        act = quantized_matmuls(h, [gate, up], 64, 4, gated=True, prefetch=[down] if nbytes else (), **ask)[0]
        return quantized_matmuls(act, [down], 64, 4, residual=h, prefetch=list(nxt[:2]) if nbytes else (), **ask)[0]

    return step


def main():
    weights = layers()
    start = (mx.random.normal((1, HIDDEN)) * 0.1).astype(mx.bfloat16)
    cfg = BenchConfig(repeats=9, calls=200)
    reference = None
    for label, nbytes, at_start in VARIANTS:  # the same bits with and without: a hint only
        h = start
        step = chain_step(weights, nbytes, at_start)
        for _ in range(2 * LAYERS):
            h = step(h)
        mx.eval(h)
        reference = h if reference is None else reference
        same = mx.array_equal(h, reference).item()
        print(f"{label}: {'same bits' if same else 'DIFFERENT from no prefetch'}", flush=True)
    times = {label: [] for label, _, _ in VARIANTS}
    for r in range(ROUNDS):
        for label, nbytes, at_start in VARIANTS:
            times[label].append(serial_us(chain_step(weights, nbytes, at_start), start, cfg))
        print(f"round {r + 1}: " + " | ".join(f"{k} {v[-1]:.1f}" for k, v in times.items()), flush=True)
    base = statistics.median(times["none"])
    rows = []
    print(f"{'variant':<12} {'us a layer':>10} {'ratio':>6}   rounds")
    for label, nbytes, at_start in VARIANTS:
        med = statistics.median(times[label])
        rows.append({"variant": label, "bytes": nbytes, "at_start": at_start, "us": med, "rounds": times[label],
                     "ratio": med / base})  # fmt: skip
        print(f"{label:<12} {med:>10.1f} {med / base:>6.3f}   " + " ".join(f"{v:.1f}" for v in times[label]))
    save_json("gemv-prefetch.json", rows)


if __name__ == "__main__":
    main()
