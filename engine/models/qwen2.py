"""model_type "qwen2": dense with biases on q/k/v (not o)."""

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
    num_key_value_heads: int | None = None
    rope_theta: float = 1000000
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True


class Model(DenseModel):
    def __init__(self, args: ModelArgs):
        super().__init__(
            DenseConfig(
                hidden_size=args.hidden_size,
                num_hidden_layers=args.num_hidden_layers,
                intermediate_size=args.intermediate_size,
                num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_key_value_heads or args.num_attention_heads,
                head_dim=args.hidden_size // args.num_attention_heads,
                rms_norm_eps=args.rms_norm_eps,
                vocab_size=args.vocab_size,
                rope_theta=args.rope_theta,
                tie_word_embeddings=args.tie_word_embeddings,
                rope_traditional=args.rope_traditional,
                rope_scaling=args.rope_scaling,
                qkv_bias=True,
            ),
            args.model_type,
        )
