"""model_type "llama" (and "mistral"): dense, optional biases, configurable rope."""

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
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types and any(t != "full_attention" for t in self.layer_types):
            raise ValueError("llama models with sliding-window layers are not supported by this engine")


class Model(DenseModel):
    def __init__(self, args: ModelArgs):
        super().__init__(
            DenseConfig(
                hidden_size=args.hidden_size,
                num_hidden_layers=args.num_hidden_layers,
                intermediate_size=args.intermediate_size,
                num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_key_value_heads,
                head_dim=args.head_dim or args.hidden_size // args.num_attention_heads,
                rms_norm_eps=args.rms_norm_eps,
                vocab_size=args.vocab_size,
                rope_theta=args.rope_theta,
                tie_word_embeddings=args.tie_word_embeddings,
                rope_traditional=args.rope_traditional,
                rope_scaling=args.rope_scaling,
                qkv_bias=args.attention_bias,
                o_bias=args.attention_bias,
                mlp_bias=args.mlp_bias,
            ),
            args.model_type,
        )
