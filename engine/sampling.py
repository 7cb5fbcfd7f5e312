"""Sampling: logits processors, filters, and a per-request seeded sampler.

The filters and processors follow mlx-lm's definitions, so the same settings
keep the same candidate tokens. Randomness comes from an explicit key per
request (`seed`), never from MLX's global random state, so concurrent
requests cannot disturb each other's streams.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

import mlx.core as mx

from engine.request import GeneratedToken, SamplingParams, TokenLogprob

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


# ----------------------------------------------------------------- filters


@mx.compile
def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


@mx.compile
def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    remove = logprobs < threshold
    if min_tokens_to_keep > 1:
        top = mx.argpartition(logprobs, kth=-min_tokens_to_keep, axis=-1)[..., -min_tokens_to_keep:]
        remove = mx.put_along_axis(remove, top, mx.array(False), axis=-1)
    return mx.where(remove, -float("inf"), logprobs)


@mx.compile
def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    ordered = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


# -------------------------------------------------------------- processors


def _logit_bias(bias: Mapping[int, float]) -> LogitsProcessor:
    ids = mx.array([int(k) for k in bias])
    values = mx.array(list(bias.values()))
    return lambda _tokens, logits: logits.at[:, ids].add(values)


def _repetition(penalty: float, context: int) -> LogitsProcessor:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            recent = tokens[-context:]
            selected = logits[:, recent]
            logits[:, recent] = mx.where(selected < 0, selected * penalty, selected / penalty)
        return logits

    return process


def _presence(penalty: float, context: int) -> LogitsProcessor:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            logits[:, tokens[-context:]] -= penalty
        return logits

    return process


def _frequency(penalty: float, context: int) -> LogitsProcessor:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            logits = logits.at[:, tokens[-context:]].subtract(penalty)
        return logits

    return process


def _min_tokens(count: int, end_ids: frozenset[int]) -> LogitsProcessor:
    """No token of `end_ids` for the first `count` tokens: called once per token the row samples."""
    banned = mx.array(sorted(end_ids))
    calls = 0

    def process(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        if calls > count:
            return logits
        return logits.at[:, banned].add(mx.array(-mx.inf, dtype=logits.dtype))

    return process


def make_processors(p: SamplingParams, constraint: bool = True) -> list[LogitsProcessor]:
    """The request's logits processors, its grammar's matcher last (`constraint`; the batch masks its rows'
    grammars together instead)."""
    processors = []
    if p.min_tokens and p.end_ids:
        processors.append(_min_tokens(p.min_tokens, p.end_ids))
    if p.logit_bias:
        processors.append(_logit_bias(p.logit_bias))
    if p.repetition_penalty:
        processors.append(_repetition(p.repetition_penalty, p.repetition_context_size))
    if p.presence_penalty:
        processors.append(_presence(p.presence_penalty, p.penalty_context_size))
    if p.frequency_penalty:
        processors.append(_frequency(p.frequency_penalty, p.penalty_context_size))
    if constraint and p.constraint is not None:  # last: the grammar's mask has the final word on what may come next
        processors.append(p.constraint.processor())
    return processors


# ----------------------------------------------------------------- sampler


class Sampler:
    """Chooses the next token from log-probabilities [B, V] with its own key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if 0 < params.top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p != 0.0:
            self._filters.append(lambda x: apply_min_p(x, params.min_p, params.min_tokens_to_keep))
        if params.top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, params.top_k))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    def filter(self, logprobs: mx.array) -> mx.array:
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.params.is_greedy:
            return mx.argmax(logprobs, axis=-1)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(self.filter(logprobs) * (1.0 / self.params.temperature), key=sub)


def emitted_token(token_id: int, logprobs: mx.array, params: SamplingParams) -> GeneratedToken:
    """The token as emitted: with its logprob and top alternatives when the request asked."""
    if not params.wants_logprobs:
        return GeneratedToken(token_id)
    top = None
    if params.top_logprobs:
        ids = mx.argpartition(-logprobs, kth=params.top_logprobs - 1)[: params.top_logprobs]
        pairs = sorted(zip(ids.tolist(), logprobs[ids].tolist()), key=lambda p: -p[1])
        top = tuple(TokenLogprob(i, v) for i, v in pairs)
    return GeneratedToken(token_id, logprobs[token_id].item(), top)
