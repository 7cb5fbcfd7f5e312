"""Prefill pacing: while rows decode, a step's prefill is held to what their inter-token latency allows.

An iteration reads the decoding rows' tokens back, then runs the joiners' prefill forward, so the gap
between two of a row's tokens is a decode step plus whatever prefilled between the two readbacks. The
rule: with rows decoding, a prefill between two readbacks takes at most `ratio - 1` decode steps for each
prompt waiting for its first token per decoding row (one at least). While no more prompts wait than rows
decode, the gap between a row's tokens is then at most `ratio` decode steps; a burst of prompts beside a
few decoding rows is not held to their pace (a row's stall weighs against each waiting prompt's TTFT,
one for one). The pacer measures both from the gaps themselves (wall time between readbacks, what a
client sees as inter-token latency):

- `d`, a decode step alone, for each count of decoding rows: gaps with nothing prefilled between them;
- `c`, prefill seconds a prompt token: (a gap with a prefill - d) / the tokens prefilled in it;

and caps the next prefill at `(ratio - 1) * d / c` prompt tokens (times the waiting prompts per row). A cost
per token measured at a smaller prefill overstates it at a larger one (a forward's fixed costs spread over
more tokens), so the cap grows toward the limit from below, a prefill at a time, and shrinks at once where a
prefill costs more (a later chunk of a long prompt attends to more keys). Joiners taking token 0 in the same
gap run a forward of their own, counted as one decode step of the allowance. For a count of rows with no `d`
yet, the `d` of the most rows below it stands in (a smaller step: a smaller cap), or else of the fewest above
it; with none measured at all, the next iteration prefills nothing, so that its gap measures one. Until `c`
is measured the cap is one token (the scheduler gives each joiner at least the smallest chunk bucket). With
nothing decoding there is no cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PacingConfig:
    ratio: float  # the gap between a decoding row's tokens, with a prefill in it: at most this many decode steps
    alpha: float = 0.5  # weight of the newest gap in each running estimate

    def __post_init__(self):
        if not self.ratio > 1:
            raise ValueError(f"the inter-token latency ratio must be > 1, got {self.ratio}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")


@dataclass
class PrefillPacer:
    """The running estimates and the cap they give (module docstring)."""

    config: PacingConfig
    step_s: dict[int, float] = field(default_factory=dict)  # d: a decode step alone, by decoding rows
    token_s: float | None = None  # c: prefill seconds a prompt token

    def observe(self, rows: int, gap_s: float, tokens: int) -> None:
        """The gap between two readbacks of `rows` decoding rows, with `tokens` prompt tokens prefilled in it."""
        d = self._step(rows)
        if tokens == 0:
            self.step_s[rows] = self._blend(self.step_s.get(rows), gap_s)
        elif d is not None:
            self.token_s = self._blend(self.token_s, max(gap_s - d, 0.0) / tokens)

    def cap(self, rows: int, waiting: int = 1, first_tokens: bool = False) -> int:
        """Prompt tokens the next prefill may take beside `rows` decoding rows, with `waiting` prompts waiting for
        their first token (0: none, to measure a step, or where the gap has no room left). `first_tokens`:
        joiners take token 0 in the same gap, a forward that takes one decode step of the allowance."""
        d = self._step(rows)
        if d is None:
            return 0
        allowance = (self.config.ratio - 1) * d * max(1.0, waiting / rows) - (d if first_tokens else 0.0)
        if allowance <= 0:
            return 0
        if self.token_s is None:
            return 1
        # rounded up: a cost per token measured at T tokens overstates it at T + 1 (fixed costs), so truncating
        # could hold the cap at T below the bound; rounding up passes it by a token's cost at most
        return max(1, math.ceil(allowance / max(self.token_s, 1e-9) - 1e-6))

    def as_record(self) -> dict:
        """The setting and the running estimates, in milliseconds (for /stats)."""
        return {
            "ratio": self.config.ratio,
            "decode_step_ms": {rows: round(d * 1e3, 3) for rows, d in sorted(self.step_s.items())},
            "prompt_token_ms": None if self.token_s is None else round(self.token_s * 1e3, 4),
        }

    def forget(self) -> None:
        """Drop every estimate (the warm-up's gaps hold kernel compilations, not steps)."""
        self.step_s.clear()
        self.token_s = None

    def _step(self, rows: int) -> float | None:
        """d for `rows` decoding rows, or for the most rows below it measured, or else the fewest above it (rows
        leaving one an iteration leave no count measured below; None: nothing measured)."""
        if not self.step_s:
            return None
        below = [n for n in self.step_s if n <= rows]
        return self.step_s[max(below) if below else min(self.step_s)]

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.config.alpha * (new - old)
