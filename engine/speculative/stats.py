"""What speculation did for one request: rounds, drafts, acceptances, target forwards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """What speculation did for one request (the usage extension's `spec`).

    A round drafts up to `num_draft` tokens, verifies them in one target
    forward, and emits the accepted ones plus one token of the target's own
    (the correction, or the bonus when every draft was accepted).
    """

    kind: str
    num_draft: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0  # target forwards after the prompt: verifications plus replays
    rewinds: int = 0  # rounds that rejected a draft, so the target dropped what it had fed
    replays: int = 0  # forwards that rebuilt recurrent state after a rejection (the replay rollback)
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft position i was accepted
    drafted_at: list[int] = field(default_factory=list)  # rounds that drafted position i

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_draft
        self.drafted_at = self.drafted_at or [0] * self.num_draft

    def record_round(self, drafted: int, accepted: int, emitted: int, replayed: bool) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.target_calls += 1 + replayed
        self.rewinds += accepted < drafted
        self.replays += replayed
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def add(self, other: SpecStats) -> None:
        """Pool another request's counts into these (same kind and draft count)."""
        for name in ("rounds", "drafted", "accepted", "target_calls", "rewinds", "replays", "emitted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.drafted_at = [a + b for a, b in zip(self.drafted_at, other.drafted_at)]

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted / self.target_calls if self.target_calls else 0.0

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "num_draft": self.num_draft,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "acceptance": round(self.acceptance, 4),
            "target_calls": self.target_calls,
            "rewinds": self.rewinds,
            "replays": self.replays,
            "accepted_per_position": list(self.accepted_at),
            "drafted_per_position": list(self.drafted_at),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
        }
