"""Dense decoder-only transformer shared by llama, qwen2 and qwen3.

The three model_types differ only in biases, q/k norm and rope settings;
their files turn a config into `DenseConfig` and reuse this module, so there
is one copy of the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache
from engine.masks import attention_mask
from engine.models.activations import swiglu
from engine.models.base import project, scaled_dot_product_attention
from engine.models.rope import make_rope


@dataclass
class DenseConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


class Attention(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.n_heads = c.num_attention_heads
        self.n_kv_heads = c.num_key_value_heads
        self.scale = c.head_dim**-0.5
        self.kv_channels = 2 * self.n_kv_heads * c.head_dim  # what a token adds to the cache: keys and values
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.has_qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.rope = make_rope(c.head_dim, c.rope_theta, c.rope_traditional, c.rope_scaling)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        b, length, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(b, length, self.n_heads, -1)
        k = k.reshape(b, length, self.n_kv_heads, -1)
        v = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*project(x, self.gate_proj, self.up_proj)))


class TransformerBlock(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseBody(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = [TransformerBlock(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class DenseModel(nn.Module):
    """`Model` for the dense families: hidden() is the tap, __call__ gives logits."""

    def __init__(self, c: DenseConfig, model_type: str):
        super().__init__()
        self.config = c
        self.model_type = model_type
        self.model = DenseBody(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def hidden(self, inputs: mx.array, cache=None) -> mx.array:
        return self.model(inputs, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.logits(self.hidden(inputs, cache))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
