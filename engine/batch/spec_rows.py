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
nearest measured count's, so it is tried once.

A row's caches hold its prompt and every token it fed that was kept, so a
finished row is stored in the prompt cache with exactly those tokens (`held`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.cache import BatchKVCache, RecurrentCache, cache_arrays, own
from engine.request import GeneratedToken, SamplingParams, SpecStats
from engine.sampling import Sampler, emitted_token
from engine.speculative.policy import AdaptivePolicy, ema, interpolate
from engine.speculative.source import DraftSource, Round


@dataclass
class SpecRow:
    request_id: str
    params: SamplingParams
    sampler: Sampler
    source: DraftSource
    stats: SpecStats
    prompt: tuple[int, ...]
    max_tokens: int
    pending: int  # the last emitted token, not yet through the model
    produced: int = 1  # tokens emitted so far (token 0 at the join)
    fed: list[int] = field(default_factory=list)  # tokens after the prompt that the caches hold
    estimate: AdaptivePolicy | None = None  # acceptance estimate (adaptive policy)
    shadow: list[int] = field(default_factory=list)  # drafts proposed but not fed, checked against what follows
    shadow_matched: int = 0

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
    ) -> None:
        """Rows whose caches hold their whole prompt and whose token 0 (`first`, emitted already) is pending."""
        for rid, p, prompt, most, token in zip(request_ids, params, prompts, max_tokens, first):
            source = self.make_source()
            source.begin(prompt)
            source.commit(Round((prompt[-1],), 0, token, None))  # token 0, as a round without drafts
            stats = SpecStats(self.kind, self.num_draft)
            estimate = AdaptivePolicy(self.num_draft) if self.adaptive else None
            self.rows.append(SpecRow(rid, p, Sampler(p), source, stats, tuple(prompt), most, token, estimate=estimate))
        if self.cache is None:
            self.cache = cache
        else:
            for running, joiner in zip(self.cache, cache):
                running.extend(joiner)

    def step(self) -> dict[str, tuple[GeneratedToken, ...]]:
        """One verify forward: each row's accepted drafts and the target's own token, by request id (row order)."""
        started = time.perf_counter()
        proposed = [
            r.source.propose(r.pending, max(min(r.max_tokens - r.produced, self.num_draft), 0)) for r in self.rows
        ]
        width = self.width(proposed) if self.adaptive else 1 + max(len(d) for d in proposed)
        drafts = [d[: width - 1] for d in proposed]
        fed = [(r.pending, *d) for r, d in zip(self.rows, drafts)]
        width = max(len(f) for f in fed)
        traced = width > 1  # a plain window (no row drafts) keeps everything: nothing to trace or trim
        for c in self.cache:
            if traced and isinstance(c, RecurrentCache):
                c.start_trace()
        hidden = self.model.hidden(mx.array([list(f) + [0] * (width - len(f)) for f in fed]), self.cache)
        logits = self.model.logits(hidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.params.is_greedy for r in self.rows):
            sampled = mx.argmax(logprobs, axis=-1)
        else:
            sampled = mx.stack(
                [
                    mx.pad(r.sampler(logprobs[b, : len(f)]), (0, width - len(f)))
                    for b, (r, f) in enumerate(zip(self.rows, fed))
                ]
            )
        tokens = sampled.tolist()
        out: dict[str, tuple[GeneratedToken, ...]] = {}
        kept = []
        for b, (row, f) in enumerate(zip(self.rows, fed)):
            d, t = f[1:], tokens[b]
            accepted = 0
            while accepted < len(d) and t[accepted] == d[accepted]:
                accepted += 1
            kept.append(accepted + 1)
            out[row.request_id] = tuple(emitted_token(t[j], logprobs[b, j], row.params) for j in range(accepted + 1))
            row.source.commit(Round(f, accepted, t[accepted], hidden[b : b + 1, : len(f)]))
            row.stats.record_round(len(d), accepted, accepted + 1, False)
            row.fed += f[: accepted + 1]
            if row.estimate is not None:
                if d:
                    row.estimate.record_acceptance(len(d), accepted)
                if not d and not row.shadow:
                    row.shadow = list(proposed[b])  # checked against this round's token and the next rounds'
                row.check_shadow(t[: accepted + 1])
            row.produced += accepted + 1
            row.pending = t[accepted]
        for c in self.cache:
            if traced and isinstance(c, RecurrentCache):
                c.keep_traced_rows(kept)
            elif traced and isinstance(c, BatchKVCache):
                c.trim_rows([width - k for k in kept])
        mx.eval(cache_arrays(self.cache))
        ema(self.seconds, len(self.rows) * width, time.perf_counter() - started)
        return out

    def width(self, proposed: Sequence[Sequence[int]]) -> int:
        """The window width (1 + drafts fed by the longest row) with the most expected tokens per second."""
        rows = len(self.rows)
        if rows not in self.seconds:
            return 1  # measure a plain step at this row count first

        def rate(w: int) -> float:
            tokens = sum(r.estimate.expected_tokens(min(len(d), w - 1)) for r, d in zip(self.rows, proposed))
            return tokens / interpolate(self.seconds, rows * w)

        return max(range(1, 2 + max(len(d) for d in proposed)), key=rate)

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
        if not self.rows:
            self.cache = None  # the last row left: the next joiners start a fresh group
            return
        for c in self.cache:
            c.filter(keep)

    def extract(self, request_ids: Collection[str]) -> dict[str, list]:
        index = {r.request_id: i for i, r in enumerate(self.rows)}
        out = {rid: [c.extract(index[rid]) for c in self.cache] for rid in request_ids}
        own(out.values())
        return out

    def reset(self) -> None:
        self.rows, self.cache = [], None
