"""What the parity cases and the B=1 goldens are made of: dtypes, prompt lengths, steps, and the frozen
prompt ids derived from a seed (identical for every arm and every machine). The goldens' script and the
harness's parity gate both read them here, so the oracle side imports nothing from the harness."""

from __future__ import annotations

import numpy as np

from engine.registry import get_spec

DTYPES = ("f32", "bf16", "4bit")
PROMPT_LENGTHS = (1, 7, 300, 2100)  # 2100 crosses the 2048 prefill chunk boundary
DEFAULT_STEPS = 64


def model_name(base: str, dtype: str) -> str:
    """The registry name of a tiny family's variant (e.g. tiny-qwen35, 4bit: tiny-qwen35-4bit)."""
    return get_spec(f"{base}-{dtype}").name


def frozen_prompt_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`length` ids uniform over the vocabulary (PCG64 seeded by seed and length)."""
    rng = np.random.Generator(np.random.PCG64([seed, length, 0x9A41]))
    return rng.integers(0, vocab_size, size=length).tolist()
