"""How many tokens to draft each round.

    fixed     always the full count (mlx-lm's rule: min(remaining, num_draft))
    adaptive  the count that maximizes expected tokens per second, from what
              this request has measured so far

The adaptive policy models a round that drafts k tokens as

    tokens(k) = 1 + sum_{i=1..k} prod_{j<=i} p_j
    seconds(k) = k * draft_s + verify_s(k + 1)

where p_j is the chance the target accepts draft j given it accepted the
ones before it, counted per position over the request's recent rounds
(counts decay by DECAY per round, Beta(1, 1) prior), draft_s is the time to
draft one token and verify_s(w) the time of a w-token target forward, both
moving averages of the request's own rounds (a window size never measured is
interpolated linearly between measured ones). k = 0 is plain decoding. The
first two rounds measure the full window and a plain step; after `probe`
rounds in a row at k = 0 one round drafts the full count again, so a draft
that starts agreeing later is noticed. A probe after which drafting still
does not pay doubles the wait (PROBE up to MAX_PROBE rounds); one that makes
it pay resets it. Between probes a choice of 0 holds (`plain_rounds`), so the
verifier can run those rounds as pipelined plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

DECAY = 0.9  # per round: acceptance counts of ~10 rounds ago weigh a third
PROBE = 8  # rounds at k = 0 before drafting the full count once ...
MAX_PROBE = 64  # ... doubling while probes keep showing drafting does not pay
EMA = 0.3  # weight of the newest timing

POLICIES = ("fixed", "adaptive")


class DraftPolicy(Protocol):
    def choose(self, limit: int) -> int:
        """Tokens to draft this round, at most `limit`."""

    def record(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """What the round did and how long drafting and verifying took."""

    def plain_rounds(self) -> int:
        """After choosing 0: how many plain rounds in a row to run before choosing again."""


class FixedPolicy:
    def choose(self, limit: int) -> int:
        return limit

    def plain_rounds(self) -> int:
        return 1

    def record(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


@dataclass
class AdaptivePolicy:
    num_draft: int
    tried: list[float] = field(default_factory=list)  # per position: decayed rounds that reached it
    taken: list[float] = field(default_factory=list)  # ... and accepted it
    draft_s: float | None = None  # seconds per drafted token
    verify_s: dict[int, float] = field(default_factory=dict)  # window size -> seconds
    rounds: int = 0
    idle: int = 0  # rounds in a row at k = 0
    probe: int = PROBE  # idle rounds before the next probe
    probing: bool = False  # the last choice was a probe

    def __post_init__(self):
        self.tried = self.tried or [0.0] * self.num_draft
        self.taken = self.taken or [0.0] * self.num_draft

    def acceptance(self, i: int) -> float:
        """Estimated chance draft i + 1 is accepted given drafts 1..i were."""
        return (self.taken[i] + 1.0) / (self.tried[i] + 2.0)

    def expected_tokens(self, k: int) -> float:
        total, chain = 1.0, 1.0
        for i in range(k):
            chain *= self.acceptance(i)
            total += chain
        return total

    def seconds(self, k: int) -> float:
        return k * (self.draft_s or 0.0) + interpolate(self.verify_s, k + 1)

    def choose(self, limit: int) -> int:
        if limit <= 0:
            return 0
        if self.rounds == 0:
            return limit  # measure the full window first
        if 1 not in self.verify_s:
            return 0  # then a plain step
        if self.idle >= self.probe:
            self.probing = True
            return limit
        best = max(range(limit + 1), key=lambda k: self.expected_tokens(k) / self.seconds(k))
        if self.probing:  # the first choice after a probe says whether it found drafting worth it
            self.probe = PROBE if best else min(2 * self.probe, MAX_PROBE)
            self.probing = False
        return best

    def plain_rounds(self) -> int:
        # Between probes nothing about acceptance is learned, so a choice of plain decoding holds until
        # the next probe (the second round, which measures a plain step, is one round).
        return 1 if self.rounds < 2 else max(self.probe - self.idle, 1)

    def record(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        self.idle = self.idle + 1 if drafted == 0 else 0
        self.record_acceptance(drafted, accepted)
        ema(self.verify_s, drafted + 1, verify_s)
        if drafted:
            per = draft_s / drafted
            self.draft_s = per if self.draft_s is None else (1 - EMA) * self.draft_s + EMA * per

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        """Only the acceptance counts: `drafted` drafts of which the first `accepted` matched the target."""
        self.tried = [t * DECAY for t in self.tried]
        self.taken = [t * DECAY for t in self.taken]
        for i in range(min(accepted + 1, drafted)):
            self.tried[i] += 1.0
            self.taken[i] += i < accepted


def ema(table: dict[int, float], key: int, seconds: float) -> None:
    """Fold a new timing into `table[key]` (a moving average with weight EMA on the newest)."""
    old = table.get(key)
    table[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds


def interpolate(table: dict[int, float], key: int) -> float:
    """`table[key]` if measured, else linear between the nearest measured keys, else the nearest one's."""
    if key in table:
        return table[key]
    below = max((w for w in table if w < key), default=None)
    above = min((w for w in table if w > key), default=None)
    if below is None or above is None:
        return table[below if above is None else above]
    return table[below] + (table[above] - table[below]) * (key - below) / (above - below)


def make_policy(name: str, num_draft: int) -> DraftPolicy:
    if name == "fixed":
        return FixedPolicy()
    if name == "adaptive":
        return AdaptivePolicy(num_draft)
    raise ValueError(f"draft policy must be one of {', '.join(POLICIES)}, got {name!r}")
