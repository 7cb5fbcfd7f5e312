"""model_type "gemma3_text": sliding-window and global attention layers.

Every `sliding_window_pattern`-th layer is global (growing KV cache, rope
base `rope_theta`); the others attend to the last `sliding_window` tokens
(rotating cache, rope base `rope_local_base_freq`). Gemma's RMSNorm scales
by (1 + w), the embedding is scaled by sqrt(hidden_size) rounded to bf16,
and there are norms after attention and after the MLP as well as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache, RotatingKVCache
from engine.masks import attention_mask
from engine.models.activations import clip_residual
from engine.models.base import BaseModelArgs, project, scaled_dot_product_attention
from engine.models.rope import make_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int = 1152
    num_hidden_layers: int = 26
    intermediate_size: int = 6912
    num_attention_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 262144
    num_key_value_heads: int = 1
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    max_position_embeddings: int = 32768
    rope_scaling: dict | None = None

    def is_global(self, layer: int) -> bool:
        return layer % self.sliding_window_pattern == self.sliding_window_pattern - 1


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        hd = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        self.kv_channels = 2 * self.n_kv_heads * hd  # what a token adds to the cache: keys and values
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=args.rms_norm_eps)
        if args.is_global(layer):
            self.rope = make_rope(hd, args.rope_theta, False, args.rope_scaling)
        else:
            self.rope = make_rope(hd, args.rope_local_base_freq, False)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        b, length, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.q_norm(q), self.k_norm(k)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(nn.gelu_approx(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(h, args.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = clip_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return clip_residual(h, self.post_feedforward_layernorm(r))


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        a = self.args
        h = self.embed_tokens(inputs)
        h *= mx.array(a.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        cache = cache or [None] * len(self.layers)
        pattern = a.sliding_window_pattern
        global_mask = attention_mask(h, cache[pattern - 1])
        sliding_mask = attention_mask(h, cache[0], window_size=a.sliding_window) if pattern > 1 else None
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, global_mask if a.is_global(i) else sliding_mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_word_embeddings = False

    def hidden(self, inputs: mx.array, cache=None) -> mx.array:
        return self.model(inputs, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.logits(self.hidden(inputs, cache))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> list:
        return [
            KVCache() if self.args.is_global(i) else RotatingKVCache(max_size=self.args.sliding_window)
            for i in range(self.args.num_hidden_layers)
        ]

    def sanitize(self, weights: dict) -> dict:
        if "lm_head.weight" not in weights:
            self.tie_word_embeddings = True
            self.pop("lm_head")
        return weights
