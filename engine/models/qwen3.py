"""model_type "qwen3": dense with RMSNorm on per-head queries and keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.base import BaseModelArgs
from engine.models.dense import DenseConfig, DenseModel


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None

    def __post_init__(self):
        # transformers 5 nests rope settings under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            raise ValueError("rope_theta is missing from the model config")


class Model(DenseModel):
    def __init__(self, args: ModelArgs):
        super().__init__(
            DenseConfig(
                hidden_size=args.hidden_size,
                num_hidden_layers=args.num_hidden_layers,
                intermediate_size=args.intermediate_size,
                num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_key_value_heads,
                head_dim=args.head_dim,
                rms_norm_eps=args.rms_norm_eps,
                vocab_size=args.vocab_size,
                rope_theta=args.rope_theta,
                tie_word_embeddings=args.tie_word_embeddings,
                rope_scaling=args.rope_scaling,
                qk_norm=True,
            ),
            args.model_type,
        )
