"""model_type "qwen3_5": hybrid Gated DeltaNet + gated full attention (Qwen3.5 text).

Every `full_attention_interval`-th layer is gated softmax attention with
partial rotary embeddings; the others are Gated DeltaNet layers (a causal
depthwise conv1d followed by the gated delta rule). The optional MTP head
(multi-token prediction) is loaded when the checkpoint has it, for
speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache, RecurrentCache
from engine.masks import attention_mask, recurrent_mask
from engine.models.activations import precise_swiglu
from engine.models.base import BaseModelArgs, project, scaled_dot_product_attention
from engine.models.dense import MLP
from engine.models.gated_delta import gated_delta_update, normalize_qk
from engine.models.rope import make_rope


@dataclass
class TextModelArgs(BaseModelArgs):
    model_type: str = ""
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    num_key_value_heads: int = 8
    max_position_embeddings: int = 131072
    linear_num_value_heads: int = 64
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 192
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    head_dim: int | None = None
    full_attention_interval: int = 4
    mtp_num_hidden_layers: int = 0
    num_experts: int = 0
    rope_parameters: dict[str, Any] | None = field(
        default_factory=lambda: {"type": "default", "rope_theta": 100000, "partial_rotary_factor": 0.25}
    )
    partial_rotary_factor: float = 0.25
    rope_theta: float = 100000.0
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self):
        if self.num_experts:
            raise ValueError("mixture-of-experts qwen3_5 models are not supported by this engine")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            if "type" not in self.rope_parameters and "rope_type" in self.rope_parameters:
                self.rope_parameters["type"] = self.rope_parameters.pop("rope_type")
            self.partial_rotary_factor = self.rope_parameters.get("partial_rotary_factor", 0.25)
            self.rope_theta = self.rope_parameters.get("rope_theta", 100000.0)
            self.rope_scaling = self.rope_parameters


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict

    @classmethod
    def from_dict(cls, params):
        if "text_config" not in params:
            return cls(model_type=params["model_type"], text_config=params)
        return super().from_dict(params)


class RMSNormGated(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        normed = mx.fast.rms_norm(x, self.weight, self.eps)
        if gate is None:
            return normed.astype(x.dtype)
        return precise_swiglu(x, gate, normed)


class Attention(nn.Module):
    """Softmax attention with q/k norm, partial rope and a sigmoid output gate."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        hd = args.head_dim
        self.scale = hd**-0.5
        self.kv_channels = 2 * self.n_kv_heads * hd  # what a token adds to the cache: keys and values
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd * 2, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = make_rope(int(hd * args.partial_rotary_factor), args.rope_theta, False, args.rope_scaling)
        self.prefill_attention = None  # the fast tier's: scaled_dot_product_attention's contract (engine.kernels)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        q, k, v, gate = self.inputs(x)
        return self.output(self.attend(q, k, v, mask, cache), gate)

    # The stages, for the fast tier's compiled decode step (engine/kernels/attention_decode.py), which
    # compiles the per-token ones around `attend`.
    def inputs(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """q, k, v [B, heads, L, D] (normed, before rope) and the output gate [B, L, heads * D]."""
        return self.heads(*project(x, self.q_proj, self.k_proj, self.v_proj))

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """`inputs` from the three projections [B, L, *]."""
        b, length, _ = q.shape
        q, gate = mx.split(q.reshape(b, length, self.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(b, length, -1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(b, length, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v, gate

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask, cache) -> mx.array:
        """Rope at the cache's offset, the cache update, attention: [B, heads, L, D]."""
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        sdpa = self.prefill_attention or scaled_dot_product_attention
        return sdpa(q, k, v, cache=cache, scale=self.scale, mask=mask)

    def output(self, out: mx.array, gate: mx.array) -> mx.array:
        return self.o_proj(self.gated(out, gate))

    def gated(self, out: mx.array, gate: mx.array) -> mx.array:
        """The attention output [B, heads, L, D] as o_proj's input [B, L, heads * D], gated."""
        b, _, length, _ = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b, length, -1) * mx.sigmoid(gate)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.num_v_heads = args.linear_num_value_heads
        self.num_k_heads = args.linear_num_key_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads {self.num_v_heads} must be a multiple of num_k_heads {self.num_k_heads}")
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size, groups=self.conv_dim, padding=0, bias=False
        )
        h = args.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.zeros(self.num_v_heads)
        self.norm = RMSNormGated(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        # The fast tier's replacements, set by engine.kernels.install (None: the exact path).
        self.chunked_rule = None
        self.state_dtype = mx.float32  # the recurrent state's dtype (mlx-lm's; the fast tier may set bfloat16)

    def state_bytes(self, itemsize: int) -> int:
        """Bytes a row's cache of this layer holds: the conv tail (activations) and the state."""
        conv = (self.conv_kernel_size - 1) * self.conv_dim * itemsize
        return conv + self.num_v_heads * self.head_v_dim * self.head_k_dim * self.state_dtype.size

    def input_projections(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """qkv, z, beta logits and a, in this order (mlx-lm's)."""
        return project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        qkv, z, beta_logits, a = self.input_projections(x)
        if cache is None:
            q, k, v, _, _ = self.conv_heads(qkv, None, mask)
            return self.out_proj(self.gated_norm(self.rule(q, k, v, a, beta_logits, None, mask)[0], z))
        s = x.shape[1]
        ends = None if cache.lengths is None else mx.clip(mx.array(cache.lengths), 0, s)
        q, k, v, conv_input, cache[0] = self.conv_heads(qkv, cache[0], mask, ends)
        trace = cache.trace.states if cache.trace is not None else None
        marks = cache.marks.states if cache.marks is not None else None
        out, cache[1] = self.rule(q, k, v, a, beta_logits, cache[1], mask, trace, marks)
        if cache.trace is not None:
            cache.trace.record_conv(conv_input, s)
        if cache.marks is not None:
            cache.marks.conv_input = conv_input
        cache.advance(s)
        return self.out_proj(self.gated_norm(out, z))

    # The stages between the projections, for the fast tier's compiled prompt chunk
    # (engine/kernels/gated_delta_prefill.py), which compiles those around the rule with the layer's other parts.
    def conv_heads(
        self, qkv: mx.array, conv_state: mx.array | None, mask=None, ends=None
    ) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
        """The causal conv over [conv_state; qkv] (None: zeros) and its output as the rule's q, k [B, L, Hk,
        Dk] (normalized) and v [B, L, Hv, Dv]; `mask` [B, L] marks each row's real tokens, `ends` [B] (None:
        L) each row's count of them, after which its next conv state is taken. Returns (q, k, v, the conv
        input, the next conv state)."""
        b, s, _ = qkv.shape
        keep = self.conv_kernel_size - 1
        if conv_state is None:
            conv_state = mx.zeros((b, keep, self.conv_dim), dtype=qkv.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if ends is not None:
            next_conv = mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(keep))[..., None], axis=1)
        else:
            next_conv = mx.contiguous(conv_input[:, -keep:, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(b, s, heads, dim)
            for t, heads, dim in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        return q, k, v, conv_input, next_conv

    def rule(self, q, k, v, a, beta_logits, state, mask=None, trace=None, marks=None) -> tuple[mx.array, mx.array]:
        """The gated delta rule from `state` (None: zeros in `state_dtype`): (y [B, L, Hv, Dv], next state);
        `trace` and `marks` as `gated_delta_update` takes them."""
        rules = dict(trace=trace, chunked=self.chunked_rule, state_dtype=self.state_dtype, marks=marks)
        return gated_delta_update(q, k, v, a, beta_logits, self.A_log, self.dt_bias, state, mask, **rules)

    def gated_norm(self, y: mx.array, z: mx.array) -> mx.array:
        """The rule's output gated by z [B, L, value_dim] and normed: the output projection's input."""
        b, s = z.shape[:2]
        return self.norm(y, z.reshape(b, s, self.num_v_heads, self.head_v_dim)).reshape(b, s, -1)


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, is_linear: bool):
        super().__init__()
        self.is_linear = is_linear
        if is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        # The fast tier's compiled decode step of the layer, set by engine.kernels.install (None: the exact
        # path); it returns None where it does not apply.
        self.fused_step = None

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.fused_step is not None:
            h = self.fused_step(x, mask, cache)
            if h is not None:
                return h
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextBody(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        k = args.full_attention_interval
        self.layers = [DecoderLayer(args, is_linear=(i + 1) % k != 0) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ssm_idx = 0
        self.fa_idx = k - 1

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        fa_mask = attention_mask(h, cache[self.fa_idx])
        ssm_mask = recurrent_mask(h, cache[self.ssm_idx])
        for layer, c in zip(self.layers, cache):
            h = layer(h, ssm_mask if layer.is_linear else fa_mask, c)
        return self.norm(h)


class MTPHead(nn.Module):
    """Multi-token prediction: from the target's hidden state at position t and
    the embedding of token t+1, predict token t+2 with one extra decoder layer."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, is_linear=False) for _ in range(args.mtp_num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        x = mx.concatenate([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        cache = cache or [None] * len(self.layers)
        mask = attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)


class TextModel(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model = TextBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.mtp_num_hidden_layers:
            self.mtp = MTPHead(args)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)


_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    ".pre_fc_norm_embedding.weight",
    ".pre_fc_norm_hidden.weight",
)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = TextModel(TextModelArgs.from_dict(args.text_config))

    @property
    def text_args(self) -> TextModelArgs:
        return self.language_model.args

    def hidden(self, inputs: mx.array, cache=None) -> mx.array:
        return self.language_model.model(inputs, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.language_model.logits(hidden)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.logits(self.hidden(inputs, cache))

    @property
    def layers(self):
        return self.language_model.model.layers

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.language_model

    def make_cache(self) -> list:
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.layers]

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for key, value in weights.items():
            if key.startswith(("vision_tower", "model.visual")):
                continue
            if key.startswith("model.language_model"):
                key = key.replace("model.language_model", "language_model.model")
            elif not key.startswith("language_model."):
                key = "language_model." + key
            out[key] = value
        if self.text_args.tie_word_embeddings:
            out.pop("language_model.lm_head.weight", None)
        if self.has_mtp and not any(k.startswith("language_model.mtp.") for k in out):
            self.language_model.pop("mtp")  # a checkpoint converted without its MTP head
        # Hugging Face layout: conv1d as [C, 1, K] and norms stored as (w - 1).
        hf_layout = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in out.items())
        for key, value in list(out.items()):
            if "conv1d.weight" in key and value.shape[-1] != 1:
                out[key] = value.moveaxis(2, 1)
            if hf_layout and value.ndim == 1 and key.endswith(_NORM_SUFFIXES):
                out[key] = value + 1.0
        return out
