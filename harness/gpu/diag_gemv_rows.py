"""Rows per warp and loads in flight for the M = 1..4 GEMV: time each choice on qwen27b's main
shapes (H200 tuning aid; the kernel's defaults come from this).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gemv_rows.py
"""

import mlx.core as mx

from engine.kernels.quantized_gemv import quantized_matmul
from harness.kernel_bench import BenchConfig, time_us

cfg = BenchConfig(calls=50, repeats=5)
for n, k in [(17408, 5120), (5120, 17408), (12288, 5120), (248320, 5120)]:
    w, s, b = mx.quantize((mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16), group_size=64, bits=4)
    nbytes = w.nbytes + s.nbytes + b.nbytes
    for m in (1, 4):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        mx.eval(w, s, b, x)
        row = [f"{n}x{k} M={m}"]
        for r in (2, 4, 8):
            for prefetch in (8, 16):
                if prefetch // r < 1:
                    continue
                us = time_us(lambda: quantized_matmul(x, w, s, b, 64, 4, rows=r, prefetch=prefetch), cfg)
                row.append(f"R={r} P={prefetch}: {us:.1f} us {nbytes / us / 1e3:.0f} GB/s")
        builtin = time_us(lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4), cfg)
        row.append(f"mlx: {builtin:.1f} us")
        print(" | ".join(row), flush=True)
