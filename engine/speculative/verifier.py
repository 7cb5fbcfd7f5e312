"""The verifier: one target forward checks a round of drafts.

Each round feeds the target [pending, d1 .. dn] (the pending token is the
last one emitted, not yet through the model; at the start, the prompt's last
token), computes the lm-head over the whole window once, samples one token
per position under the request's sampler, and accepts drafts while they
match. It emits the accepted drafts and then the target's own token (the
correction, or the bonus when all matched) one at a time, so EOS, stop
sequences and max_tokens end a request exactly where plain decoding would.
The target then rewinds the rejected tail (`rollback.rewind`) and the
source commits. A rewind that needed a forward (the replay rollback) counts
as a target call.

With the fixed policy, draft counts follow mlx-lm's `speculative_generate_step`
(n = min(remaining, num_draft)) so that, with a draft model on a trimmable
target, the forwards have the same shapes and greedy output matches it token
for token; the adaptive policy picks n per round (policy.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.generate import DEFAULT_PREFILL_STEP, pipelined, prefill
from engine.request import GeneratedToken, SamplingParams, SpecStats, StopCriteria
from engine.sampling import Sampler, emitted_token
from engine.speculative.policy import DraftPolicy, FixedPolicy
from engine.speculative.rollback import ROLLBACKS, Rollback, checkpoint, rewind, room
from engine.speculative.source import DraftSource, Round
from engine.stopping import FinishTracker


def speculative_generate(
    model: nn.Module,
    source: DraftSource,
    prompt_ids: Sequence[int],
    *,
    num_draft: int,
    sampling: SamplingParams = SamplingParams(),
    stop: StopCriteria = StopCriteria(),
    stats: SpecStats | None = None,
    cache: list | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    on_prefill: Callable[[int, int], None] | None = None,
    rollback: str = Rollback.TRACE,
    policy: DraftPolicy | None = None,
    cached_tokens: int = 0,
    on_prompt: Callable[[list, Any], None] | None = None,
    source_state: Any = None,
) -> Iterator[GeneratedToken]:
    """Generate like `engine.generate.generate`, drafting with `source`; fills `stats` as it goes.

    `rollback` says how recurrent layers undo rejected drafts ("trace" or "replay", see rollback.py);
    `policy` how many tokens to draft each round (default: always `num_draft`, mlx-lm's rule). `cache` may
    already hold the first `cached_tokens` prompt tokens (a prompt cache hit; a source that sees the prompt's
    hidden states then resumes from `source_state`, its state there); `on_prompt` sees the target's cache once
    it holds all but the last prompt token, and the source's state there (`MTPSource.boundary`; None for a
    source that does not see the prompt's hidden states).
    """
    if len(prompt_ids) == 0:
        raise ValueError("the prompt must contain at least one token")
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}, got {rollback!r}")
    if sampling.has_processors:
        raise ValueError("speculative decoding does not run logits processors (penalties, logit_bias)")
    sees_hidden = getattr(source, "sees_prompt_hidden", False)
    if cached_tokens and sees_hidden and getattr(source_state, "tokens", None) != cached_tokens:
        raise ValueError(
            f"the {source.kind} source needs the target's hidden states of the whole prompt, or its "
            f"state after the {cached_tokens} cached tokens"
        )
    if not 0 <= cached_tokens < len(prompt_ids):
        raise ValueError(f"cached_tokens must be in [0, {len(prompt_ids)}), got {cached_tokens}")
    stats = stats if stats is not None else SpecStats(source.kind, num_draft)
    policy = policy or FixedPolicy()
    cache = model.make_cache() if cache is None else cache
    sampler = Sampler(sampling)
    tracker = FinishTracker(stop)
    prompt = mx.array(list(prompt_ids))

    source.begin(prompt_ids)
    if cached_tokens and sees_hidden:
        source.resume(source_state)
    start = cached_tokens

    def observe(hidden: mx.array, n: int) -> None:
        nonlocal start
        source.observe(hidden, start)
        start += n

    def forward(tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The target over 1-D `tokens`, the lm-head over every position, one sample each (all lazy):
        (sampled ids [n], logprobs [n, V], final hidden state [1, n, H])."""
        hidden = model.hidden(tokens[None], cache)
        logits = model.logits(hidden)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs, hidden

    def plain_step(token: mx.array):
        """Launch one single-token forward and its sample; nothing is read back here."""
        step = forward(token)
        mx.async_eval(step[0], step[1])
        return step

    def plain_rounds(rounds: int) -> Iterator[GeneratedToken]:
        """Rounds with no drafts, pipelined like plain decoding: each next step is launched before
        this one's token is read. Each is still a round to the source, the policy and the stats."""
        nonlocal pending, produced
        last = time.perf_counter()
        for step in pipelined(lambda s: plain_step(s[0]), plain_step(mx.array([pending])), rounds):
            token = int(step[0].item())
            now = time.perf_counter()
            source.propose(pending, 0)
            source.commit(Round((pending,), 0, token, step[2]))
            policy.record(0, 0, 0.0, now - last)
            stats.record_round(0, 0, 1, False)
            last = now
            produced += 1
            out = tracker.push(emitted_token(token, step[1][0], sampling))
            yield from out
            if tracker.done:
                return
            pending = token

    pending = int(
        prefill(model, cache, prompt[cached_tokens:], prefill_step_size, on_prefill, on_hidden=observe).item()
    )
    if on_prompt is not None:
        on_prompt(cache, source.boundary() if sees_hidden else None)
    produced = 0
    while True:
        n = min(stop.max_tokens - produced, num_draft)
        window = room(cache)
        if window is not None:
            n = min(n, window - 2)  # keep the whole round short of a wrap
        started = time.perf_counter()
        k = policy.choose(max(n, 0))
        if k == 0:
            yield from plain_rounds(min(policy.plain_rounds(), stop.max_tokens - produced))
            if tracker.done:
                return
            continue
        drafts = source.propose(pending, k)
        drafted_at = time.perf_counter()
        fed = (pending, *drafts)
        point = checkpoint(cache, trace=rollback == Rollback.TRACE)
        sampled, logprobs, hidden = forward(mx.array(fed))
        tokens = sampled.tolist()
        verified_at = time.perf_counter()
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        policy.record(len(drafts), accepted, drafted_at - started, verified_at - drafted_at)
        replayed = rewind(model, cache, point, fed, accepted + 1)
        source.commit(Round(fed, accepted, tokens[accepted], hidden))
        out: list[GeneratedToken] = []
        for j in range(accepted + 1):
            produced += 1
            out += tracker.push(emitted_token(tokens[j], logprobs[j], sampling))
            if tracker.done:
                break
        stats.record_round(len(drafts), accepted, j + 1, replayed)  # j + 1 tokens were pushed
        yield from out
        if tracker.done:
            return
        pending = tokens[accepted]
