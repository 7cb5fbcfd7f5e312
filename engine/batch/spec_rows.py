"""Spec rows: requests that decode speculatively inside the continuous batch.

They are a row group of their own, beside the runner's plain rows: their own
batched caches and their own forward each step, so the plain rows' decode
step (its L=1 graph, ghosts and pipelining) is exactly what it is without
them. Each step every spec row drafts up to `num_draft` tokens with its own
source (prompt lookup), and one target forward over [B, W] (W = 1 + the
longest draft, shorter rows right-padded) verifies them all: the padding sits
after every real token, so causality alone hides it. Each row accepts its
drafts while they match the token the target samples at their position, as
the serial verifier does (speculative/verifier.py), and emits them plus the
target's own token. The caches then drop each row's rejected tail:
`BatchKVCache.trim_rows` for attention layers, `RecurrentCache.keep_traced_rows`
(the state the traced forward recorded after the row's last kept token) for
DeltaNet layers.

How many drafts each row feeds (`policy`): "fixed" feeds every draft the
source proposes (up to `num_draft`); "adaptive" picks the window width W that
maximises the group's expected emitted tokens per second,

    sum_b tokens_b(min(n_b, W - 1)) / seconds(B * W)

where n_b is what row b's source proposed, tokens_b its expected tokens for k
drafts (speculative/policy.py's acceptance estimate, per row) and seconds the
group's measured step time by the forward's token count B * W (moving
averages, linear between measured counts). W = 1 is plain decoding: every row
feeds only its pending token. A row's acceptance is learned from its real
rounds and, while it feeds no drafts, from the drafts its source would have
proposed checked against the tokens the target then emits (ngram proposals
cost nothing on the host), so a group that stopped drafting still sees when
drafting would pay again without a probe window. The first step at a new row
count runs plain (it measures W = 1); a width never measured is priced at the
nearest measured count's, so it is tried once. While no row would draft even
with every draft proposed (at the widths measured), plain windows are
pipelined: the next is launched on the current one's tokens before they are
read (`_launch_ahead`), so a group that does not draft decodes as plain rows
do; while a width not yet measured looks worth trying, the stretch pauses
every `wait` windows for the rows' proposals.

A draft model (a source with `batched()`, speculative/draft_model.py) drafts
for the whole group at once: its caches hold every row, each step runs
1 + max n_b [B, 1] greedy steps (a row that feeds fewer drafts ignores the
rest) and each row's draft cache is rolled back to what the target kept. Its
drafts cost a forward each, so the adaptive width is chosen before drafting,
from the proposals every row could make, and nothing is drafted for rows that
feed none. Plain windows leave the draft alone (it catches up when drafting
resumes), so they pipeline as the n-gram group's do; with no free proposals
to check, a group that stopped drafting drafts the full count once after
`wait` plain windows, as the serial policy probes (PROBE, doubling up to
MAX_PROBE while probes keep showing drafting does not pay).

The MTP head (`--draft-kind mtp`, speculative/mtp.py's BatchMTP) is such a
batched draft too: its KV cache holds every row, a row starts from its
prompt's pairs (the target's hidden states the batched prefill kept for it,
engine/batch/runner.py), each window's hidden states at the positions a row
kept go in as that row's exact pairs (plain windows included, so the head
never falls behind), and its [B, 1] draft steps are trimmed after the round.

A row's caches hold its prompt and every token it fed that was kept, so a
finished row is stored in the prompt cache with exactly those tokens (`held`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.cache import BatchKVCache, RecurrentCache, cache_arrays, kept_rows, own, with_rows
from engine.request import GeneratedToken, SamplingParams, SpecStats
from engine.sampling import Sampler, emitted_token
from engine.speculative.policy import MAX_PROBE, PROBE, AdaptivePolicy, ema, interpolate
from engine.speculative.source import DraftSource, Round


@dataclass
class SpecRow:
    request_id: str
    params: SamplingParams
    sampler: Sampler
    source: DraftSource | None  # None: the group's batched draft drafts for it
    stats: SpecStats
    prompt: tuple[int, ...]
    max_tokens: int
    pending: int  # the last emitted token, not yet through the model
    produced: int = 1  # tokens emitted so far (token 0 at the join)
    fed: list[int] = field(default_factory=list)  # tokens after the prompt that the caches hold
    estimate: AdaptivePolicy | None = None  # acceptance estimate (adaptive policy)
    shadow: list[int] = field(default_factory=list)  # drafts proposed but not fed, checked against what follows
    shadow_matched: int = 0
    in_flight: bool = False  # a launched plain window feeds `pending` (already counted in `fed`)

    def check_shadow(self, emitted: Sequence[int]) -> None:
        """Compare unfed drafts with the tokens the target emitted after them; record them once decided."""
        for token in emitted:
            if not self.shadow:
                return
            if token == self.shadow[self.shadow_matched]:
                self.shadow_matched += 1
                if self.shadow_matched < len(self.shadow):
                    continue
            self.estimate.record_acceptance(len(self.shadow), self.shadow_matched)
            self.shadow, self.shadow_matched = [], 0


@dataclass
class _Ahead:
    """A plain window launched before the previous window's tokens were read."""

    sampled: mx.array  # [B, 1]
    logprobs: mx.array  # [B, 1, V]
    hidden: mx.array
    ids: list[str]  # the rows it was launched for, in row order


class SpecRows:
    """The spec rows of a continuous batch; `step` runs one verify forward for all of them."""

    def __init__(self, model: nn.Module, make_source, kind: str, num_draft: int, policy: str = "fixed"):
        if policy not in ("fixed", "adaptive"):
            raise ValueError(f"draft policy must be fixed or adaptive, got {policy!r}")
        self.model = model
        self.make_source = make_source  # a fresh draft source per row
        self.kind = kind
        self.num_draft = num_draft
        self.adaptive = policy == "adaptive"
        self.seconds: dict[int, float] = {}  # a step's seconds by its forward's token count (rows * width)
        self.rows: list[SpecRow] = []
        self.cache: list | None = None
        self.ahead: _Ahead | None = None
        self.read_at = 0.0  # when the last window's tokens were read
        batched = getattr(make_source(), "batched", None)
        self.draft = batched() if batched is not None else None  # a draft model drafting for every row at once
        self.idle = 0  # pipelined plain windows in a row (after `wait` of them a group may pause: `_launch_ahead`)
        self.wait = PROBE
        self.probing = False  # the last window was a probe

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def join(
        self,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        cache: list,
        first: Sequence[int],
        hidden: Sequence[mx.array | None] = (),
    ) -> None:
        """Rows whose caches hold their whole prompt and whose token 0 (`first`, emitted already) is pending.
        `hidden`: the target's final hidden states over each prompt where they were kept (the MTP head's pairs of
        the prompt; a row without starts the head at its first window)."""
        for rid, p, prompt, most, token in zip(request_ids, params, prompts, max_tokens, first):
            source = None
            if self.draft is None:
                source = self.make_source()
                source.begin(prompt)
                source.commit(Round((prompt[-1],), 0, token, None))  # token 0, as a round without drafts
            stats = SpecStats(self.kind, self.num_draft)
            estimate = AdaptivePolicy(self.num_draft) if self.adaptive else None
            self.rows.append(SpecRow(rid, p, Sampler(p), source, stats, tuple(prompt), most, token, estimate=estimate))
        if getattr(self.draft, "sees_hidden", False):
            self.draft.join(prompts, first, hidden)
        elif self.draft is not None:
            self.draft.join(prompts)
        self.cache = with_rows(self.cache, cache)

    def step(self) -> dict[str, tuple[GeneratedToken, ...]]:
        """One verify forward: each row's accepted drafts and the target's own token, by request id (row order)."""
        if self.ahead is not None:
            return self._take_ahead()
        started = time.perf_counter()
        if self.draft is not None:
            proposed = self._drafted()
            drafting = time.perf_counter() - started
            for r in self.rows:
                r.stats.draft_seconds += drafting
            width = 1 + max(len(d) for d in proposed)
            self.idle = self.idle + 1 if width == 1 else 0
        else:
            proposed = [r.source.propose(r.pending, self._limit(r)) for r in self.rows]
            width = self.width(proposed) if self.adaptive else 1 + max(len(d) for d in proposed)
            if self.idle >= self.wait:  # the pause a pipelined stretch made for proposals (`_launch_ahead`)
                self.wait = PROBE if width > 1 else min(2 * self.wait, MAX_PROBE)
            self.idle = 0
        drafts = [d[: width - 1] for d in proposed]
        fed = [(r.pending, *d) for r, d in zip(self.rows, drafts)]
        width = max(len(f) for f in fed)
        traced = width > 1  # a plain window (no row drafts) keeps everything: nothing to trace or trim
        for c in self.cache:
            if traced and isinstance(c, RecurrentCache):
                c.start_trace()
        window_start = time.perf_counter()
        x = mx.array([list(f) + [0] * (width - len(f)) for f in fed])
        sampled, logprobs, hidden = self._forward(x, [len(f) for f in fed])
        launched = not traced and self._launch_ahead(sampled)
        tokens = sampled.tolist()
        self.read_at = time.perf_counter()
        out, kept = self._emit(self.rows, fed, proposed, tokens, logprobs, hidden, launched)
        if self.draft is not None:
            committing = time.perf_counter()
            self._commit_draft(self.rows, fed, [k - 1 for k in kept], hidden)
            committed = time.perf_counter() - committing
            for r in self.rows:
                r.stats.draft_seconds += committed
        if traced:
            rollback = time.perf_counter()
            for c in self.cache:
                if isinstance(c, RecurrentCache):
                    c.keep_traced_rows(kept)
                elif isinstance(c, BatchKVCache):
                    c.trim_rows([width - k for k in kept])
            mx.eval(cache_arrays(self.cache))
            window = self.read_at - window_start + time.perf_counter() - rollback  # forward to tokens, rollback
            for r in self.rows:
                r.stats.windows += 1
                r.stats.window_seconds += window
        if not launched:  # a launching step's time holds part of the launched window's
            ema(self.seconds, len(self.rows) * width, time.perf_counter() - started)
        return out

    def _drafted(self) -> list[list[int]]:
        """The batched draft's proposals, as many per row as the policy feeds (drafted before the window is
        fed, so the adaptive width is chosen from what every row could propose)."""
        limits = [self._limit(r) for r in self.rows]
        if self.adaptive:
            width = self.width([[0] * n for n in limits])
            if self.probing:  # the first choice after a probe says whether it found drafting worth it
                self.wait = PROBE if width > 1 else min(2 * self.wait, MAX_PROBE)
            self.probing = width == 1 and self.idle >= self.wait
            if self.probing:  # drafting has not paid for a while: see whether it does again
                width = 1 + max(limits)
            limits = [min(n, width - 1) for n in limits]
        return self.draft.propose([r.pending for r in self.rows], limits)

    def _commit_draft(self, rows, fed, accepted: Sequence[int], hidden: mx.array) -> None:
        """The group's draft learns what each row kept; the MTP head also takes the window's hidden states and
        each row's next token (its exact pairs)."""
        if getattr(self.draft, "sees_hidden", False):
            self.draft.commit(fed, accepted, hidden, [r.pending for r in rows])
        else:
            self.draft.commit(fed, accepted)

    def _limit(self, row: SpecRow) -> int:
        """The most drafts a row may feed: num_draft, and no more than it has tokens left to emit."""
        return max(min(row.max_tokens - row.produced, self.num_draft), 0)

    def _forward(self, x: mx.array, lengths: Sequence[int]) -> tuple[mx.array, mx.array, mx.array]:
        """The target over the right-padded windows x [B, W] (row b's first lengths[b] real), lazily: each
        position's sampled token [B, W], logprobs [B, W, V] and the final hidden state."""
        hidden = self.model.hidden(x, self.cache)
        logits = self.model.logits(hidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.params.is_greedy for r in self.rows):
            return mx.argmax(logprobs, axis=-1), logprobs, hidden
        width = x.shape[1]
        sampled = mx.stack(
            [mx.pad(r.sampler(logprobs[b, :n]), (0, width - n)) for b, (r, n) in enumerate(zip(self.rows, lengths))]
        )
        return sampled, logprobs, hidden

    def _launch_ahead(self, sampled: mx.array) -> bool:
        """After a plain window: when no row would draft even with every draft proposed, at the widths whose
        cost has been measured, launch the next plain window on this one's tokens before they are read (as plain
        rows pipeline their steps). A width not yet measured would be tried (`width`) but can only be with a
        proposal, so while one looks worth trying the stretch pauses every `wait` windows for the rows'
        proposals (doubling up to MAX_PROBE while none comes), as a draft-model group pauses to probe."""
        rows = len(self.rows)
        if not self.adaptive or rows not in self.seconds:
            return False
        full = [[0] * self.num_draft] * rows
        if self.width(full, measured=True) != 1:
            return False
        if self.idle >= self.wait and (self.draft is not None or self.width(full) != 1):
            return False  # a draft-model group's probe, or a pause for proposals, is due: the next window may draft
        nxt = self._forward(sampled[:, :1], [1] * rows)
        mx.async_eval(nxt[0], nxt[1])
        self.ahead = _Ahead(*nxt, [r.request_id for r in self.rows])
        return True

    def _take_ahead(self) -> dict[str, tuple[GeneratedToken, ...]]:
        """The launched plain window's tokens; rows that joined since it was launched emit nothing this step."""
        a, self.ahead = self.ahead, None
        rows = self.rows[: len(a.ids)]  # joiners come after the rows it was launched for
        self.idle += 1
        launched = len(rows) == len(self.rows) and self._launch_ahead(a.sampled)
        fed = [(r.pending,) for r in rows]
        # what each row's source would have drafted for this window, for its shadow check (a draft model: none)
        proposed = [r.source.propose(r.pending, self._limit(r)) if r.source else [] for r in rows]
        tokens = a.sampled.tolist()
        now = time.perf_counter()
        if launched:  # one pipelined plain window costs the time between two windows' reads
            ema(self.seconds, len(rows), now - self.read_at)
        self.read_at = now
        out, _ = self._emit(rows, fed, proposed, tokens, a.logprobs, a.hidden, launched)
        if self.draft is not None:
            self._commit_draft(rows, fed, [0] * len(fed), a.hidden)
        return out | {r.request_id: () for r in self.rows[len(rows) :]}

    def _emit(self, rows, fed, proposed, tokens, logprobs, hidden, launched: bool):
        """Each row's accepted drafts and the target's token, the rows' bookkeeping, and how many tokens of its
        window each row keeps. `launched`: the next plain window, feeding each row's new pending token, is on
        its way (so the caches will hold it)."""
        out: dict[str, tuple[GeneratedToken, ...]] = {}
        kept = []
        for b, (row, f) in enumerate(zip(rows, fed)):
            d, t = f[1:], tokens[b]
            accepted = 0
            while accepted < len(d) and t[accepted] == d[accepted]:
                accepted += 1
            kept.append(accepted + 1)
            out[row.request_id] = tuple(emitted_token(t[j], logprobs[b, j], row.params) for j in range(accepted + 1))
            if row.source is not None:
                row.source.commit(Round(f, accepted, t[accepted], hidden[b : b + 1, : len(f)]))
            # the tokens the request keeps: a window that may end the request (as many drafts as tokens left, as
            # mlx-lm feeds them) emits one past its last when every draft is accepted
            row.stats.record_round(len(d), accepted, min(accepted + 1, row.max_tokens - row.produced), False)
            if not row.in_flight:  # an in-flight window's token was counted when it was launched
                row.fed += f[: accepted + 1]
            if row.estimate is not None:
                if d:
                    row.estimate.record_acceptance(len(d), accepted)
                if not d and not row.shadow:
                    row.shadow = list(proposed[b])  # checked against this round's token and the next rounds'
                row.check_shadow(t[: accepted + 1])
            row.produced += accepted + 1
            row.pending = t[accepted]
            row.in_flight = launched
            if launched:
                row.fed.append(row.pending)
        return out, kept

    def width(self, proposed: Sequence[Sequence[int]], measured: bool = False) -> int:
        """The window width (1 + drafts fed by the longest row) with the most expected tokens per second;
        `measured`: among the widths whose forward has been timed at this row count only (one never timed is
        priced as the nearest timed one, so that it is tried once)."""
        rows = len(self.rows)
        if rows not in self.seconds:
            return 1  # measure a plain step at this row count first

        def rate(w: int) -> float:
            tokens = sum(r.estimate.expected_tokens(min(len(d), w - 1)) for r, d in zip(self.rows, proposed))
            return tokens / interpolate(self.seconds, rows * w)

        widths = range(1, 2 + max(len(d) for d in proposed))
        return max((w for w in widths if not measured or rows * w in self.seconds), key=rate)

    def held(self, request_id: str) -> tuple[int, ...]:
        """The tokens this row's caches hold: its prompt, then what it fed and kept."""
        row = next(r for r in self.rows if r.request_id == request_id)
        return row.prompt + tuple(row.fed)

    def stats(self, request_id: str) -> SpecStats | None:
        return next((r.stats for r in self.rows if r.request_id == request_id), None)

    def leave(self, request_ids: Collection[str]) -> None:
        keep = [i for i, r in enumerate(self.rows) if r.request_id not in request_ids]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        a = self.ahead
        if a is not None:
            index = [i for i in keep if i < len(a.ids)]
            ids = [r.request_id for r in self.rows[: len(index)]]
            rows = mx.array(index)
            self.ahead = _Ahead(a.sampled[rows], a.logprobs[rows], a.hidden[rows], ids) if index else None
        if self.draft is not None:
            self.draft.filter(keep)
        self.cache = kept_rows(self.cache, keep)  # None when the last row left: the next joiners start a fresh group

    def extract(self, request_ids: Collection[str]) -> dict[str, list]:
        index = {r.request_id: i for i, r in enumerate(self.rows)}
        out = {rid: [c.extract(index[rid]) for c in self.cache] for rid in request_ids}
        own(out.values())
        return out

    def reset(self) -> None:
        self.rows, self.cache, self.ahead = [], None, None
        if self.draft is not None:
            self.draft.reset()
