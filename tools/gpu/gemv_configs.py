"""Launch configurations of the quantized matmul kernel vs MLX on qwen27b's shapes, weights cold (rotated
over copies larger than the L2), after checking its numerics against a float32 CPU reference on edge
shapes (N not a multiple of 16, every bits x group x M). `launch_config`'s choices come from this, and from
2 rows the staged kernel's (`staged.staged_config`: chunks in flight, warps, K splits).

    python3 -m tools.gpu.gemv_configs [--quick] [--no-numerics] [--serial] [--candidates W,RT,U[,MINB];...]
                                      [--rows 1,4,8,16,32,64]

--serial: each call adds its product to the previous call's output (the residual in the launch), so it waits
for it, as in a decode step; independent calls may run side by side, which hides launches of few blocks
(harness.kernels.bench.serial_us). M = 1 only; every candidate on every shape. At the end it prints the
ENGINE_GEMV_LAUNCH setting that takes each shape's fastest candidate where that beats launch_config's by 3%
or more; $OUT/gemv-launch.txt holds it, rewritten after each shape. Lines go to stdout, rows to
$OUT/gemv-configs.json.
"""

import argparse
import os
from dataclasses import replace

import mlx.core as mx

from engine.kernels.quantized_gemv import LaunchConfig, launch_config, quantized_matmul, quantized_matmuls
from engine.kernels.quantized_gemv.launch import LAUNCH_FORM
from engine.kernels.quantized_gemv.staged import MIN_ROWS, StagedConfig, staged_config
from harness.kernels.bench import BenchConfig, random_quantized, rounding_bound, serial_us, time_us, weight_copies
from tools.gpu.results import save_json


def numerics():
    bad = 0
    for bits in (4, 8):
        for gs in (32, 64):
            for n, k in ((1000, 1024), (4096, 5120)):
                w, s, b = random_quantized(n, k, bits, gs)
                for m in (1, 2, 3, 5, 8, 9, 16, 33, 64):
                    x = mx.random.normal((m, k)).astype(mx.bfloat16)
                    out = quantized_matmul(x, w, s, b, gs, bits).astype(mx.float32)
                    mx.eval(out)
                    with mx.stream(mx.cpu):
                        f32 = (
                            mx.float32
                        )  # weights dequantized in float32, as the kernel test does (MLX's rounds them to bf16)
                        exact = (
                            x.astype(f32) @ mx.dequantize(w, s.astype(f32), b.astype(f32), group_size=gs, bits=bits).T
                        )
                        mx.eval(exact)
                    tol = rounding_bound(exact)
                    ok = mx.all(mx.abs(out - exact) <= tol).item()
                    bad += not ok
                    if not ok or (m in (1, 16) and n == 4096):
                        print(
                            f"numerics bits={bits} gs={gs} {n}x{k} M={m}: {'ok' if ok else 'FAIL'} "
                            f"max|diff| {mx.abs(out - exact).max().item():.2e} max|ref| {mx.abs(exact).max().item():.2f}",
                            flush=True,
                        )
    print(f"numerics: {bad} failures", flush=True)
    return bad


def label(c) -> str:
    if isinstance(c, StagedConfig):
        return (
            f"staged W{c.warps} RT{c.row_tiles} ST{c.stages} S{c.splits}"
            + (f" CK{c.chunk_tiles}" if c.chunk_tiles else "")
            + (f" B{c.min_blocks}" if c.min_blocks else "")
        )
    return (
        f"W{c.warps} RT{c.row_tiles} U{c.batch}"
        + (f" B{c.min_blocks}" if c.min_blocks else "")
        + (f" WR{c.row_groups}" if c.row_groups > 1 else "")
        + (f" WM{c.m_groups}" if c.m_groups > 1 else "")
    )


# More warps a block for launches of few blocks (the N = 5120 shapes), some with their registers capped: timed
# in the serial sweeps only.
SERIAL_EXTRA = [
    LaunchConfig(*shape)
    for shape in ((6, 1, 4), (12, 1, 4), (8, 2, 4), (8, 1, 2), (16, 1, 2), (8, 1, 4, 4), (16, 1, 4, 2), (12, 1, 4, 2))
]


def launch_shapes(text: str) -> list[LaunchConfig]:
    """'W,RT,U[,MINB];...' as launch configurations."""
    try:
        return [LaunchConfig.parse(item) for item in text.split(";") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: launch shapes {LAUNCH_FORM} separated by ';'") from None


def candidates(m: int, serial: bool, chosen: list[LaunchConfig], n: int = 0, k: int = 0):
    if chosen and m == 1:
        return chosen
    if m >= MIN_ROWS:  # the staged kernel's shapes and splits, and the register kernel's launch at these rows
        default = staged_config(m, k, 64, 4)
        shapes = [replace(default, splits=s) for s in (1, 2, 4) if s != default.splits and (k // 128) % s == 0]
        shapes += [replace(default, stages=st) for st in (2, 3, 4) if st != default.stages]
        shapes += [replace(default, warps=8), replace(default, warps=8, stages=5 - default.stages)]
        return shapes + [launch_config(m, k, 64, 4, n)]
    if m > 8:  # row tiles, row groups and slices of the activation rows (W, RT, U, WR, WM, MINB), W = WR x WM x K split
        shapes = (
            (16, 1, 4, 4, 4, 1),
            (8, 2, 2, 2, 4, 2),
            (8, 2, 1, 2, 4, 2),
            (8, 4, 1, 2, 4, 2),
            (16, 2, 2, 4, 4, 1),
            (8, 4, 1, 1, 8, 2),
            (4, 2, 2, 1, 4, 4),
            (4, 4, 1, 1, 4, 4),
            (4, 2, 4, 4, 1, 0),
            (4, 4, 2, 4, 1, 0),
            (8, 2, 4, 4, 2, 1),
            (4, 4, 1, 2, 2, 2),
            (8, 4, 1, 2, 2, 2),
            (4, 2, 1, 1, 2, 4),
            (8, 2, 1, 1, 4, 4),
        )
        return [
            LaunchConfig(w, rt, u, minb, row_groups=wr, m_groups=wm)
            for w, rt, u, wr, wm, minb in shapes
            if wm <= -(-m // 8)
        ]
    if m > 1:
        return [LaunchConfig(*shape) for shape in ((4, 1, 4), (4, 2, 4), (4, 2, 8))]
    # W * U k-tiles a round: K = 5120 has 80 (4 x 4: 5 rounds a warp; 5 x 8, 10 x 4: 2; 10 x 8, 20 x 4: 1)
    shapes = [
        (2, 1, 8),
        (4, 1, 4),
        (4, 1, 8),
        (4, 2, 4),
        (8, 1, 4),
        (5, 1, 4),
        (5, 1, 8),
        (10, 1, 4),
        (10, 1, 8),
        (20, 1, 4),
        (16, 1, 4),
        (8, 1, 8),
    ]
    return [LaunchConfig(*shape) for shape in shapes] + (SERIAL_EXTRA if serial else [])


def timing(
    quick: bool, serial: bool, chosen: list[LaunchConfig], first: int = 0, rows_m: tuple[int, ...] = (1, 4, 8, 16)
) -> tuple[list, dict]:
    """Every shape's times; the rows and the candidates timed, by label."""
    rows, configs = [], {}
    cfg = BenchConfig(repeats=9)  # 400 calls an evaluation, as the kernel table
    warm = BenchConfig(repeats=9, cold_bytes=0)
    shapes = [
        (17408, 5120),
        (5120, 17408),
        (10240, 5120),
        (12288, 5120),
        (6144, 5120),
        (5120, 6144),
        (1024, 5120),
        (248320, 5120),
    ]
    for n, k in shapes[first:2] if quick else shapes[first:]:
        w, s, b = random_quantized(n, k, 4, 64)
        nbytes = w.nbytes + s.nbytes + b.nbytes
        weights = weight_copies(w, s, b, cfg)
        main = (n, k) in shapes[:2] or serial or min(rows_m) >= MIN_ROWS
        for m in ((1,) if serial else rows_m) if main else (1,):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            res = {"n": n, "k": k, "m": m, "mb": nbytes / 1e6, "serial": serial}
            zeros = mx.zeros((m, n), dtype=mx.bfloat16)

            def mlx_call():
                return mx.quantized_matmul(x, *weights(), transpose=True, group_size=64, bits=4)

            def kernel_call(config=None, residual=None):
                return quantized_matmuls(x, [weights()], 64, 4, config, residual=residual)[0]

            # serial: each call adds to the previous output (an add after MLX's; the residual in our launch)
            def mlx_us():
                return serial_us(lambda r: r + mlx_call(), zeros, cfg) if serial else time_us(mlx_call, cfg)

            def kernel_us(config=None):
                if serial:
                    return serial_us(lambda r: kernel_call(config, r), zeros, cfg)
                return time_us(lambda: kernel_call(config), cfg)

            res["mlx"] = mlx_us()
            res["kernel"] = kernel_us()
            res_config = staged_config(m, k, 64, 4) if m >= MIN_ROWS else launch_config(m, k, 64, 4, n)
            res["config"] = label(res_config)
            if main and m == 1 and not serial:
                res["mlx_warm"] = time_us(
                    lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4), warm
                )
                res["kernel_warm"] = time_us(lambda: quantized_matmul(x, w, s, b, 64, 4), warm)
            for c in candidates(m, serial, chosen, n, k) if main else ():
                res[label(c)] = kernel_us(c)
                configs[label(c)] = c
                print(f"  {n}x{k} M={m} {label(c)}: {res[label(c)]:.1f} us (default {res['kernel']:.1f})", flush=True)
            ranked = sorted(
                (v, key)
                for key, v in res.items()
                if isinstance(v, float) and key not in ("mb", "mlx", "mlx_warm", "kernel_warm")
            )
            best = ranked[0]
            print("   ", " | ".join(f"{key} {v:.1f}" for v, key in ranked), flush=True)
            print(
                f"{n}x{k} M={m} ({nbytes / 1e6:.1f} MB): mlx {res['mlx']:.1f} us "
                f"({nbytes / res['mlx'] / 1e3:.0f} GB/s) | kernel {res['kernel']:.1f} us "
                f"({nbytes / res['kernel'] / 1e3:.0f} GB/s) | best {best[1]} {best[0]:.1f} us ({nbytes / best[0] / 1e3:.0f} GB/s)"
                + (f" | warm: mlx {res['mlx_warm']:.1f} kernel {res['kernel_warm']:.1f}" if "mlx_warm" in res else ""),
                flush=True,
            )
            rows.append(res)
            save_json("gemv-configs-serial.json" if serial else "gemv-configs.json", rows)
            if serial:
                save_setting(serial_setting(rows, configs))
    return rows, configs


def launch_setting(entries) -> str:
    """ENGINE_GEMV_LAUNCH taking each shape's fastest candidate where it beats launch_config's by 3% or more;
    entries: (launch rows, k, launch_config's us, {candidate LaunchConfig: us})."""
    items = []
    for n, k, default_us, timed in entries:
        best = min(timed, key=timed.get, default=None)
        if best is not None and timed[best] <= 0.97 * default_us:
            items.append(f"{n}x{k}={best.setting()}")
    return ";".join(items)


def save_setting(setting: str, name: str = "gemv-launch.txt") -> None:
    """Write the setting to $OUT/name (after each shape, so a call that runs out of time keeps it)."""
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        f.write(setting + "\n")


def serial_setting(rows: list, configs: dict) -> str:
    return launch_setting(
        (r["n"], r["k"], r["kernel"], {c: r[key] for key, c in configs.items() if key in r}) for r in rows
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the two 50 MB matrices only (at --rows)")
    p.add_argument("--serial", action="store_true", help="each call waits for the one before (M = 1)")
    p.add_argument("--no-numerics", action="store_true", help="skip the numerics check")
    p.add_argument("--time-anyway", action="store_true", help="time even when the numerics check fails")
    p.add_argument("--candidates", type=launch_shapes, default=[], help="M = 1 candidates in place of the sweep's")
    p.add_argument("--first-shape", type=int, default=0, help="skip the first N shapes")
    p.add_argument(
        "--rows", default="1,4,8,16", help="activation rows M timed on the two 50 MB matrices (default 1,4,8,16)"
    )
    args = p.parse_args()
    if args.no_numerics or numerics() == 0 or args.time_anyway:
        rows_m = tuple(int(m) for m in args.rows.split(","))
        rows, configs = timing(args.quick, args.serial, args.candidates, args.first_shape, rows_m)
        if args.serial:
            print(f"ENGINE_GEMV_LAUNCH={serial_setting(rows, configs)!r}", flush=True)


if __name__ == "__main__":
    main()
