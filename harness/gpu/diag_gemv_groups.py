"""One launch for the projections that share an input, against one launch each, on qwen27b's groups
(weights cold): MLX's kernel per matrix; ours per matrix where the layer used it (>= 2048 outputs, MLX's
below); ours for the whole group (`quantized_matmuls`).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gemv_groups.py [--sweep | --serial]
Lines go to stdout, rows to $OUT/gemv-groups.json.

`--serial`: only each group's one launch at M = 1 as the fast tier's decode step makes it (gate+up with
the SwiGLU in the launch), each call taking the previous call's output as its input, as in a decode
step, under launch_config's shape and each shape of `diag_gemv_configs.candidates(1)` (the gated launch
takes row tiles in pairs, so its RT 1 shapes run as RT 2, as they would in the model); writes the
ENGINE_GEMV_LAUNCH setting that takes each group's fastest shape (3% or more better) to
$OUT/gemv-launch-groups.txt, rows to $OUT/gemv-groups-serial.json.

`--sweep`: also time each group's one launch at M = 1 under each launch shape of
`diag_gemv_configs.candidates(1)`. The shapes were chosen on single 50 MB matrices; a group's block
count differs, and with 72-78 registers a thread (nvcc -Xptxas -v, sm_90) 6-7 blocks of 4 warps fit on
an SM, 792-924 on the H200: the DeltaNet inputs' 1030 blocks then take two waves, the second a tenth
full, gate+up's 2176 three.
"""


import sys

import mlx.core as mx

from engine.kernels.quantized_gemv import LAYER_MIN_OUTPUTS, launch_config, quantized_matmul, quantized_matmuls
from harness.gpu import diag_gemv_configs
from harness.gpu.diag_gemv_configs import candidates, label, launch_setting, save_setting
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, random_quantized, serial_us, time_us, weight_copies

GROUPS = {
    "mlp gate+up": [17408, 17408],
    "deltanet in_proj qkv/z/b/a": [10240, 6144, 48, 48],
    "attention q/k/v": [12288, 1024, 1024],
}
GATED = {"mlp gate+up"}  # one result, silu(gate) * up, as the fast tier's MLP step launches it
K = 5120


def serial() -> None:
    """Each group's one launch at M = 1, calls chained through their outputs' first K values (a view at one row)."""
    cfg, rows, entries = BenchConfig(repeats=9), [], []
    shapes = list(dict.fromkeys(candidates(1) + diag_gemv_configs.SERIAL_EXTRA))
    for name, sizes in GROUPS.items():
        copies = [weight_copies(*random_quantized(n, K, 4, 64), cfg) for n in sizes]
        nbytes = sum(sum(a.nbytes for a in c()) for c in copies)
        x = mx.random.normal((1, K)).astype(mx.bfloat16)
        mx.eval(x)
        gated = name in GATED

        def us(config=None):
            return serial_us(lambda prev: quantized_matmuls(prev[..., :K], [c() for c in copies], 64, 4, config,
                                                            gated=gated)[0], x, cfg)  # fmt: skip

        r = {"group": name, "rows": sum(sizes), "mb": nbytes / 1e6, "gated": gated, "kernel": us(),
             "config": label(launch_config(1, K, 64, 4, sum(sizes)))}  # fmt: skip
        timed = {c: us(c) for c in shapes}
        r["shapes"] = {label(c): t for c, t in timed.items()}
        rows.append(r)
        entries.append((r["rows"], K, r["kernel"], timed))
        ranked = sorted(r["shapes"].items(), key=lambda kv: kv[1])
        print(f"{name} ({r['mb']:.1f} MB, serial): {r['config']} {r['kernel']:.1f} us "
              f"({nbytes / r['kernel'] / 1e3:.0f} GB/s) | best {ranked[0][0]} {ranked[0][1]:.1f}", flush=True)
        print("   ", " | ".join(f"{k} {v:.1f}" for k, v in ranked), flush=True)
        save_json("gemv-groups-serial.json", rows)
        save_setting(launch_setting(entries), "gemv-launch-groups.txt")
    print(f"ENGINE_GEMV_LAUNCH={launch_setting(entries)!r}", flush=True)


def main() -> None:
    cfg = BenchConfig(calls=20, repeats=7)
    rows = []
    for name, sizes in GROUPS.items():
        copies = [weight_copies(*random_quantized(n, K, 4, 64), cfg) for n in sizes]
        nbytes = sum(sum(a.nbytes for a in c()) for c in copies)
        for m in (1, 8):
            x = mx.random.normal((m, K)).astype(mx.bfloat16)
            mx.eval(x)

            def mlx_each():
                return [mx.quantized_matmul(x, *c(), transpose=True, group_size=64, bits=4) for c in copies]

            def ours_each():
                return [quantized_matmul(x, *c(), 64, 4) if n >= LAYER_MIN_OUTPUTS
                        else mx.quantized_matmul(x, *c(), transpose=True, group_size=64, bits=4)
                        for n, c in zip(sizes, copies)]  # fmt: skip

            def ours_group():
                return quantized_matmuls(x, [c() for c in copies], 64, 4)

            r = {"group": name, "m": m, "mb": nbytes / 1e6}
            for arm, fn in (("mlx_each", mlx_each), ("ours_each", ours_each), ("ours_group", ours_group)):
                r[arm] = time_us(fn, cfg)
            rows.append(r)
            print(f"{name} M={m} ({r['mb']:.1f} MB): MLX each {r['mlx_each']:.1f} us | ours each {r['ours_each']:.1f} | "
                  f"ours one launch {r['ours_group']:.1f} ({nbytes / r['ours_group'] / 1e3:.0f} GB/s)", flush=True)
            if "--sweep" in sys.argv and m == 1:
                r["sweep"] = {label(c): time_us(lambda c=c: quantized_matmuls(x, [cp() for cp in copies], 64, 4, config=c), cfg)
                              for c in candidates(1)}  # fmt: skip
                print("    one launch by shape: " + " | ".join(f"{k} {v:.1f}" for k, v in sorted(r["sweep"].items(), key=lambda kv: kv[1])),
                      flush=True)  # fmt: skip
    save_json("gemv-groups.json", rows)


if __name__ == "__main__":
    serial() if "--serial" in sys.argv else main()
