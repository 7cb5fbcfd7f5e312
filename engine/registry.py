"""Model registry: names mapped to a geometry, a dtype and a quantization.

A registry name is a base geometry plus an optional variant suffix:

    tiny-qwen35          base geometry in its default precision
    tiny-qwen35-f32      float32 weights
    tiny-qwen35-bf16     bfloat16 weights
    tiny-qwen35-4bit     4-bit affine weights, group 64 (bf16 scales)
    tiny-qwen35-8bit     8-bit affine weights, group 64
    tiny-qwen35-4bit-g32 4-bit affine weights, group 32

Tiny and small models default to bf16; GPU geometries default to 4-bit
group 64, the way such models are deployed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import UnknownModelError


@dataclass(frozen=True)
class Quantization:
    bits: int
    group_size: int
    mode: str = "affine"

    def as_config(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


@dataclass(frozen=True)
class Geometry:
    """The shape of a model; the fields are `config.json` keys."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    # qwen3_5 (Gated DeltaNet hybrid)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 1.0
    mtp_num_hidden_layers: int = 0
    # gemma3_text (sliding window + global)
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    query_pre_attn_scalar: int = 0
    rope_local_base_freq: float = 10_000.0
    # qwen2 (biases on q/k/v)
    attention_bias: bool = False

    def layer_kinds(self) -> list[str]:
        """One of 'attention', 'linear' (DeltaNet) or 'sliding' per layer."""
        n = self.num_hidden_layers
        if self.model_type == "qwen3_5":
            k = self.full_attention_interval
            return ["attention" if (i + 1) % k == 0 else "linear" for i in range(n)]
        if self.model_type == "gemma3_text":
            p = self.sliding_window_pattern
            return ["attention" if i % p == p - 1 else "sliding" for i in range(n)]
        return ["attention"] * n


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base: str
    tier: str  # "tiny" | "small" | "gpu" | "draft" | "trained"
    geometry: Geometry
    dtype: str  # "float32" | "bfloat16"
    quantization: Quantization | None
    summary: str

    @property
    def model_type(self) -> str:
        return self.geometry.model_type


@dataclass(frozen=True)
class _Base:
    tier: str
    geometry: Geometry
    summary: str
    default_variant: str
    variants: tuple[str, ...] = field(default=("f32", "bf16", "4bit", "8bit", "4bit-g32"))


_TINY_ATTN = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
    max_position_embeddings=8192,
)

# What every Qwen3.5 text model shares: the tokenizer's vocabulary and the rope settings.
_QWEN35 = dict(
    model_type="qwen3_5",
    vocab_size=248_320,
    max_position_embeddings=262_144,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
_GPU_VARIANTS = ("bf16", "4bit", "8bit")

_BASES: dict[str, _Base] = {
    "tiny-llama": _Base(
        "tiny",
        Geometry(model_type="llama", num_hidden_layers=2, rope_theta=10_000.0, **_TINY_ATTN),
        "dense Llama-style, 2 layers",
        "bf16",
    ),
    "tiny-qwen2": _Base(
        "tiny",
        Geometry(model_type="qwen2", num_hidden_layers=2, attention_bias=True, **_TINY_ATTN),
        "dense with q/k/v biases, 2 layers",
        "bf16",
    ),
    "tiny-qwen3": _Base(
        "tiny",
        Geometry(model_type="qwen3", num_hidden_layers=2, **_TINY_ATTN),
        "dense with q/k norm, 2 layers",
        "bf16",
    ),
    "tiny-qwen35": _Base(
        "tiny",
        Geometry(
            model_type="qwen3_5",
            num_hidden_layers=4,
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=4096,
            max_position_embeddings=8192,
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            mtp_num_hidden_layers=1,
        ),
        "hybrid Gated DeltaNet + gated attention (every 4th layer), 4 layers, MTP head",
        "bf16",
    ),
    "tiny-gemma3": _Base(
        "tiny",
        Geometry(
            model_type="gemma3_text",
            num_hidden_layers=4,
            sliding_window=64,
            sliding_window_pattern=2,
            query_pre_attn_scalar=32,
            **_TINY_ATTN,
        ),
        "sliding-window (64) + global attention, 4 layers",
        "bf16",
    ),
    "small-qwen3": _Base(
        "small",
        Geometry(
            model_type="qwen3",
            hidden_size=512,
            num_hidden_layers=8,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32768,
        ),
        "dense qwen3 benchmark model for the CPU",
        "bf16",
    ),
    "small-qwen35": _Base(
        "small",
        Geometry(
            model_type="qwen3_5",
            hidden_size=512,
            num_hidden_layers=8,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=32768,
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            mtp_num_hidden_layers=1,
        ),
        "hybrid qwen3_5 benchmark model for the CPU",
        "bf16",
    ),
    "qwen27b": _Base(
        "gpu",
        Geometry(
            hidden_size=5120,
            num_hidden_layers=64,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_value_heads=48,
            mtp_num_hidden_layers=1,
            **_QWEN35,
        ),
        "Qwen3.5-27B-like hybrid (true geometry)",
        "4bit",
        _GPU_VARIANTS,
    ),
    "qwen35-0.8b": _Base(
        "gpu",
        Geometry(
            hidden_size=1024,
            num_hidden_layers=24,
            intermediate_size=3584,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            **_QWEN35,
        ),
        "Qwen3.5-0.8B-like draft companion for qwen27b (untied head, see README)",
        "4bit",
        _GPU_VARIANTS,
    ),
    "qwen3-8b": _Base(
        "gpu",
        Geometry(
            model_type="qwen3",
            hidden_size=4096,
            num_hidden_layers=36,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            max_position_embeddings=40_960,
        ),
        "Qwen3-8B-like dense (true geometry)",
        "4bit",
        _GPU_VARIANTS,
    ),
}


# Draft models for speculative decoding. Weights are drawn per (seed, tensor
# name), so a base with the same geometry but fewer layers, synthesized with
# the same seed, holds exactly the target's embedding, first layers, final
# norm and head: an early-exit draft of that target (and its tokenizer, which
# depends only on the vocabulary size and the model type).
def _early_exit(target: str, layers: int, summary: str, **changes: Any) -> _Base:
    base = _BASES[target]
    geometry = replace(base.geometry, num_hidden_layers=layers, mtp_num_hidden_layers=0, **changes)
    return _Base("draft", geometry, summary, base.default_variant, base.variants)


# Trained models (`oracles/train.py`): one tokenizer (a byte-level BPE learned from their training text), weights
# learned from Python's standard library and committed under goldens/trained/, never synthesized.
_TRAINED = dict(vocab_size=4096, max_position_embeddings=8192, num_attention_heads=4, head_dim=64)
_TRAINED_VARIANTS = ("bf16", "4bit")
_BASES.update(
    {
        "trained-qwen35": _Base(
            "trained",
            Geometry(
                model_type="qwen3_5",
                hidden_size=256,
                num_hidden_layers=8,
                intermediate_size=512,
                num_key_value_heads=2,
                rope_theta=10_000_000.0,
                partial_rotary_factor=0.25,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                mtp_num_hidden_layers=1,
                **_TRAINED,
            ),
            "trained hybrid Gated DeltaNet + gated attention, 8 layers, MTP head (target)",
            "bf16",
            _TRAINED_VARIANTS,
        ),
        "trained-qwen3": _Base(
            "trained",
            Geometry(
                model_type="qwen3",
                hidden_size=256,
                num_hidden_layers=6,
                intermediate_size=512,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                **_TRAINED,
            ),
            "trained dense qwen3, 6 layers (target)",
            "bf16",
            _TRAINED_VARIANTS,
        ),
        "trained-qwen3-draft": _Base(
            "trained",
            Geometry(
                model_type="qwen3",
                hidden_size=128,
                num_hidden_layers=2,
                intermediate_size=384,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                **_TRAINED,
            ),
            "trained dense qwen3, 2 layers: the draft of both targets",
            "bf16",
            _TRAINED_VARIANTS,
        ),
    }
)

_BASES.update(
    {
        "tiny-qwen3-draft": _early_exit("tiny-qwen3", 1, "early-exit draft of tiny-qwen3: its first layer"),
        "tiny-qwen35-draft": _early_exit(
            "tiny-qwen35",
            2,
            "draft of tiny-qwen35: its first (DeltaNet) layer, then an attention layer of its own",
            full_attention_interval=2,
        ),
        "small-qwen35-draft": _early_exit(
            "small-qwen35", 4, "early-exit draft of small-qwen35: its first 4 of 8 layers"
        ),
    }
)

_VARIANTS: dict[str, tuple[str, Quantization | None]] = {
    "f32": ("float32", None),
    "bf16": ("bfloat16", None),
    "4bit": ("bfloat16", Quantization(bits=4, group_size=64)),
    "8bit": ("bfloat16", Quantization(bits=8, group_size=64)),
    "4bit-g32": ("bfloat16", Quantization(bits=4, group_size=32)),
}


def _split(name: str) -> tuple[str, str | None]:
    for variant in sorted(_VARIANTS, key=len, reverse=True):
        suffix = "-" + variant
        if name.endswith(suffix) and name[: -len(suffix)] in _BASES:
            return name[: -len(suffix)], variant
    return name, None


def get_spec(name: str) -> ModelSpec:
    """Resolve a registry name (with optional variant suffix) to its spec."""
    base_name, variant = _split(name)
    base = _BASES.get(base_name)
    if base is None:
        known = ", ".join(sorted(_BASES))
        raise UnknownModelError(
            f"unknown model {name!r}; registry bases are: {known} "
            "(add a suffix such as -f32, -bf16, -4bit; or pass --model-path DIR)"
        )
    variant = variant or base.default_variant
    if variant not in base.variants:
        raise UnknownModelError(f"{base_name} has no {variant!r} variant; it has {', '.join(base.variants)}")
    dtype, quant = _VARIANTS[variant]
    canonical = base_name if variant == base.default_variant else f"{base_name}-{variant}"
    return ModelSpec(
        name=canonical,
        base=base_name,
        tier=base.tier,
        geometry=base.geometry,
        dtype=dtype,
        quantization=quant,
        summary=base.summary,
    )


TIERS = ("tiny", "small", "gpu", "draft", "trained")


def all_specs(tiers: tuple[str, ...] = TIERS) -> list[ModelSpec]:
    """Every registry entry, default variant first for each base."""
    specs = []
    for base_name, base in _BASES.items():
        if base.tier not in tiers:
            continue
        ordered = [base.default_variant] + [v for v in base.variants if v != base.default_variant]
        specs.extend(get_spec(f"{base_name}-{v}") for v in ordered)
    return specs


def base_names(tier: str | None = None) -> list[str]:
    return [n for n, b in _BASES.items() if tier is None or b.tier == tier]
