"""Paired statistics for A-vs-B claims (`harness trials` output).

Each block ran both arms on one workload seed, so each block gives one ratio
(arm / baseline) of a metric. The claim is the geometric mean of those
ratios, with a 95% percentile-bootstrap interval (scipy) over blocks; the
resampling seed and count are part of the result. A verdict needs at least
five distinct workload seeds:

    faster / slower  the whole interval lies beyond the noise threshold (default 1%)
    same             the whole interval lies inside it
    inconclusive     neither; with an estimate of how many blocks would likely settle it
    too few blocks   fewer than five distinct seeds

"faster" follows the metric's direction: a higher decode rate, a lower TTFT.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats as sps

MIN_SEEDS = 5
NOISE_THRESHOLD = 0.01
RESAMPLES = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedResult:
    metric: str
    higher_is_better: bool
    blocks: int
    seeds: tuple[int, ...]
    ratios: tuple[float, ...]
    geomean: Optional[float]
    ci_low: Optional[float]
    ci_high: Optional[float]
    confidence: float
    resamples: int
    rng_seed: int
    threshold: float
    verdict: str
    note: str

    def as_record(self) -> dict:
        return asdict(self)


def _blocks_to_settle(n: int, log_center: float, log_half_width: float, log_threshold: float) -> Optional[int]:
    """Blocks needed for the interval (shrinking as 1/sqrt(n)) to clear or fit inside the threshold band."""
    margin = abs(abs(log_center) - log_threshold)
    if margin < 1e-12 or log_half_width <= 0:
        return None
    return max(n + 1, math.ceil(n * (log_half_width / margin) ** 2))


def paired(metric: str, ratios: Sequence[float], seeds: Sequence[int], *, higher_is_better: bool = True,
           threshold: float = NOISE_THRESHOLD, resamples: int = RESAMPLES, rng_seed: int = 0,
           confidence: float = CONFIDENCE) -> PairedResult:  # fmt: skip
    ratios = tuple(float(r) for r in ratios)
    seeds = tuple(int(s) for s in seeds)
    if len(ratios) != len(seeds):
        raise ValueError("one ratio per block, one seed per block")
    base = {"metric": metric, "higher_is_better": higher_is_better, "blocks": len(ratios), "seeds": seeds,
            "ratios": ratios, "confidence": confidence, "resamples": resamples, "rng_seed": rng_seed,
            "threshold": threshold}  # fmt: skip
    bad = [r for r in ratios if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ValueError(f"ratios must be positive and finite, got {bad[:3]}")
    if len(set(seeds)) < MIN_SEEDS:
        gm = math.exp(float(np.mean(np.log(ratios)))) if ratios else None
        return PairedResult(**base, geomean=gm, ci_low=None, ci_high=None, verdict="too few blocks",
                            note=f"{len(set(seeds))} distinct seeds; a verdict needs at least {MIN_SEEDS}")  # fmt: skip
    logs = np.log(np.asarray(ratios))
    center = float(logs.mean())
    if np.ptp(logs) == 0:  # every block agrees: the interval is that point
        lo = hi = center
    else:
        res = sps.bootstrap((logs,), np.mean, confidence_level=confidence, n_resamples=resamples,
                            method="percentile", random_state=np.random.default_rng(rng_seed))  # fmt: skip
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    t = math.log1p(threshold)
    better, worse = ("faster", "slower") if higher_is_better else ("slower", "faster")
    note = ""
    if lo > t:
        verdict = better
    elif hi < -t:
        verdict = worse
    elif lo >= -t and hi <= t:
        verdict = "same"
    else:
        verdict = "inconclusive"
        need = _blocks_to_settle(len(ratios), center, (hi - lo) / 2, t)
        note = (f"about {need} blocks would likely settle it" if need
                else "the estimate sits on the threshold: more blocks are unlikely to settle it")  # fmt: skip
    return PairedResult(**base, geomean=math.exp(center), ci_low=math.exp(lo), ci_high=math.exp(hi),
                        verdict=verdict, note=note)  # fmt: skip
