"""Prompt logprobs (the completions API's `echo` with `logprobs`): how likely the model found each prompt token.

Each prompt token after the first is scored from the logits at the position before it, taken from the very
forward that prefills that position (a prefill chunk's hidden states through the output head), so scoring
costs the output head over the prompt and no second pass. The log-softmax runs in float32 over the logits as
the model computed them. The first prompt token has no score (nothing precedes it); a request that scores
its prompt starts cold, never from the prompt cache, since cached positions have no logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from engine.request import GeneratedToken, TokenLogprob


def log_softmax(logits: mx.array) -> mx.array:
    """logits [..., V] -> float32 log-probabilities."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass
class PromptScorer:
    """Scores of one prompt's tokens, fed the logits of its prefill chunks in order (`add`)."""

    prompt_ids: Sequence[int]
    top: int = 0  # alternatives per token
    done: int = 0  # prompt positions scored so far
    _read: list[tuple[list, list, list, list]] = field(default_factory=list)  # per chunk: targets, chosen, ids, values

    def add(self, logits: mx.array) -> None:
        """logits [n, V] of the next n prompt positions (each scores the token after it); evaluated here, so
        the chunk's activations are not held."""
        n = logits.shape[0]
        targets = list(self.prompt_ids[self.done + 1 : self.done + n + 1])
        if len(targets) != n:
            raise ValueError(f"{n} positions from {self.done} score past the prompt's {len(self.prompt_ids)} tokens")
        lp = log_softmax(logits)
        chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)[:, 0]
        ids = values = None
        if self.top:
            ids = mx.argpartition(-lp, kth=self.top - 1, axis=-1)[:, : self.top]
            values = mx.take_along_axis(lp, ids, axis=-1)
        mx.eval(*(a for a in (chosen, ids, values) if a is not None))
        self._read.append(
            (targets, chosen.tolist(), ids.tolist() if self.top else [], values.tolist() if self.top else [])
        )
        self.done += n

    def result(self) -> tuple[GeneratedToken, ...]:
        """Prompt tokens 1.. in order, each with its logprob and its top alternatives (best first)."""
        out = []
        for targets, chosen, ids, values in self._read:
            for k, (token, logprob) in enumerate(zip(targets, chosen)):
                top = None
                if self.top:
                    top = tuple(TokenLogprob(i, v) for i, v in sorted(zip(ids[k], values[k]), key=lambda p: -p[1]))
                out.append(GeneratedToken(token, logprob, top))
        return tuple(out)
