"""Draft policies: fixed (mlx-lm's rule) and adaptive (expected tokens per second)."""

import pytest

from engine.speculative.policy import MAX_PROBE, PROBE, AdaptivePolicy, FixedPolicy, make_policy


def test_fixed_always_drafts_the_limit():
    p = FixedPolicy()
    assert [p.choose(n) for n in (0, 1, 3)] == [0, 1, 3]


def test_expected_tokens_chains_per_position_acceptance():
    p = AdaptivePolicy(3)
    assert p.expected_tokens(0) == 1.0
    assert p.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the Beta(1, 1) prior: 1/2 each
    p.taken, p.tried = [9.0, 0.0, 0.0], [9.0, 0.0, 0.0]
    assert p.acceptance(0) == pytest.approx(10 / 11)


def _run(p, rounds, accept, draft_s, verify_s):
    """Feed the policy `rounds` rounds of a world where each draft is accepted with chance `accept`
    (deterministically: the first int(accept * k) drafts) and the costs are fixed."""
    chosen = []
    for _ in range(rounds):
        k = p.choose(3)
        chosen.append(k)
        accepted = int(accept * k + 1e-9)
        p.record(k, accepted, k * draft_s, verify_s(k + 1))
    return chosen


def test_measures_the_full_window_then_a_plain_step_first():
    p = AdaptivePolicy(3)
    assert _run(p, 2, 1.0, 0.1, lambda w: 1.0)[:2] == [3, 0]


def test_stops_drafting_when_it_does_not_pay_and_probes_again():
    p = AdaptivePolicy(3)
    # Nothing accepted; drafting costs half a step per token, a 4-token verify 2.5 steps.
    chosen = _run(p, 200, 0.0, 0.5, lambda w: 1.0 + 0.5 * (w - 1))
    assert chosen[:2] == [3, 0]
    probes = [i for i, k in enumerate(chosen) if k == 3][1:]
    assert chosen.count(0) == 200 - 1 - len(probes)  # plain steps but for the probes ...
    gaps = [b - a - 1 for a, b in zip([1] + probes, probes)]
    # ... after PROBE idle rounds, then twice as many each time a probe finds nothing, up to MAX_PROBE.
    assert gaps[:5] == [PROBE - 1, 2 * PROBE, 4 * PROBE, MAX_PROBE, MAX_PROBE][: len(gaps[:5])]


def test_drafts_the_full_count_when_acceptance_is_high_and_verify_is_cheap():
    p = AdaptivePolicy(3)
    # Everything accepted; drafts nearly free, a window costs about one step (a bandwidth-bound GPU).
    chosen = _run(p, 20, 1.0, 0.01, lambda w: 1.0 + 0.05 * (w - 1))
    assert chosen[2:] == [3] * 18


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="draft policy"):
        make_policy("greedy", 3)
