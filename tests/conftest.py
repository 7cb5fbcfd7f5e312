"""Shared test setup: a model cache that survives between runs of the suite.

Synthesized tiny models are deterministic, so tests share one cache
(ENGINE_HARNESS_CACHE if set, else the user's cache) instead of paying for
synthesis per test; concurrent xdist workers synthesize atomically.
"""

from __future__ import annotations

import pytest

from engine.synth import ensure_model


@pytest.fixture(scope="session")
def tiny_path():
    """tiny_path(name) -> the cached artifact directory for a registry name."""
    return lambda name, seed=0: ensure_model(name, seed)
