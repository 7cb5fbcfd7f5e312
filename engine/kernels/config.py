"""Every setting of the kernel tiers, as one value built once and passed to `engine.kernels.install`.

The command line gives the tier (`--kernels`); two documented environment
variables give the GEMV's fused stages and one-row launch shapes
(`KernelConfig.from_env`), for tuning runs. What ran is recorded with every
result (`KernelSet.settings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from engine import env
from engine.kernels.quantized_gemv import (
    DEFAULT_FUSION,
    DENSE_MIN_ROWS,
    LAYER_MIN_OUTPUTS,
    Fusion,
    LaunchConfig,
    StagedLayouts,
    launches_setting,
    parse_launches,
)
from engine.kernels.quantized_gemv.layer import Launch


class Tier(str, Enum):
    """A kernel tier by name (`KernelConfig.tier`); equal to its string, and printed as it."""

    AUTO = "auto"
    EXACT = "exact"
    FAST = "fast"

    def __str__(self) -> str:
        return self.value


EXACT, FAST, AUTO = Tier.EXACT, Tier.FAST, Tier.AUTO
TIERS = tuple(t.value for t in Tier)


STATE_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
)  # the recurrent state's dtypes on the fast tier (`KernelConfig.state_dtype`)
# The fast tier's default: its gate over 1,024 steps passed on qwen27b (8 rows) and trained-qwen35 (1 and 8 rows),
# and it takes 0.93-0.99x float32's steps on the H200 (docs/kernels.md, "The state's dtype")
DEFAULT_STATE_DTYPE = "float16"


def check_tier(tier: str) -> None:
    """ValueError for a name that is not a tier."""
    if tier not in TIERS:
        raise ValueError(f"unknown kernel tier {tier!r} (choose from {', '.join(TIERS)})")


@dataclass(frozen=True)
class KernelConfig:
    """The kernel tier and the fast tier's settings.

    `tier`: `exact` (MLX's operations, bit-exact with mlx-lm), `fast` (the engine's CUDA kernels) or `auto` (fast where
    it runs and its numerics gate passed for the model's family, else exact). The rest only matter to the fast tier: the
    stages inside the GEMV launches, one-row launch shapes by (rows, K) in place of the measured table, the staged
    launches' layouts by row count in place of `staged_config`'s, which decode kernels run, whether the chunked DeltaNet
    prefill runs its chunk-after-chunk states and its chunk-local part each as one CUDA launch a layer, whether prompt
    chunks run their causal attention as one CUDA launch a layer (`attention_prefill`), the prompt-chunk
    rows from which a layer dequantizes and runs one GEMM (None: never), the fewest output rows a matrix needs for the
    GEMV, the dtype the DeltaNet layers keep their recurrent state in (the exact tier keeps mlx-lm's float32), whether a
    prompt chunk runs each layer as compiled calls (as a decode step does) rather than operation by operation, up to how
    many tokens a verify window or prompt chunk runs each DeltaNet layer's core as one launch of the scan kernel (0:
    off), whether the dense prompt chunks' dequantized weights are made once and kept (the memory of every such weight
    in its scales' dtype) instead of made anew each chunk, whether they are made by the engine's dequantization kernel
    (the same values as MLX's) instead of MLX's, and from how many rows a launch whose layers keep such copies
    multiplies them instead of the quantized weights (`quantized_gemv.dense`; 0: never).
    `force` (tests only, no command line sets it) installs the fast tier off CUDA, where the quantized
    layers run MLX's operation; `gemv_stand_in` (tests only) computes every GEMV launch instead of the
    kernel, on any backend, as `quantized_gemv.run_kernel` is called.
    """

    tier: str = AUTO
    fusion: Fusion = DEFAULT_FUSION
    launches: Mapping[tuple[int, int], LaunchConfig] = field(default_factory=dict)
    staged_layouts: StagedLayouts = StagedLayouts()  # the staged launches (2-64 rows) changed by row count
    delta_step_kernel: bool = True  # a DeltaNet decode step's core as one CUDA kernel
    chunk_states_kernel: bool = True  # the chunked prefill's chunk-after-chunk states as one CUDA launch a layer
    chunk_prepare_kernel: bool = False  # its chunk-local part as one CUDA launch a layer
    prefill_attention_kernel: bool = False  # prompt chunks' causal attention as one CUDA launch a layer
    attention_step: bool = True  # the compiled decode step of gated-attention layers
    attention_kernels: bool = True  # that step's attention as CUDA kernels
    attention_group_rows: int = 0  # from this many rows those kernels take a kv head's q heads a block (0: never)
    dense_min_rows: int | None = DENSE_MIN_ROWS
    gemv_min_outputs: int = LAYER_MIN_OUTPUTS
    state_dtype: str = DEFAULT_STATE_DTYPE
    compiled_prefill: bool = False  # a prompt chunk's layers as compiled calls (gated_delta_prefill)
    scan_tokens: int = 0  # verify windows and prompt chunks up to this many tokens: one DeltaNet core launch
    keep_dense: bool = False  # the dense path's dequantized weights made once and kept (2 bytes a weight more)
    keep_dense_auto: bool = False  # engine serve keeps as many copies as the memory its warm-up leaves (kept.py)
    dequant_kernel: bool = False  # the dense path's weights dequantized by engine.kernels.dequantize (CUDA)
    dense_decode_rows: int = 0  # from this many rows a launch whose layers keep dense copies runs on them (0: never)
    force: bool = False
    gemv_stand_in: Launch | None = field(default=None, compare=False)

    def __post_init__(self):
        check_tier(self.tier)
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"unknown state dtype {self.state_dtype!r} (choose from {', '.join(STATE_DTYPES)})")
        if self.dense_decode_rows < 0:
            raise ValueError(f"dense decode rows must be 0 (never) or more, got {self.dense_decode_rows}")
        if self.dense_decode_rows and not (self.keep_dense or self.keep_dense_auto):
            raise ValueError(
                "dense decode rows (--dense-decode-rows, ENGINE_DENSE_DECODE_ROWS) need kept dense copies "
                "(--dense-copies all or auto, ENGINE_KEEP_DENSE=1 or auto)"
            )

    @classmethod
    def from_env(cls, tier: str = AUTO, environ: Mapping[str, str] = os.environ) -> KernelConfig:
        """`tier` with ENGINE_FUSE (stages, comma-separated, or `none`), ENGINE_GEMV_LAUNCH
        ('ROWSxK=W,RT,U[,MINB];...'), ENGINE_STAGED_LAYOUT ('[ROWS:]KEY=VALUE,...;...'), ENGINE_COMPILED_PREFILL,
        ENGINE_CHUNK_STATES_KERNEL, ENGINE_CHUNK_PREPARE_KERNEL and ENGINE_PREFILL_ATTENTION_KERNEL (0 or 1),
        ENGINE_SCAN_TOKENS (a count), ENGINE_KEEP_DENSE (0, 1 or auto), ENGINE_DEQUANT_KERNEL (0 or 1),
        ENGINE_DENSE_DECODE_ROWS and ENGINE_ATTENTION_GROUP_ROWS (counts) where they are set; ValueError for a value
        they cannot take."""
        fuse, launch, layouts = env.fuse_stages(environ), env.gemv_launch(environ), env.staged_layout(environ)
        keep = env.keep_dense(environ)
        return cls(
            tier=tier,
            fusion=DEFAULT_FUSION if fuse is None else Fusion.parse(fuse),
            launches=parse_launches(launch or ""),
            staged_layouts=StagedLayouts.parse(layouts or ""),
            compiled_prefill=bool(env.compiled_prefill(environ)),
            scan_tokens=env.scan_tokens(environ) or 0,
            keep_dense=keep == "1",
            keep_dense_auto=keep == "auto",
            dequant_kernel=bool(env.dequant_kernel(environ)),
            chunk_states_kernel=env.chunk_states_kernel(environ) is not False,
            chunk_prepare_kernel=bool(env.chunk_prepare_kernel(environ)),
            prefill_attention_kernel=bool(env.prefill_attention_kernel(environ)),
            dense_decode_rows=env.dense_decode_rows(environ) or 0,
            attention_group_rows=env.attention_group_rows(environ) or 0,
        )

    def settings(self) -> dict:
        """The fast tier's settings by name, for records."""
        return {
            "fusion": self.fusion.names(),
            "launches": launches_setting(self.launches),
            "staged_layouts": self.staged_layouts.text(),
            "delta_step_kernel": self.delta_step_kernel,
            "chunk_states_kernel": self.chunk_states_kernel,
            "chunk_prepare_kernel": self.chunk_prepare_kernel,
            "prefill_attention_kernel": self.prefill_attention_kernel,
            "attention_step": self.attention_step,
            "attention_kernels": self.attention_kernels,
            "attention_group_rows": self.attention_group_rows,
            "dense_min_rows": self.dense_min_rows,
            "gemv_min_outputs": self.gemv_min_outputs,
            "state_dtype": self.state_dtype,
            "compiled_prefill": self.compiled_prefill,
            "scan_tokens": self.scan_tokens,
            "keep_dense": "auto" if self.keep_dense_auto else self.keep_dense,
            "dequant_kernel": self.dequant_kernel,
            "dense_decode_rows": self.dense_decode_rows,
        }
