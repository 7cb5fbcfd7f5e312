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

Where even the smallest prefill measured beside decoding rows took longer than the allowance, no piece keeps the
bound, and what to do turns on what a piece costs. Where a piece costs about its tokens (a CPU), pieces still
bound the stalls, as above. Where a forward's fixed cost dominates it (on the H200 a qwen27b prompt chunk of 96
tokens takes ~100 ms against a 10-33 ms decode step), every piece pays it again: the rows would stall about as
long each time as for a whole chunk while the prompt prefilled at a small fraction of its rate. Then there is
no cap: whole chunks, the fixed cost paid once. Which of the two: the smallest piece costs more than `DOMINATED`
times its tokens at the lowest rate a prefill of at least `SPAN` times its size has shown (a pure fixed cost
shows as SPAN times; a CPU's pieces, a decode step's fixed cost and their tokens, about 1-1.3); until one has,
the next prefill takes `SPAN` times the smallest piece, to show it (on a CPU that one piece stalls the rows
twice as long; where a fixed cost dominates, about as long). The smallest piece's cost follows new measurements
of it (at once where lower), a larger prefill that cost less lowers it, and after every `PROBE` prefills
without one a prefill takes the smallest piece again, measuring it anew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE = 16  # prefills beside decoding rows, with no cap, before a capped one measures the smallest again
SPAN = 2  # a prefill this many times the smallest piece shows what a token costs without its fixed cost
DOMINATED = 1.5  # the smallest piece's cost over its tokens' at that rate, past which whole chunks go


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
    least: tuple[int, float] | None = None  # the fewest prompt tokens prefilled beside decoding rows, their seconds
    since_least: int = 0  # prefills beside decoding rows since one of `least`'s tokens or fewer
    token_low: float | None = None  # the lowest cost a token of a prefill of at least SPAN x least's tokens

    def observe(self, rows: int, gap_s: float, tokens: int) -> None:
        """The gap between two readbacks of `rows` decoding rows, with `tokens` prompt tokens prefilled in it."""
        d = self._step(rows)
        if tokens == 0:
            self.step_s[rows] = self._blend(self.step_s.get(rows), gap_s)
            return
        if d is None:
            return
        extra = max(gap_s - d, 0.0)
        self.token_s = self._blend(self.token_s, extra / tokens)
        if self.least is None or tokens < self.least[0]:
            self.least, self.since_least = (tokens, extra), 0
        elif tokens == self.least[0]:  # down at once (a kernel compiled in the first one), up as a blend
            self.least, self.since_least = (tokens, min(extra, self._blend(self.least[1], extra))), 0
        else:  # a larger prefill costs at least as much as a smaller one
            self.least, self.since_least = (self.least[0], min(self.least[1], extra)), self.since_least + 1
        if tokens >= SPAN * self.least[0]:
            self.token_low = min(extra / tokens, self.token_low if self.token_low is not None else math.inf)

    def cap(self, rows: int, waiting: int = 1, first_tokens: bool = False) -> int | None:
        """Prompt tokens the next prefill may take beside `rows` decoding rows, with `waiting` prompts waiting for
        their first token (0: none, to measure a step, or where the gap has no room left; None: no cap, no piece
        can keep the bound). `first_tokens`: joiners take token 0 in the same gap, a forward that takes one
        decode step of the allowance."""
        d = self._step(rows)
        if d is None:
            return 0
        allowance = (self.config.ratio - 1) * d * max(1.0, waiting / rows)
        if self.least is not None and self.least[1] > allowance:  # no piece keeps the bound
            tokens, seconds = self.least
            if self.token_low is None:  # how a piece's cost grows with its tokens: a larger one shows it
                return SPAN * tokens
            if seconds > DOMINATED * tokens * self.token_low:  # fixed costs dominate: whole chunks, and now and then
                return None if self.since_least < PROBE else 1  # the smallest piece, measured anew
        room = allowance - (d if first_tokens else 0.0)
        if room <= 0:
            return 0
        if self.token_s is None:
            return 1
        # rounded up: a cost per token measured at T tokens overstates it at T + 1 (fixed costs), so truncating
        # could hold the cap at T below the bound; rounding up passes it by a token's cost at most
        return max(1, math.ceil(room / max(self.token_s, 1e-9) - 1e-6))

    def as_record(self) -> dict:
        """The setting and the running estimates, in milliseconds (for /stats)."""
        return {
            "ratio": self.config.ratio,
            "decode_step_ms": {rows: round(d * 1e3, 3) for rows, d in sorted(self.step_s.items())},
            "prompt_token_ms": None if self.token_s is None else round(self.token_s * 1e3, 4),
            "smallest_prefill": None
            if self.least is None
            else {"tokens": self.least[0], "ms": round(self.least[1] * 1e3, 3)},
            "larger_prefill_token_ms": None if self.token_low is None else round(self.token_low * 1e3, 4),
        }

    def forget(self) -> None:
        """Drop every estimate (the warm-up's gaps hold kernel compilations, not steps)."""
        self.step_s.clear()
        self.token_s, self.least, self.since_least, self.token_low = None, None, 0, None

    def _step(self, rows: int) -> float | None:
        """d for `rows` decoding rows, or for the most rows below it measured, or else the fewest above it (rows
        leaving one an iteration leave no count measured below; None: nothing measured)."""
        if not self.step_s:
            return None
        below = [n for n in self.step_s if n <= rows]
        return self.step_s[max(below) if below else min(self.step_s)]

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.config.alpha * (new - old)
