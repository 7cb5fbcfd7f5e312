"""How `harness kernels` times the kernels: rows, prefill lengths, repetitions, calls an evaluation, the
weights' rotation. Its own module, without MLX, so that the CLI takes its defaults from here at parse time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    tokens: tuple[int, ...] = (64, 1024)
    warmup: int = 2
    repeats: int = 7
    # GEMV calls per evaluation. MLX's CUDA backend spends a few hundred us an evaluation besides the calls
    # (H200, 17408x5120 M = 1: 29.6 us a call at 50 calls, 21.9 at 200; MLX's kernel 56.1 and 52.8), which a
    # decode step, ~800 operations an evaluation, spreads thin: 400 calls time the kernels as a step runs them.
    calls: int = 400
    peak_gbs: float = 4800.0  # H200 HBM3e
    cold_bytes: int = 256 << 20  # weights the GEMV calls rotate over (0: one copy, cache-warm)
    max_copies: int = 128
    max_shapes: int | None = None
