"""Which draft source a server or a command uses, and the checks made before it runs.

    kind "draft"  a separate draft model (`--draft-model`), mlx-lm's scheme
    kind "ngram"  prompt lookup: no model, drafts copied from the context
    kind "mtp"    the target's own multi-token-prediction head (Qwen3.5)

`Speculation` holds what is loaded once (the draft model) and makes a fresh
source per request. A request that speculation cannot serve exactly as
asked (logits processors, quantized KV) runs without it, and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.nn as nn

from engine.errors import DraftMismatchError
from engine.request import GeneratedToken, SamplingParams, SpecStats, StopCriteria
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.mtp import MTPSource
from engine.speculative.ngram import NgramSource
from engine.speculative.policy import POLICIES, make_policy
from engine.speculative.rollback import ROLLBACKS, Rollback
from engine.speculative.source import DraftSource
from engine.speculative.verifier import speculative_generate
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.engine import Engine

KINDS = ("draft", "ngram", "mtp")
DEFAULT_NUM_DRAFT = 3  # mlx_lm.server's --num-draft-tokens


@dataclass(frozen=True)
class SpecConfig:
    kind: str
    num_draft: int = DEFAULT_NUM_DRAFT
    ngram_min: int = 2
    ngram_max: int = 4
    rollback: str = Rollback.TRACE  # how recurrent layers undo rejected drafts (`Rollback`)
    policy: str = "adaptive"  # drafts per round: "adaptive" (measured) or "fixed" (always num_draft, as mlx-lm)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"draft kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {self.num_draft}")
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}, got {self.rollback!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"draft policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft model whose vocabulary maps any token to another id than the target's."""
    t, d = target.vocab(), draft.vocab()
    if t == d:
        return
    differ = sorted(k for k in t.keys() | d.keys() if t.get(k) != d.get(k))
    raise DraftMismatchError(
        f"draft model {draft_name} has another tokenizer than the target ({len(d)} vs {len(t)} tokens, "
        f"{len(differ)} differ, e.g. {differ[:3]}): its drafts would be other tokens; use a draft of the same family"
    )


class Speculation:
    """A speculation setup for one target model: makes one draft source per request."""

    def __init__(
        self,
        config: SpecConfig,
        target: nn.Module,
        draft: nn.Module | None = None,
        prefill_step_size: int = 2048,
        draft_name: str = "",
    ):
        if config.kind == "draft" and draft is None:
            raise ValueError("draft kind 'draft' needs a draft model (--draft-model)")
        if config.kind != "draft" and draft is not None:
            raise ValueError(f"a draft model was given but the draft kind is {config.kind!r}")
        if config.kind == "mtp" and not getattr(target, "has_mtp", False):
            raise ValueError(
                "draft kind 'mtp' needs a target with an MTP head (Qwen3.5 checkpoints with mtp.* weights)"
            )
        self.config = config
        self.target = target
        self.draft = draft
        self.draft_name = draft_name
        self.prefill_step_size = prefill_step_size

    def describe(self) -> str:
        what = self.config.kind
        if self.draft is not None:
            what += " (self-draft)" if self.draft is self.target else f" ({self.draft_name})"
        c = self.config
        return f"{what}, up to {c.num_draft} drafts per round ({c.policy}), {c.rollback} rollback"

    def source(self) -> DraftSource:
        kind = self.config.kind
        if kind == "draft":
            return DraftModelSource(self.draft, self.prefill_step_size, self.config.rollback == Rollback.TRACE)
        if kind == "ngram":
            return NgramSource(self.config.ngram_min, self.config.ngram_max)
        return MTPSource(self.target)

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        stop: StopCriteria = StopCriteria(),
        stats: SpecStats | None = None,
        cache: list | None = None,
        cached_tokens: int = 0,
        on_prompt: Callable[[list, Any], None] | None = None,
        source_state: Any = None,
    ) -> Iterator[GeneratedToken]:
        """One request, speculatively, with a fresh draft source; `stats` fills as it runs. The target starts
        from `cache` holding `cached_tokens` prompt tokens where given, the MTP head from `source_state`, its
        state there (`speculative_generate`)."""
        c = self.config
        return speculative_generate(
            self.target,
            self.source(),
            prompt_ids,
            num_draft=c.num_draft,
            sampling=sampling,
            stop=stop,
            stats=stats,
            cache=cache,
            prefill_step_size=self.prefill_step_size,
            rollback=c.rollback,
            policy=make_policy(c.policy, c.num_draft),
            cached_tokens=cached_tokens,
            on_prompt=on_prompt,
            source_state=source_state,
        )

    @property
    def prefix_state(self) -> str | None:
        """The kind of source state a prompt-cache hit must carry to start a request (`CachedPrefix.draft`): the
        MTP head's, which otherwise needs the target's hidden states of the whole prompt; None for the others
        (a draft model prefills the prompt itself, n-grams read the tokens)."""
        return "mtp" if self.config.kind == "mtp" else None

    def new_stats(self) -> SpecStats:
        return SpecStats(self.config.kind, self.config.num_draft)

    def refusal(self, sampling: SamplingParams) -> str | None:
        """Why a request with these settings runs without speculation (None: it can speculate)."""
        if sampling.has_processors:
            return "logits processors (penalties, logit_bias) run without speculation"
        return None


def load_speculation(
    config: SpecConfig,
    target: Engine,
    draft_model: str | None = None,
    draft_model_path: Path | None = None,
    seed: int = 0,
    prefill_step_size: int = 2048,
) -> Speculation:
    """Load the draft model (kind "draft"), check its tokenizer against the target's, build the setup.

    A draft that is the target's own artifact is not loaded twice: the target
    drafts for itself with caches of its own (the upper bound of acceptance),
    on the target's kernel tier; a separate draft model runs the exact tier.
    """
    from engine.engine import Engine
    from engine.kernels import EXACT
    from engine.model_source import resolve_model_dir

    draft = None
    name = ""
    if config.kind == "draft":
        if (draft_model is None) == (draft_model_path is None):
            raise ValueError("draft kind 'draft' needs exactly one of --draft-model NAME or --draft-model-path DIR")
        name = draft_model or str(draft_model_path)
        path = resolve_model_dir(draft_model, draft_model_path, seed=seed)
        if path.resolve() == target.path.resolve():
            draft = target.model
        else:
            # The draft stays on the exact tier whatever the target runs: the target's verify
            # decides every emitted token, and `kernels` in usage and /stats describes the target.
            loaded = Engine.load(model_path=path, kernels=EXACT)
            check_same_tokenizer(target.tokenizer, loaded.tokenizer, name)
            draft = loaded.model
    elif draft_model is not None or draft_model_path is not None:
        raise ValueError(f"a draft model was given but the draft kind is {config.kind!r}")
    return Speculation(config, target.model, draft, prefill_step_size, name)
