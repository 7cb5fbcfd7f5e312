"""Speculative decoding: draft sources, one verifier, and the settings that pick them."""

from engine.spec.config import SpecConfig, Speculation
from engine.spec.verifier import speculative_generate

__all__ = ["SpecConfig", "Speculation", "speculative_generate"]
