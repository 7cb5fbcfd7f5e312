"""B=1 generation: chunked prefill, then a pipelined decode loop.

Conventions that decide the bits, as in mlx-lm: the prompt is prefilled in
chunks of `prefill_step_size` up to but excluding its last token ("tail
split"); the last prompt token then goes through an L=1 forward whose logits
give the first generated token. Each decode step is launched before the
previous step's token is read back, so the device never waits on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache, QuantizedKVCache, RotatingKVCache, cache_arrays
from engine.cache.prompt_cache import keep_at, markable, snapshot, snapshot_at, unmark
from engine.kernels.cuda_source import BUILDS
from engine.request import GeneratedToken, SamplingParams, StopCriteria
from engine.sampling import Sampler, emitted_token, make_processors
from engine.stopping import FinishTracker

T = TypeVar("T")

DEFAULT_PREFILL_STEP = 2048


@dataclass(frozen=True)
class KVQuantization:
    """Switch growing KV caches to affine-quantized storage once they hold `start` tokens."""

    bits: int = 8
    group_size: int = 64
    start: int = 5000  # mlx-lm's default

    def check(self, cache: list) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"kv bits must be 4 or 8, got {self.bits}")
        if any(isinstance(c, RotatingKVCache) for c in cache):
            raise ValueError("quantized KV is not supported for sliding-window layers (nor is it in mlx-lm)")

    def apply(self, cache: list) -> None:
        for i, c in enumerate(cache):
            if type(c) is KVCache and c.offset >= self.start:
                cache[i] = QuantizedKVCache.from_kv(c, group_size=self.group_size, bits=self.bits)


@dataclass(frozen=True)
class StepTap:
    """What one forward produced, for callers that need more than the token."""

    logits: mx.array  # [1, V], raw model output before processors
    hidden: mx.array  # [1, 1, H], final normed hidden state of the last position


@dataclass
class _Step:
    token: mx.array
    logprobs: mx.array  # [V]


def prefill(
    model: nn.Module,
    cache: list,
    prompt: mx.array,
    step_size: int = DEFAULT_PREFILL_STEP,
    on_progress: Callable[[int, int], None] | None = None,
    kv_quantization: KVQuantization | None = None,
    on_hidden: Callable[[mx.array, int], None] | None = None,
    blocks: BlockSnapshots | None = None,
) -> mx.array:
    """Run all but the last prompt token through the model in chunks; return the rest.

    `on_hidden` sees each chunk's final hidden state [1, n, H] and n. With `blocks`, its `take` sees the
    snapshot at each block boundary: kept from inside the chunks where the caches can (`prompt_cache.markable`),
    so the chunks are the same as without; else no chunk passes a boundary, but for the first chunk of a cold
    start with quantized KV, which attends to full-precision keys and stays `step_size` long (mlx-lm's kv_bits);
    its boundaries are not taken (the prompt cache serves no start inside it).
    """
    total = prompt.size
    done = 0
    inside = blocks is not None and markable(cache)
    while prompt.size > 1:
        n = min(step_size, prompt.size - 1)
        first_quantized = kv_quantization is not None and blocks is not None and blocks.start + done == 0
        if blocks is not None and not inside and not first_quantized:
            n = min(n, blocks.block - (blocks.start + done) % blocks.block)
        at = blocks.counts(done, n, prompt.size) if blocks is not None else []
        marked = [p for p in at if p < n] if inside and not first_quantized else []
        if marked:
            keep_at(cache, [marked])
        hidden = model.hidden(prompt[:n][None], cache)
        if on_hidden:
            on_hidden(hidden, n)
        if kv_quantization:
            kv_quantization.apply(cache)
        BUILDS.settle()
        taken = [(p, snapshot_at(cache, 0, p)) for p in marked]
        unmark(cache)
        mx.eval(cache_arrays(cache), [c.state for _, layers in taken for c in layers if c is not None])
        for p, layers in taken:
            blocks.take(blocks.start + done + p, layers)
        prompt = prompt[n:]
        done += n
        if at and at[-1] == n:
            blocks.take(blocks.start + done, snapshot(cache))
        if on_progress:
            on_progress(done, total)
        mx.clear_cache()
    return prompt


@dataclass(frozen=True)
class BlockSnapshots:
    """The prompt cache's block snapshots of a prefill: at every multiple of `block` tokens from the start of the
    prompt (`start`: the tokens the cache held before), `take(n, layers)` sees the snapshot there
    (`prompt_cache.snapshot`'s form). The prompt's own boundary, the last token's, is not one: the caller keeps
    that."""

    block: int
    take: Callable[[int, list], None]
    start: int = 0

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"the snapshot block must be >= 1 token, got {self.block}")

    def counts(self, done: int, n: int, left: int) -> list[int]:
        """The boundaries a chunk of `n` tokens after `done` passes, as counts into the chunk, `left` prompt
        tokens (the last one among them) ahead of it."""
        first = self.block - (self.start + done) % self.block
        return list(range(first, min(n, left - 2) + 1, self.block))


class _Decoder:
    """Builds one forward + sampling graph per step; keeps the token history for processors."""

    def __init__(self, model, cache, params: SamplingParams, tap, kv_quantization: KVQuantization | None):
        self.model = model
        self.cache = cache
        self.params = params
        self.kv_quantization = kv_quantization
        self.sampler = Sampler(params)
        self.processors = make_processors(params)
        self.tap = tap
        self.history: mx.array | None = None

    def step(self, tokens: mx.array) -> _Step:
        hidden = self.model.hidden(tokens[None], self.cache)
        logits = self.model.logits(hidden)[:, -1, :]
        if self.tap is not None:
            self.tap(StepTap(logits=logits, hidden=hidden[:, -1:, :]))
        if self.processors:
            self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])
            for process in self.processors:
                logits = process(self.history, logits)
        if self.kv_quantization:
            self.kv_quantization.apply(self.cache)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return _Step(token=self.sampler(logprobs), logprobs=logprobs.squeeze(0))


def decode_steps(
    model: nn.Module,
    prompt: mx.array,
    cache: list,
    params: SamplingParams,
    max_steps: int,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    tap: Callable[[StepTap], None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    kv_quantization: KVQuantization | None = None,
    cached_tokens: int = 0,
    on_prompt: Callable[[list], None] | None = None,
    blocks: BlockSnapshots | None = None,
    on_hidden: Callable[[mx.array, int], None] | None = None,
) -> Iterator[_Step]:
    """Yield up to `max_steps` sampled steps (the caller may stop earlier).

    The cache already holds the first `cached_tokens` prompt tokens (a prompt
    cache hit); prefill starts after them. `on_prompt` sees the cache once it
    holds all but the last prompt token; `blocks` takes block snapshots on the way (its start: the cached
    tokens); `on_hidden` sees each prefill chunk's final hidden states (`prefill`).
    """
    if kv_quantization:
        kv_quantization.check(cache)
    if not 0 <= cached_tokens < prompt.size:
        raise ValueError(f"cached_tokens must be in [0, {prompt.size}), got {cached_tokens}")
    decoder = _Decoder(model, cache, params, tap, kv_quantization)
    if decoder.processors:
        decoder.history = prompt[:-1] if prompt.size > 1 else None
    if blocks is not None:
        blocks = dataclasses.replace(blocks, start=cached_tokens)
    tail = prefill(
        model, cache, prompt[cached_tokens:], prefill_step_size, on_prefill, kv_quantization, on_hidden, blocks
    )
    if on_prompt is not None:
        on_prompt(cache)

    def launch(tokens: mx.array) -> _Step:
        step = decoder.step(tokens)
        BUILDS.settle()
        mx.async_eval(step.token, step.logprobs)
        return step

    for n, current in enumerate(pipelined(lambda step: launch(step.token), launch(tail), max_steps)):
        yield current
        if n % 256 == 0:
            mx.clear_cache()


def pipelined(launch: Callable[[T], T], first: T, steps: int) -> Iterator[T]:
    """Up to `steps` steps from `first`, each following one launched from the current one before the
    current is yielded (read back by the caller): the device runs step n + 1 while the host handles step
    n. The decode loops of the serial and the speculative lane share it."""
    current = first
    for n in range(steps):
        following = launch(current) if n + 1 < steps else None
        yield current
        current = following


def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    sampling: SamplingParams = SamplingParams(),
    stop: StopCriteria = StopCriteria(),
    cache: list | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    tap: Callable[[StepTap], None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    kv_quantization: KVQuantization | None = None,
    cached_tokens: int = 0,
    fed: list[int] | None = None,
    on_prompt: Callable[[list], None] | None = None,
    blocks: BlockSnapshots | None = None,
    on_hidden: Callable[[mx.array, int], None] | None = None,
) -> Iterator[GeneratedToken]:
    """Generate tokens for one prompt. The last token carries the finish reason.

    `cache` (from `model.make_cache()`) is updated in place when given, so a
    caller can inspect or reuse it afterwards; it may already hold the first
    `cached_tokens` prompt tokens. `fed`, when given, receives the generated
    ids that went through the model: the cache then holds exactly the prompt
    followed by `fed`.
    """
    if len(prompt_ids) == 0:
        raise ValueError("the prompt must contain at least one token")
    cache = model.make_cache() if cache is None else cache
    tracker = FinishTracker(stop)
    steps = decode_steps(
        model,
        mx.array(list(prompt_ids)),
        cache,
        sampling,
        stop.max_tokens,
        prefill_step_size,
        tap,
        on_prefill,
        kv_quantization,
        cached_tokens,
        on_prompt,
        blocks,
        on_hidden,
    )
    for n, step in enumerate(steps):
        token_id = step.token.item()
        if fed is not None and n + 1 < stop.max_tokens:
            fed.append(token_id)  # decode_steps launched the step that feeds it
        yield from tracker.push(emitted_token(token_id, step.logprobs, sampling))
        if tracker.done:
            return
