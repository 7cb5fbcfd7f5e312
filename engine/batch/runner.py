"""The batch runner: the only place in the batching path that builds arrays.

It holds the running batch (per-layer batched caches, the register of next
input tokens, one sampler and processor set per row) and the joiner (a
one-row batch being prefilled). Each operation mirrors the matching step of
mlx-lm's PromptProcessingBatch / GenerationBatch, which is what makes the
same-B oracle comparison bit-exact:

- joiner caches start as one-row batches merged from empty caches, are
  prefilled in chunks, and produce token 0 from an L=1 forward of the last
  prompt token;
- a join extends each running cache by the joiner's (left-padding the
  shorter side); a filter keeps rows and trims shared padding;
- a decode step forwards the whole register, launches sampling of the next
  register, and only then reads the current one back (pipelined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.cache import (
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    KVCache,
    RecurrentCache,
    RotatingKVCache,
    cache_arrays,
)
from engine.generate import KVQuantization
from engine.sampling import Sampler, make_processors
from engine.types import GeneratedToken, SamplingParams, TokenLogprob

# (request_id, logits [1, V]) for every row at every forward: the parity tap.
LogitsTap = Callable[[str, mx.array], None]

BATCHABLE_CACHES = (KVCache, RotatingKVCache, RecurrentCache)


def can_batch(model: nn.Module) -> bool:
    """Whether every layer's cache has a batched form (mlx-lm's all-caches-merge check)."""
    return all(type(c) in BATCHABLE_CACHES for c in model.make_cache())


def _empty_batch_cache(c, kv: Optional[KVQuantization]):
    """A one-row batch cache for a fresh layer cache (mlx-lm merges the empty caches)."""
    if isinstance(c, RotatingKVCache):
        return BatchRotatingKVCache.merge([c])
    if isinstance(c, RecurrentCache):
        return RecurrentCache.merge([c])
    if kv is not None:  # quantized from the first token (start 0), like the serial scheme
        return BatchQuantizedKVCache([0], group_size=kv.group_size, bits=kv.bits)
    return BatchKVCache.merge([c])


@dataclass
class _Row:
    request_id: str
    params: SamplingParams
    sampler: Sampler
    processors: list
    history: Optional[mx.array]  # tokens seen, for processors (prompt, then fed tokens)

    def process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """Apply this row's processors to its logits [1, V], given this step's input token(s)."""
        if not self.processors:
            return logits
        self.history = inputs if self.history is None else mx.concatenate([self.history, inputs])
        for p in self.processors:
            logits = p(self.history, logits)
        return logits


@dataclass
class _Sampled:
    tokens: mx.array  # [B]
    logprobs: mx.array  # [B, V]


class BatchRunner:
    def __init__(self, model: nn.Module, tap: Optional[LogitsTap] = None, kv: Optional[KVQuantization] = None):
        if kv is not None and kv.start != 0:
            raise ValueError("the batch lane quantizes KV from the first token (start 0) only")
        self.model = model
        self.tap = tap
        self.kv = kv
        self.rows: list[_Row] = []
        self.cache: Optional[list] = None
        self.register: Optional[_Sampled] = None  # sampled, not yet fed back
        self.joiner: Optional[_Row] = None
        self.joiner_cache: Optional[list] = None
        self.joiner_first: Optional[_Sampled] = None

    # ---------------------------------------------------------------- joiner

    def start_joiner(self, request_id: str, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        history = mx.array(list(prompt_ids[:-1])) if len(prompt_ids) > 1 else None
        self.joiner = _Row(request_id, params, Sampler(params), make_processors(params), history)
        self.joiner_cache = [_empty_batch_cache(c, self.kv) for c in self.model.make_cache()]

    def prefill(self, tokens: Sequence[int]) -> None:
        """One chunk of the joiner's prompt through the model."""
        self.model(mx.array([list(tokens)]), cache=self.joiner_cache)
        mx.eval(cache_arrays(self.joiner_cache))
        mx.clear_cache()

    def first_token(self, last_token: int) -> GeneratedToken:
        """Token 0 of the joiner, from an L=1 forward of its last prompt token (read now)."""
        row = self.joiner
        inputs = mx.array([last_token])
        logits = self.model(inputs[:, None], cache=self.joiner_cache)[:, -1, :]
        sampled = self._sample([row], inputs, logits)
        mx.eval(sampled.tokens, sampled.logprobs)
        self.joiner_first = sampled
        return self._generated(row, sampled.tokens.item(), sampled.logprobs[0])

    def join(self) -> None:
        """The joiner becomes the last row of the running batch."""
        if self.cache is None:
            self.cache = self.joiner_cache
            self.register = self.joiner_first
        else:
            for running, joiner in zip(self.cache, self.joiner_cache):
                running.extend(joiner)
            self.register = _Sampled(
                mx.concatenate([self.register.tokens, self.joiner_first.tokens]),
                mx.concatenate([self.register.logprobs, self.joiner_first.logprobs]),
            )
        self.rows.append(self.joiner)
        self.drop_joiner()

    def drop_joiner(self) -> None:
        self.joiner = self.joiner_cache = self.joiner_first = None

    # ---------------------------------------------------------------- decode

    def decode(self) -> list[GeneratedToken]:
        """Feed the register to the model, launch the next register, return the fed tokens."""
        inputs = self.register
        logits = self.model(inputs.tokens[:, None], cache=self.cache)[:, -1, :]
        following = self._sample(self.rows, inputs.tokens, logits)
        mx.async_eval(following.tokens, following.logprobs)
        ids = inputs.tokens.tolist()  # waits for the previous step only
        self.register = following
        return [self._generated(row, ids[i], inputs.logprobs[i]) for i, row in enumerate(self.rows)]

    def filter(self, keep: Sequence[int]) -> None:
        keep = list(keep)
        if not keep:
            self.reset()
            return
        for c in self.cache:
            c.filter(keep)
        rows = mx.array(keep)
        self.register = _Sampled(self.register.tokens[rows], self.register.logprobs[rows])
        self.rows = [self.rows[i] for i in keep]

    def extract(self, row: int) -> list:
        """Row `row` as single-row caches (copies; the batch goes on changing)."""
        return [c.extract(row) for c in self.cache]

    def reset(self) -> None:
        """Drop the running batch (after the last row leaves, or a failed forward)."""
        self.rows, self.cache, self.register = [], None, None

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    # --------------------------------------------------------------- helpers

    def _sample(self, rows: list[_Row], inputs: mx.array, logits: mx.array) -> _Sampled:
        if self.tap is not None:
            for i, row in enumerate(rows):
                self.tap(row.request_id, logits[i : i + 1])
        if any(r.processors for r in rows):
            logits = mx.concatenate(
                [row.process(inputs[i : i + 1], logits[i : i + 1]) for i, row in enumerate(rows)], axis=0
            )
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.params.is_greedy for r in rows):  # one vectorized argmax over [B, V]
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            tokens = mx.concatenate([row.sampler(logprobs[i : i + 1]) for i, row in enumerate(rows)], axis=0)
        return _Sampled(tokens, logprobs)

    @staticmethod
    def _generated(row: _Row, token: int, lp: mx.array) -> GeneratedToken:
        """The emitted token, with its logprobs when the row asked (lp: its [V] log-probabilities)."""
        if not row.params.wants_logprobs:
            return GeneratedToken(token)
        top = None
        if row.params.top_logprobs:
            k = row.params.top_logprobs
            ids = mx.argpartition(-lp, kth=k - 1)[:k]
            pairs = sorted(zip(ids.tolist(), lp[ids].tolist()), key=lambda p: -p[1])
            top = tuple(TokenLogprob(t, v) for t, v in pairs)
        return GeneratedToken(token, lp[token].item(), top)
