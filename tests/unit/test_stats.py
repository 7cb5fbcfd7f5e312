"""Paired bootstrap verdicts against known distributions."""

import numpy as np
import pytest

from harness.stats import paired

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


def test_wide_noise_is_inconclusive_and_says_how_many_blocks_might_settle_it():
    r = paired("decode", noisy(1.05, 0.08, n=5), range(5))
    assert r.verdict == "inconclusive" and "blocks" in r.note
    assert r.ci_low < 1.0 < r.ci_high or r.ci_low < 1.01


def test_fewer_than_five_seeds_gets_no_verdict():
    r = paired("decode", [1.2, 1.21, 1.19, 1.2, 1.2], [0, 0, 1, 2, 3])
    assert r.verdict == "too few blocks" and r.ci_low is None and "5" in r.note


def test_the_interval_is_reproducible_from_its_seed():
    a, b = paired("d", noisy(1.05, 0.05), SEEDS, rng_seed=3), paired("d", noisy(1.05, 0.05), SEEDS, rng_seed=3)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)


def test_bad_ratios_are_refused():
    with pytest.raises(ValueError):
        paired("d", [1.0, 0.0, 1.0, 1.0, 1.0], range(5))
