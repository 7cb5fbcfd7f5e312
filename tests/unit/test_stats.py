"""Paired bootstrap verdicts against known distributions."""

import numpy as np
import pytest

from harness.stats import median_of, paired, rate_of, sample_ratio

SEEDS = list(range(8))


def noisy(true_ratio, sd, n=8, seed=1):
    return list(true_ratio * np.exp(np.random.default_rng(seed).normal(0, sd, n)))


def test_a_true_ten_percent_gain_with_small_noise_is_faster():
    r = paired("decode", noisy(1.10, 0.01), SEEDS)
    assert r.verdict == "faster" and 1.08 < r.geomean < 1.12 and r.ci_low > 1.01
    assert r.resamples == 10_000 and r.rng_seed == 0 and r.confidence == 0.95


def test_identical_inputs_are_the_same():
    r = paired("decode", [1.0] * 6, range(6))
    assert r.verdict == "same" and r.ci_low == r.ci_high == 1.0


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


def test_an_aggregate_rate_resamples_whole_requests():
    # (tokens, start s, end s): the arm finishes the same tokens in half the span
    arm = [(64, 0.0, 1.0), (64, 0.0, 1.1), (64, 0.1, 0.9), (64, 0.0, 1.0)]
    base = [(64, 0.0, 2.0), (64, 0.0, 2.2), (64, 0.2, 1.8), (64, 0.0, 2.0)]
    r = sample_ratio("aggregate", arm, base, rate_of)
    assert r.verdict == "faster" and abs(r.ratio - 2.0) < 1e-9
    assert float(median_of(np.array([[3.0], [1.0], [2.0]]))) == 2.0


def test_lower_is_better_requests_flip_the_words():
    base = np.linspace(90, 110, 12)
    assert sample_ratio("ttft", base * 0.5, base, higher_is_better=False).verdict == "faster"


def test_each_compared_metric_reads_its_own_per_request_samples():
    from harness.comparable import request_samples

    reqs = [{"ok": True, "ttft_ms": 500.0, "tpot_ms": 20.0, "prompt_tokens": 1000, "cached_tokens": 0},
            {"ok": True, "ttft_ms": 250.0, "tpot_ms": 10.0, "prompt_tokens": 1000, "cached_tokens": 500}]  # fmt: skip
    cell = {"attempts": [{"ok": True, "requests": reqs}], "metrics": {}}
    assert request_samples(cell, "chat", key="median_decode_tps")[0] == [[50.0], [100.0]]  # not its TTFTs
    assert request_samples(cell, "cold", key="median_prefill_tps")[0] == [[2000.0], [2000.0]]
    assert request_samples(cell, "cold")[0] == [[500.0], [250.0]]
