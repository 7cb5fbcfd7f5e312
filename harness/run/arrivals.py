"""Open-loop load: when each request of a rate cell is sent, which requests are measured, where a sweep stops.

Arrivals follow vLLM's `bench serve`: inter-arrival gaps drawn from a gamma
distribution of shape `burstiness` and mean 1 / rate (burstiness 1: a Poisson
process; below 1 burstier, above 1 more even), from a seed, so every arm gets
the same schedule. A cell's first and last requests (`WARMUP_SHARE`,
`COOLDOWN_SHARE`) run while the server fills up and drains: they are sent and
recorded, and left out of the cell's metrics.

A sweep doubles the rate from `SWEEP_START` until the server saturates:
throughput no longer rises with the offered rate (under `SATURATION_GAIN` over
the cell before) while TTFT climbs (median over `SATURATION_TTFT` times the
first cell's). A cell whose requests all arrived within their median E2EL is a
burst, not a sustained rate (`is_burst`): the cell is too short for its rate, and
the higher rates of a sweep would be the same burst, so the sweep stops there
when the server was not saturated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

WARMUP_SHARE = 0.1
COOLDOWN_SHARE = 0.1
SWEEP_START = 1.0
SWEEP_CELLS = 8  # 1, 2, 4, ... 128 requests/s at most
SATURATION_GAIN = 0.05
SATURATION_TTFT = 2.0


def offsets(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the cell's start) of n requests offered at `rate` requests/s."""
    if n <= 0:
        return []
    if not 0 < rate < math.inf or not burstiness > 0:
        raise ValueError(f"a rate and a burstiness above 0, not {rate} and {burstiness}")
    rng = np.random.Generator(np.random.PCG64([seed, int(rate * 1000), int(burstiness * 1000), 0xA7]))
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request opens the cell
    return [round(float(t), 6) for t in np.cumsum(gaps)]


def measured(n: int) -> slice:
    """The requests of an n-request cell its metrics are taken over (by arrival order): all but the warm-up and
    cool-down shares, at least one request."""
    head, tail = math.ceil(n * WARMUP_SHARE), math.ceil(n * COOLDOWN_SHARE)
    if head + tail >= n:
        return slice(0, n)
    return slice(head, n - tail)


def sweep_rates(start: float = SWEEP_START) -> list[float]:
    """A sweep's rates: `start` requests/s, doubling, SWEEP_CELLS of them."""
    return [start * 2**i for i in range(SWEEP_CELLS)]


def saturated(throughputs: Sequence[float | None], ttfts: Sequence[float | None]) -> bool:
    """Whether the last cell of a sweep (each cell's output tok/s and median TTFT ms, in rate order) shows the
    server saturated: throughput gained under SATURATION_GAIN on the cell before while TTFT passed
    SATURATION_TTFT times the first cell's."""
    if len(throughputs) < 2 or None in (throughputs[-1], throughputs[-2], ttfts[-1], ttfts[0]):
        return False
    flat = throughputs[-1] < throughputs[-2] * (1 + SATURATION_GAIN)
    return flat and ttfts[-1] > SATURATION_TTFT * ttfts[0]


def rate_name(rate: float) -> str:
    """The phase of a rate cell: rate-0.5, rate-4."""
    return f"rate-{rate:g}"


def rate_of_phase(phase: str) -> float:
    return float(phase.split("-", 1)[1])


def is_burst(sent_at: Sequence[float], median_e2el_ms: float | None) -> bool:
    """Whether a rate cell's arrivals (wall-clock send times, s) spanned less than its requests' median E2EL: the
    server then saw one burst of the cell's requests, whatever the offered rate."""
    if len(sent_at) < 2 or median_e2el_ms is None:
        return False
    return max(sent_at) - min(sent_at) < median_e2el_ms / 1e3
