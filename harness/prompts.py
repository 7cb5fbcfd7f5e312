"""Frozen prompt ids derived from a seed, identical for every arm and every machine."""

from __future__ import annotations

import numpy as np


def frozen_prompt_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`length` ids uniform over the vocabulary (PCG64 seeded by seed and length)."""
    rng = np.random.Generator(np.random.PCG64([seed, length, 0x9A41]))
    return rng.integers(0, vocab_size, size=length).tolist()
