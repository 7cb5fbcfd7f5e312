"""Verdicts for A-vs-B claims: paired blocks (`harness trials`), paired requests (one run) and repeated cells.

Blocks: each block ran both arms on one workload seed, so each gives one ratio
(arm / baseline) of a metric; the claim is the geometric mean of those ratios
with a 95% percentile-bootstrap interval (scipy) over blocks, and a verdict
needs at least five distinct workload seeds (`paired`).

Requests: within one run both arms got the same frozen requests in the same
order, so requests pair by index; the claim is the ratio of a median of each
arm's requests with a percentile interval from resampling the pairs
(`sample_ratio`). It sees the spread inside one run only, not between runs
(two back-to-back runs of a tiny model differed ~2x), so its noise threshold
is wider (`SINGLE_RUN_THRESHOLD`). An aggregate rate (a burst's output tokens
over its span) is one number a burst, not a statistic of its requests:
resampling them shrinks the span and counts requests twice, which put every
resample on one side of the point. It gets no interval from one burst.

Repetitions: a concurrency or rate cell run N times (`harness run all
--cell-repeats N`, blocks in alternating arm order) gives one ratio a
repetition; the claim is their geometric mean with a Student-t interval over
the log ratios (`repeated`): with three to five values a percentile bootstrap
covers far less than its nominal 95%.

The verdict, three-way against the noise threshold (criterion.rs' reading of
a change, Pinpoint's same / different / unknown):

    faster / slower  the whole interval lies beyond the threshold (different)
    same             the whole interval lies inside it
    unknown          neither, or too few blocks or requests; the note says how many would likely settle it;
                     also an interval of zero width, or one whose point sits at or past an end (the note says so)

"faster" follows the metric's direction: a higher decode rate, a lower TTFT.
The resampling seed and count are part of every result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

MIN_SEEDS = 5
MIN_SAMPLES = 3  # paired requests a one-run verdict needs
NOISE_THRESHOLD = 0.01
SINGLE_RUN_THRESHOLD = 0.05
RESAMPLES = 10_000
CONFIDENCE = 0.95
UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A ratio's interval, verdict and note (the module docstring), and how the interval was resampled."""

    metric: str
    higher_is_better: bool
    ci_low: float | None
    ci_high: float | None
    confidence: float
    resamples: int
    rng_seed: int
    threshold: float
    verdict: str
    note: str

    def as_record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class PairedResult(Claim):
    """The geometric mean of per-block ratios (`paired`)."""

    blocks: int
    seeds: tuple[int, ...]
    ratios: tuple[float, ...]
    geomean: float | None


def _blocks_to_settle(n: int, log_center: float, log_half_width: float, log_threshold: float) -> int | None:
    """Blocks needed for the interval (shrinking as 1/sqrt(n)) to clear or fit inside the threshold band."""
    margin = abs(abs(log_center) - log_threshold)
    if margin < 1e-12 or log_half_width <= 0:
        return None
    return max(n + 1, math.ceil(n * (log_half_width / margin) ** 2))


def paired(
    metric: str,
    ratios: Sequence[float],
    seeds: Sequence[int],
    *,
    higher_is_better: bool = True,
    threshold: float = NOISE_THRESHOLD,
    resamples: int = RESAMPLES,
    rng_seed: int = 0,
    confidence: float = CONFIDENCE,
) -> PairedResult:
    ratios = tuple(float(r) for r in ratios)
    seeds = tuple(int(s) for s in seeds)
    if len(ratios) != len(seeds):
        raise ValueError("one ratio per block, one seed per block")
    base = {
        "metric": metric,
        "higher_is_better": higher_is_better,
        "blocks": len(ratios),
        "seeds": seeds,
        "ratios": ratios,
        "confidence": confidence,
        "resamples": resamples,
        "rng_seed": rng_seed,
        "threshold": threshold,
    }
    bad = [r for r in ratios if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ValueError(f"ratios must be positive and finite, got {bad[:3]}")
    if len(set(seeds)) < MIN_SEEDS:
        gm = math.exp(float(np.mean(np.log(ratios)))) if ratios else None
        return PairedResult(
            **base,
            geomean=gm,
            ci_low=None,
            ci_high=None,
            verdict=UNKNOWN,
            note=f"too few blocks: {len(set(seeds))} distinct seeds; a verdict needs at least {MIN_SEEDS}",
        )
    logs = np.log(np.asarray(ratios))
    center = float(logs.mean())
    if np.ptp(logs) == 0:  # every block agrees: a zero-width interval, which `_verdict` takes for no evidence
        lo = hi = center
    else:
        # scipy on use: it takes ~0.8 s to import, and every subcommand's parser imports this module (the summary's)
        from scipy import stats as sps

        res = sps.bootstrap(
            (logs,),
            np.mean,
            confidence_level=confidence,
            n_resamples=resamples,
            method="percentile",
            random_state=np.random.default_rng(rng_seed),
        )
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    verdict, note = _verdict(lo, hi, center, len(ratios), threshold, higher_is_better, "blocks")
    return PairedResult(
        **base, geomean=math.exp(center), ci_low=math.exp(lo), ci_high=math.exp(hi), verdict=verdict, note=note
    )


def _verdict(
    lo: float, hi: float, center: float, n: int, threshold: float, higher_is_better: bool, unit: str
) -> tuple[str, str]:
    """(verdict, note) for a log-ratio interval [lo, hi] around `center` from `n` blocks or requests."""
    if hi <= lo:
        return UNKNOWN, f"a zero-width interval (every resample of the {n} {unit} gave one ratio) is no evidence"
    if not lo < center < hi:
        return UNKNOWN, (
            f"the resamples of the {n} {unit} lie to one side of the ratio (at or past an end of their "
            "interval): no verdict"
        )
    t = math.log1p(threshold)
    better, worse = ("faster", "slower") if higher_is_better else ("slower", "faster")
    if lo > t:
        return better, ""
    if hi < -t:
        return worse, ""
    if lo >= -t and hi <= t:
        return "same", ""
    need = _blocks_to_settle(n, center, (hi - lo) / 2, t)
    return UNKNOWN, (
        f"about {need} {unit} would likely settle it"
        if need
        else f"the estimate sits on the threshold: more {unit} are unlikely to settle it"
    )


@dataclass(frozen=True, kw_only=True)
class SampleRatio(Claim):
    """The ratio of one statistic of two arms' paired requests (`sample_ratio`)."""

    samples: int
    ratio: float | None


def median_of(values: np.ndarray) -> np.ndarray:
    """The statistic of a decode rate or a TTFT: the median of column 0 of [..., n, columns] samples."""
    return np.median(values[..., 0], axis=-1)


def sample_ratio(
    metric: str,
    arm: Sequence[Sequence[float]],
    base: Sequence[Sequence[float]],
    statistic=median_of,
    *,
    higher_is_better: bool = True,
    threshold: float = SINGLE_RUN_THRESHOLD,
    resamples: int = RESAMPLES,
    rng_seed: int = 0,
    confidence: float = CONFIDENCE,
) -> SampleRatio:
    """statistic(arm) / statistic(base) for requests paired by index (each a row of columns the statistic reads),
    with a percentile interval from resampling the pairs together and a verdict (module docstring). The interval is
    the resamples' own: where the point sits at or past an end of it, the verdict is unknown and the note says so."""
    a, b = np.asarray(arm, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.ndim == 1:
        a, b = a[:, None], b[:, None]
    if a.shape != b.shape:
        raise ValueError(f"paired requests: {a.shape} against {b.shape}")
    n = len(a)
    record = {
        "metric": metric,
        "higher_is_better": higher_is_better,
        "samples": n,
        "confidence": confidence,
        "resamples": resamples,
        "rng_seed": rng_seed,
        "threshold": threshold,
    }
    point = float(statistic(a) / statistic(b)) if n else float("nan")
    if not (point > 0 and math.isfinite(point)):
        return SampleRatio(
            **record, ratio=None, ci_low=None, ci_high=None, verdict=UNKNOWN, note="no positive value on one side"
        )
    if n < MIN_SAMPLES:
        return SampleRatio(
            **record,
            ratio=point,
            ci_low=None,
            ci_high=None,
            verdict=UNKNOWN,
            note=f"{n} request{'s' * (n != 1)} a side: no interval below {MIN_SAMPLES}",
        )
    idx = np.random.default_rng(rng_seed).integers(0, n, size=(resamples, n))
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample with no value on a side: dropped below
        logs = np.log(statistic(a[idx]) / statistic(b[idx]))
    logs = logs[np.isfinite(logs)]
    if not logs.size:
        return SampleRatio(
            **record,
            ratio=point,
            ci_low=None,
            ci_high=None,
            verdict=UNKNOWN,
            note="no resample had a value on both sides",
        )
    alpha = (1 - confidence) / 2
    lo, hi = (float(v) for v in np.quantile(logs, [alpha, 1 - alpha]))
    verdict, note = _verdict(lo, hi, math.log(point), n, threshold, higher_is_better, "requests a side")
    return SampleRatio(**record, ratio=point, ci_low=math.exp(lo), ci_high=math.exp(hi), verdict=verdict, note=note)


MIN_REPEATS = 2  # repetitions a t interval needs (one is one burst)


@dataclass(frozen=True, kw_only=True)
class RepeatedResult(Claim):
    """The geometric mean of per-repetition ratios of a repeated cell (`repeated`); nothing is resampled."""

    repetitions: int
    ratios: tuple[float, ...]
    geomean: float | None


def repeated(
    metric: str,
    ratios: Sequence[float],
    *,
    higher_is_better: bool = True,
    threshold: float = SINGLE_RUN_THRESHOLD,
    confidence: float = CONFIDENCE,
) -> RepeatedResult:
    """The geometric mean of one ratio a repetition with a Student-t interval over the log ratios (symmetric about
    its point) and a verdict; one repetition is one burst: a ratio, no interval."""
    ratios = tuple(float(r) for r in ratios)
    if not ratios or not all(r > 0 and math.isfinite(r) for r in ratios):
        raise ValueError(f"ratios must be positive and finite, got {ratios[:3]}")
    n, logs = len(ratios), np.log(np.asarray(ratios))
    center = float(logs.mean())
    base = {
        "metric": metric,
        "higher_is_better": higher_is_better,
        "repetitions": n,
        "ratios": ratios,
        "geomean": ratios[0] if n == 1 else math.exp(center),
        "confidence": confidence,
        "resamples": 0,
        "rng_seed": 0,
        "threshold": threshold,
    }
    if n < MIN_REPEATS:
        return RepeatedResult(**base, ci_low=None, ci_high=None, verdict=UNKNOWN, note=ONE_BURST)
    from scipy import stats as sps  # on use, as in `paired`

    half = float(sps.t.ppf((1 + confidence) / 2, n - 1)) * float(logs.std(ddof=1)) / math.sqrt(n)
    verdict, note = _verdict(center - half, center + half, center, n, threshold, higher_is_better, "repetitions")
    return RepeatedResult(
        **base, ci_low=math.exp(center - half), ci_high=math.exp(center + half), verdict=verdict, note=note
    )


ONE_BURST = "one burst"  # an aggregate rate measured once: a ratio, no interval, no verdict


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive values."""
    return math.exp(sum(math.log(v) for v in values) / len(values))
