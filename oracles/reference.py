"""Run mlx-lm's own generation path and record what the parity gate compares.

The B=1 oracle is `mlx_lm.generate.generate_step` itself, unmodified: a
pass-through logits processor records the raw logits of every forward it
makes (processors see the logits before sampling), and the prompt cache it
filled is kept for comparing cache contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np


@dataclass
class Run:
    """One greedy generation: tokens, float32 logits per forward, final cache arrays."""

    tokens: list[int]
    logits: list[np.ndarray]
    cache: list[list[np.ndarray]] = field(default_factory=list)


def load_model(path: str | Path):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model, _ = mlx_lm_load_model(Path(path))
    return model


def to_numpy(a: mx.array) -> np.ndarray:
    """Exact numpy copy; bf16/f16 widen to float32 (lossless)."""
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.astype(mx.float32)
    return np.array(a)


def cache_arrays(cache: list) -> list[list[np.ndarray]]:
    """The arrays each mlx-lm cache layer holds, trimmed to the tokens it holds."""
    out = []
    for c in cache:
        if hasattr(c, "cache") and isinstance(c.cache, list):  # ArraysCache
            out.append([to_numpy(a) for a in c.cache if a is not None])
        elif c.keys is None:
            out.append([])
        else:
            keys, values = c.keys, c.values
            if isinstance(keys, (tuple, list)):  # QuantizedKVCache
                keys, values = c.keys_and_values()
                out.append([to_numpy(a) for a in (*keys, *values)])
                continue
            if c.offset < keys.shape[2]:
                keys, values = keys[..., : c.offset, :], values[..., : c.offset, :]
            out.append([to_numpy(keys), to_numpy(values)])
    return out


def generate(
    model,
    prompt_ids: Sequence[int],
    steps: int,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
) -> Run:
    """Greedy `generate_step` for `steps` tokens (it makes steps + 1 forwards)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    logits: list[mx.array] = []

    def record(_tokens, step_logits):
        logits.append(step_logits.astype(mx.float32))
        return step_logits

    cache = make_prompt_cache(model)
    tokens = []
    for token, _ in generate_step(
        mx.array(list(prompt_ids)),
        model,
        max_tokens=steps,
        logits_processors=[record],
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    ):
        tokens.append(int(token))
    mx.eval(logits)
    return Run(tokens=tokens, logits=[to_numpy(x[0]) for x in logits], cache=cache_arrays(cache))


@dataclass
class SpecRun:
    """One greedy `speculative_generate_step` run: tokens and which of them came from the draft."""

    tokens: list[int]
    from_draft: list[bool]


def speculative(
    model,
    draft_model,
    prompt_ids: Sequence[int],
    steps: int,
    num_draft: int,
    prefill_step_size: int = 2048,
) -> SpecRun:
    """mlx-lm's own speculative decoding (greedy) for `steps` tokens, unmodified."""
    from mlx_lm.generate import speculative_generate_step

    run = SpecRun([], [])
    for token, _, drafted in speculative_generate_step(
        mx.array(list(prompt_ids)),
        model,
        draft_model,
        num_draft_tokens=num_draft,
        max_tokens=steps,
        prefill_step_size=prefill_step_size,
    ):
        run.tokens.append(int(token))
        run.from_draft.append(bool(drafted))
    return run
