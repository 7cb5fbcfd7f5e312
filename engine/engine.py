"""The engine's public entry point: a loaded model with its tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn

from engine.generate import DEFAULT_PREFILL_STEP, KVQuantization, StepTap, generate
from engine.kernels import EXACT, KernelConfig, KernelSet, install
from engine.loading import load_model
from engine.model_source import resolve_model_dir
from engine.request import GeneratedToken, SamplingParams, StopCriteria
from engine.tokenizer import Tokenizer


def _eos_ids(config: dict[str, Any]) -> frozenset[int]:
    eos = config.get("eos_token_id")
    if eos is None and "text_config" in config:
        eos = config["text_config"].get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def kernels_notice(kernels: KernelSet) -> str | None:
    """The one stderr line for a tier chosen by `auto` or asked for and not run (None otherwise)."""
    if kernels.tier == kernels.requested:
        return None
    if kernels.requested == "auto":
        return f"kernels: {kernels.reason}"
    return f"kernels: {kernels.requested} requested, running {kernels.tier}: {kernels.reason}"


@dataclass
class Engine:
    """A model ready to generate, with the kernel tier it runs (`kernels`).

    >>> eng = Engine.load("tiny-qwen35")  # tier auto; kernels="exact" for mlx-lm's bits everywhere
    >>> ids = eng.tokenizer.encode("Hello")
    >>> text = eng.tokenizer.decode(t.token_id for t in eng.generate(ids, max_tokens=8))
    """

    model: nn.Module
    config: dict[str, Any]
    path: Path
    tokenizer: Tokenizer | None = None
    kernels: KernelSet = KernelSet(tier=EXACT, requested=EXACT)  # what `load_model` gives: MLX's ops

    @classmethod
    def load(
        cls,
        model: str | None = None,
        model_path: str | Path | None = None,
        *,
        seed: int = 0,
        lazy: bool = False,
        with_tokenizer: bool = True,
        kernels: KernelConfig | str | None = None,
    ) -> Engine:
        """Load a registry model or a model directory with the kernels `kernels`.

        `kernels`: a `KernelConfig`, or a tier name ("auto", "exact", "fast") with the
        default settings; None is `KernelConfig()` (auto). Where the fast tier cannot
        run (off MLX's CUDA backend) the model keeps the exact tier and
        `Engine.kernels.reason` says why; an unknown tier is a ValueError.
        """
        # the tier is checked before loading: a big model takes a while
        kernel_config = KernelConfig(tier=kernels) if isinstance(kernels, str) else kernels or KernelConfig()
        path = resolve_model_dir(model, model_path, seed=seed)
        net, config = load_model(path, lazy=lazy)
        kernel_set = install(net, kernel_config, family=config.get("model_type"))
        tok = Tokenizer(path, _eos_ids(config)) if with_tokenizer else None
        return cls(model=net, config=config, path=path, tokenizer=tok, kernels=kernel_set)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids if self.tokenizer else _eos_ids(self.config)

    def make_cache(self) -> list:
        return self.model.make_cache()

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams = SamplingParams(),
        stop_sequences: Sequence[Sequence[int]] = (),
        ignore_eos: bool = False,
        cache: list | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        tap: Callable[[StepTap], None] | None = None,
        kv_quantization: KVQuantization | None = None,
    ) -> Iterator[GeneratedToken]:
        stop = StopCriteria(
            max_tokens=max_tokens,
            eos_ids=self.eos_ids,
            stop_sequences=tuple(tuple(s) for s in stop_sequences),
            ignore_eos=ignore_eos,
        )
        return generate(
            self.model,
            prompt_ids,
            sampling=sampling,
            stop=stop,
            cache=cache,
            prefill_step_size=prefill_step_size,
            tap=tap,
            kv_quantization=kv_quantization,
        )
