"""Paired bootstrap verdicts, repeated-cell intervals and aggregate ratios against known distributions."""

import numpy as np
import pytest

from harness.run.stats import ONE_BURST, median_of, paired, repeated, sample_ratio

SEEDS = list(range(8))


def noisy(true_ratio, sd, n=8, seed=1):
    return list(true_ratio * np.exp(np.random.default_rng(seed).normal(0, sd, n)))


def test_a_true_ten_percent_gain_with_small_noise_is_faster():
    r = paired("decode", noisy(1.10, 0.01), SEEDS)
    assert r.verdict == "faster" and 1.08 < r.geomean < 1.12 and r.ci_low > 1.01
    assert r.resamples == 10_000 and r.rng_seed == 0 and r.confidence == 0.95


def test_identical_blocks_give_a_zero_width_interval_and_no_verdict():
    r = paired("decode", [1.0] * 6, range(6))
    assert r.ci_low == r.ci_high == 1.0 and r.verdict == "unknown" and "zero-width" in r.note


def test_a_tiny_difference_inside_the_threshold_is_the_same():
    assert paired("decode", noisy(1.002, 0.001), SEEDS).verdict == "same"


def test_lower_is_better_metrics_flip_the_words():
    assert paired("ttft", noisy(0.8, 0.01), SEEDS, higher_is_better=False).verdict == "faster"
    assert paired("ttft", noisy(1.3, 0.01), SEEDS, higher_is_better=False).verdict == "slower"


def test_wide_noise_is_unknown_and_says_how_many_blocks_might_settle_it():
    r = paired("decode", noisy(1.05, 0.08, n=5), range(5))
    assert r.verdict == "unknown" and "blocks" in r.note
    assert r.ci_low < 1.0 < r.ci_high or r.ci_low < 1.01


def test_fewer_than_five_seeds_gets_no_verdict():
    r = paired("decode", [1.2, 1.21, 1.19, 1.2, 1.2], [0, 0, 1, 2, 3])
    assert r.verdict == "unknown" and r.ci_low is None and "too few blocks" in r.note and "5" in r.note


def test_the_interval_is_reproducible_from_its_seed():
    a, b = paired("d", noisy(1.05, 0.05), SEEDS, rng_seed=3), paired("d", noisy(1.05, 0.05), SEEDS, rng_seed=3)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)


def test_bad_ratios_are_refused():
    with pytest.raises(ValueError):
        paired("d", [1.0, 0.0, 1.0, 1.0, 1.0], range(5))


def test_paired_requests_clearly_faster_are_faster():
    base = np.random.default_rng(0).normal(100, 2, 16)
    r = sample_ratio("decode", base * 1.3, base * np.random.default_rng(1).normal(1, 0.01, 16))
    assert r.verdict == "faster" and 1.25 < r.ratio < 1.35 and r.ci_low > 1.05 and r.samples == 16


def test_paired_requests_that_agree_are_the_same():
    base = np.random.default_rng(2).normal(50, 5, 32)
    r = sample_ratio("ttft", base * np.random.default_rng(3).normal(1, 0.002, 32), base, higher_is_better=False)
    assert r.verdict == "same" and 0.95 < r.ci_low <= r.ratio <= r.ci_high < 1.05


def test_too_few_or_too_noisy_requests_are_unknown_and_say_what_would_settle_it():
    few = sample_ratio("decode", [110, 111], [100, 100])
    assert few.verdict == "unknown" and few.ci_low is None and "below 3" in few.note and few.ratio == 110.5 / 100
    rng = np.random.default_rng(4)
    noisy_ = sample_ratio("decode", rng.normal(106, 15, 6), rng.normal(100, 15, 6))
    assert noisy_.verdict == "unknown" and "requests a side" in noisy_.note


def burst_rate(values: np.ndarray) -> np.ndarray:
    """A burst's aggregate rate over [..., n, (tokens, start s, end s)]: what resampling requests cannot estimate."""
    span = values[..., 2].max(axis=-1) - values[..., 1].min(axis=-1)
    return values[..., 0].sum(axis=-1) / span


def test_an_interval_with_its_point_at_an_end_gives_no_verdict_and_says_so():
    # resampling a burst's requests shrinks its span and counts requests twice: every resample on one side of it
    arm = [(64, 0.0, 1.0), (64, 0.0, 1.1), (64, 0.1, 0.9), (64, 0.0, 1.0), (64, 0.05, 1.05), (64, 0.0, 1.02)]
    base = [(64, 0.0, 1.0), (64, 0.0, 1.0), (64, 0.0, 1.0), (64, 0.0, 1.0), (64, 0.0, 1.0), (64, 0.0, 1.0)]
    r = sample_ratio("aggregate", arm, base, burst_rate)
    assert r.ratio == r.ci_low < r.ci_high  # the resamples' own interval (not widened), the point at its end
    assert r.verdict == "unknown" and "lie to one side of the ratio" in r.note


def test_a_repeated_cell_interval_holds_its_point_and_comes_from_the_repetitions():
    r = repeated("aggregate", [1.31, 1.29, 1.30, 1.32])
    assert r.repetitions == 4 and r.ci_low < r.geomean < r.ci_high and r.verdict == "faster" and r.resamples == 0
    assert abs(r.geomean - np.exp(np.mean(np.log([1.31, 1.29, 1.30, 1.32])))) < 1e-12
    wider = repeated("aggregate", [1.5, 1.1, 1.3, 1.2])  # more spread between the repetitions, a wider interval
    assert wider.ci_high - wider.ci_low > r.ci_high - r.ci_low and wider.ci_low < wider.geomean < wider.ci_high
    assert repeated("aggregate", [0.98, 1.02, 1.0]).verdict == "unknown"  # wide against a 5% threshold at n=3


def test_one_burst_is_a_ratio_without_an_interval_or_a_verdict():
    r = repeated("aggregate", [2.0])
    assert r.geomean == 2.0 and r.ci_low is None and r.verdict == "unknown" and r.note == ONE_BURST
    with pytest.raises(ValueError):
        repeated("aggregate", [1.0, 0.0])


def test_lower_is_better_requests_flip_the_words():
    base = np.linspace(90, 110, 12)
    noise = np.random.default_rng(5).normal(1, 0.01, 12)
    assert sample_ratio("ttft", base * 0.5 * noise, base, higher_is_better=False).verdict == "faster"


def test_each_compared_metric_reads_its_own_per_request_samples():
    from harness.run.comparable import request_samples

    reqs = [
        {"ok": True, "ttft_ms": 500.0, "tpot_ms": 20.0, "prompt_tokens": 1000, "cached_tokens": 0},
        {"ok": True, "ttft_ms": 250.0, "tpot_ms": 10.0, "prompt_tokens": 1000, "cached_tokens": 500},
    ]
    cell = {"attempts": [{"ok": True, "requests": reqs}], "metrics": {}}
    assert request_samples(cell, "chat", key="median_decode_tps") == [50.0, 100.0]  # not its TTFTs
    assert request_samples(cell, "cold", key="median_prefill_tps") == [2000.0, 2000.0]
    assert request_samples(cell, "cold") == [500.0, 250.0]
    assert float(median_of(np.array([[3.0], [1.0], [2.0]]))) == 2.0
