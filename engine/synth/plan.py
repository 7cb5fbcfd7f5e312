"""What a synthetic artifact contains: its config.json and its tensor list.

The tensor names and shapes are mlx-lm's on-disk layout (what
`mlx_lm.convert` saves after `sanitize`), written down here per family and
independently of the engine's model code, so that loading an artifact with
`mlx_lm.load(strict=True)` checks both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.registry import Geometry, ModelSpec

# Roles decide how a tensor's values are drawn (see weights.py).
LINEAR = "linear"  # a projection that does not write into the residual stream
WRITER = "writer"  # a projection whose output is added to the residual stream
EMBED = "embed"
HEAD = "head"
NORM = "norm"  # RMSNorm weight, multiplies (1.0 is identity)
NORM_OFFSET = "norm_offset"  # gemma RMSNorm weight, used as (1 + w)
FINAL_NORM = "final_norm"
FINAL_NORM_OFFSET = "final_norm_offset"
CONV = "conv"
A_LOG = "a_log"
DT_BIAS = "dt_bias"
BIAS = "bias"

_MATRIX_ROLES = (LINEAR, WRITER, EMBED, HEAD)


@dataclass(frozen=True)
class TensorPlan:
    name: str  # without the ".weight" suffix for matrices
    shape: tuple[int, ...]
    role: str
    dtype: str  # "float32" | "bfloat16"

    @property
    def is_matrix(self) -> bool:
        return self.role in _MATRIX_ROLES


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
}


def model_config(spec: ModelSpec, eos_ids: list[int]) -> dict[str, Any]:
    """config.json for the spec, in the shape mlx-lm and transformers expect."""
    g = spec.geometry
    common: dict[str, Any] = {
        "hidden_size": g.hidden_size,
        "num_hidden_layers": g.num_hidden_layers,
        "intermediate_size": g.intermediate_size,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "vocab_size": g.vocab_size,
        "rms_norm_eps": g.rms_norm_eps,
        "max_position_embeddings": g.max_position_embeddings,
        "tie_word_embeddings": g.tie_word_embeddings,
        "eos_token_id": eos_ids[0],
    }
    if g.model_type == "qwen3_5":
        text = dict(common)
        text.update(
            model_type="qwen3_5_text",
            linear_num_key_heads=g.linear_num_key_heads,
            linear_num_value_heads=g.linear_num_value_heads,
            linear_key_head_dim=g.linear_key_head_dim,
            linear_value_head_dim=g.linear_value_head_dim,
            linear_conv_kernel_dim=g.linear_conv_kernel_dim,
            full_attention_interval=g.full_attention_interval,
            attention_bias=False,
            attn_output_gate=True,
            mtp_num_hidden_layers=g.mtp_num_hidden_layers,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": g.rope_theta,
                "partial_rotary_factor": g.partial_rotary_factor,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            layer_types=["full_attention" if k == "attention" else "linear_attention" for k in g.layer_kinds()],
        )
        config: dict[str, Any] = {
            "model_type": "qwen3_5",
            "text_config": text,
            "tie_word_embeddings": g.tie_word_embeddings,
            "eos_token_id": eos_ids[0],
        }
    elif g.model_type == "gemma3_text":
        config = dict(common)
        config.update(
            model_type="gemma3_text",
            rope_theta=g.rope_theta,
            rope_local_base_freq=g.rope_local_base_freq,
            query_pre_attn_scalar=g.query_pre_attn_scalar,
            sliding_window=g.sliding_window,
            sliding_window_pattern=g.sliding_window_pattern,
            layer_types=["full_attention" if k == "attention" else "sliding_attention" for k in g.layer_kinds()],
            hidden_activation="gelu_pytorch_tanh",
        )
    else:
        config = dict(common)
        config.update(model_type=g.model_type, rope_theta=g.rope_theta)
        if g.model_type == "llama":
            config.update(attention_bias=False, mlp_bias=False)
    config["architectures"] = [ARCHITECTURES[g.model_type]]
    config["torch_dtype"] = spec.dtype
    if spec.quantization is not None:
        config["quantization"] = spec.quantization.as_config()
        config["quantization_config"] = spec.quantization.as_config()
    return dict(sorted(config.items()))


def _attention(prefix: str, g: Geometry, dtype: str, *, gated: bool, qk_norm: bool, norm: str) -> list[TensorPlan]:
    q_out = g.num_attention_heads * g.head_dim * (2 if gated else 1)
    kv_out = g.num_key_value_heads * g.head_dim
    plans = [
        TensorPlan(f"{prefix}.q_proj", (q_out, g.hidden_size), LINEAR, dtype),
        TensorPlan(f"{prefix}.k_proj", (kv_out, g.hidden_size), LINEAR, dtype),
        TensorPlan(f"{prefix}.v_proj", (kv_out, g.hidden_size), LINEAR, dtype),
        TensorPlan(f"{prefix}.o_proj", (g.hidden_size, g.num_attention_heads * g.head_dim), WRITER, dtype),
    ]
    if g.attention_bias:
        plans += [
            TensorPlan(f"{prefix}.q_proj.bias", (q_out,), BIAS, dtype),
            TensorPlan(f"{prefix}.k_proj.bias", (kv_out,), BIAS, dtype),
            TensorPlan(f"{prefix}.v_proj.bias", (kv_out,), BIAS, dtype),
        ]
    if qk_norm:
        plans += [
            TensorPlan(f"{prefix}.q_norm.weight", (g.head_dim,), norm, dtype),
            TensorPlan(f"{prefix}.k_norm.weight", (g.head_dim,), norm, dtype),
        ]
    return plans


def _mlp(prefix: str, g: Geometry, dtype: str) -> list[TensorPlan]:
    h, i = g.hidden_size, g.intermediate_size
    return [
        TensorPlan(f"{prefix}.gate_proj", (i, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.up_proj", (i, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.down_proj", (h, i), WRITER, dtype),
    ]


def _gated_deltanet(prefix: str, g: Geometry, dtype: str) -> list[TensorPlan]:
    h = g.hidden_size
    key_dim = g.linear_num_key_heads * g.linear_key_head_dim
    value_dim = g.linear_num_value_heads * g.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    nv = g.linear_num_value_heads
    return [
        TensorPlan(f"{prefix}.in_proj_qkv", (conv_dim, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.in_proj_z", (value_dim, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.in_proj_b", (nv, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.in_proj_a", (nv, h), LINEAR, dtype),
        TensorPlan(f"{prefix}.conv1d.weight", (conv_dim, g.linear_conv_kernel_dim, 1), CONV, dtype),
        TensorPlan(f"{prefix}.dt_bias", (nv,), DT_BIAS, dtype),
        # Real checkpoints keep A_log in float32 and mlx-lm never casts it.
        TensorPlan(f"{prefix}.A_log", (nv,), A_LOG, "float32"),
        TensorPlan(f"{prefix}.norm.weight", (g.linear_value_head_dim,), NORM, dtype),
        TensorPlan(f"{prefix}.out_proj", (h, value_dim), WRITER, dtype),
    ]


def _layer_norms(prefix: str, g: Geometry, dtype: str, names: tuple[str, ...], role: str) -> list[TensorPlan]:
    return [TensorPlan(f"{prefix}.{n}.weight", (g.hidden_size,), role, dtype) for n in names]


def tensor_plan(spec: ModelSpec) -> list[TensorPlan]:
    """Every tensor of the artifact, before quantization, sorted by name."""
    g, dtype = spec.geometry, spec.dtype
    mt = g.model_type
    root = "language_model." if mt == "qwen3_5" else ""
    model = f"{root}model"
    is_gemma = mt == "gemma3_text"
    norm_role = NORM_OFFSET if is_gemma else NORM
    norm_names = ("input_layernorm", "post_attention_layernorm")
    if is_gemma:
        norm_names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")

    plans = [
        TensorPlan(f"{model}.embed_tokens", (g.vocab_size, g.hidden_size), EMBED, dtype),
        TensorPlan(f"{model}.norm.weight", (g.hidden_size,), FINAL_NORM_OFFSET if is_gemma else FINAL_NORM, dtype),
    ]
    if not g.tie_word_embeddings:
        plans.append(TensorPlan(f"{root}lm_head", (g.vocab_size, g.hidden_size), HEAD, dtype))
    for i, kind in enumerate(g.layer_kinds()):
        p = f"{model}.layers.{i}"
        if kind == "linear":
            plans += _gated_deltanet(f"{p}.linear_attn", g, dtype)
        else:
            plans += _attention(
                f"{p}.self_attn",
                g,
                dtype,
                gated=mt == "qwen3_5",
                qk_norm=mt != "llama" and mt != "qwen2",
                norm=norm_role,
            )
        plans += _mlp(f"{p}.mlp", g, dtype)
        plans += _layer_norms(p, g, dtype, norm_names, norm_role)
    if mt == "qwen3_5" and g.mtp_num_hidden_layers:
        mtp = f"{root}mtp"
        plans.append(TensorPlan(f"{mtp}.fc", (g.hidden_size, 2 * g.hidden_size), LINEAR, dtype))
        plans += _layer_norms(mtp, g, dtype, ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"), NORM)
        for i in range(g.mtp_num_hidden_layers):
            p = f"{mtp}.layers.{i}"
            plans += _attention(f"{p}.self_attn", g, dtype, gated=True, qk_norm=True, norm=NORM)
            plans += _mlp(f"{p}.mlp", g, dtype)
            plans += _layer_norms(p, g, dtype, norm_names, NORM)
    return sorted(plans, key=lambda t: t.name)
