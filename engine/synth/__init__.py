"""Synthetic model artifacts: registry name + seed -> an mlx-lm model directory."""

from engine.synth.artifact import artifact_dir, ensure_model, is_cached, parameter_count, synthesize

__all__ = ["artifact_dir", "ensure_model", "is_cached", "parameter_count", "synthesize"]
