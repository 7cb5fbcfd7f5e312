"""Kernel tiers: which implementation of the hot operations a model runs.

- `exact`: MLX's operations, the graph mlx-lm runs; bit-exact with mlx-lm.
- `fast`: this package's kernels where they apply: the affine-quantized GEMV
  (`quantized_gemv`, prompt chunks as dequantize + GEMM), the chunked Gated
  DeltaNet prefill (`gated_delta_chunked`), the compiled DeltaNet decode step
  (`gated_delta_decode`, its core one CUDA kernel from `gated_delta_step`),
  the gated-attention decode step (`attention_decode`, its attention CUDA
  kernels from `attention_step`) and, where asked for, prompt chunks'
  attention as one CUDA launch (`attention_prefill`). Sums run in another
  order, so results agree with the exact tier to rounding, not bit for bit;
  the tier is judged against a float32 reference forward (`harness kernels
  --gate-model`).
- `auto`: `fast` on CUDA for the model families in `GATE_PASSED`, `exact`
  elsewhere.

The fast tier runs only on MLX's CUDA backend: asked for elsewhere, the model
keeps the exact tier and `KernelSet.reason` says why. `install` changes a
loaded model in place (no copy of its weights) and returns what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import attention_decode, attention_prefill, gated_delta_prepare, gated_delta_states
from engine.kernels.config import AUTO, EXACT, FAST, TIERS, KernelConfig, Tier, check_tier
from engine.kernels.cuda_source import BUILDS, KernelBuilds
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.kernels.gated_delta_decode import layer_step, step_kernel_applies
from engine.kernels.norm_handoff import layer_links
from engine.kernels.quantized_gemv import KernelQuantizedLinear, retyped, run_kernel
from engine.kernels.quantized_gemv.dense import preferring_dense

__all__ = [
    "AUTO",
    "EXACT",
    "FAST",
    "GATE_PASSED",
    "TIERS",
    "KernelConfig",
    "KernelSet",
    "Tier",
    "check_tier",
    "install",
    "on_cuda",
    "replace_modules",
    "resolve_tier",
]

# Model families (config.json model_type) whose fast tier passed the numerics gate on CUDA, with the run that
# shows it: `auto` runs the fast tier for these.
GATE_PASSED: dict[str, str] = {"qwen3_5": "qwen27b at 1 and 8 rows on an H200, reports/gpu/qwen27b-gate.json"}


@dataclass(frozen=True)
class KernelSet:
    """What `install` put in place: the tier that runs and where."""

    tier: str
    requested: str
    quantized_linears: int = 0  # layers that run the GEMV kernel (0 off CUDA)
    dense_prefill_linears: int = 0  # layers that run prompt chunks as dequantize + GEMM (0 off CUDA)
    chunked_delta_layers: int = 0
    step_kernel_layers: int = 0  # DeltaNet layers whose decode core is the CUDA kernel (0 off CUDA)
    attention_step_layers: int = 0  # gated-attention layers with the compiled decode step
    attention_kernel_layers: int = 0  # of them, those whose attention runs attention_step's kernels (0 off CUDA)
    prefill_attention_layers: int = 0  # attention layers whose prompt chunks run attention_prefill's kernel
    fused_stages: str = "none"  # the GEMV launches' stages where the kernel runs (Fusion.names)
    reason: str = ""  # why this tier runs, where it is not simply the one asked for
    settings: dict = field(default_factory=dict)  # KernelConfig.settings() of the fast tier that runs

    @property
    def builds(self) -> KernelBuilds:
        """The builds its CUDA kernels asked MLX for, and their kernel cache: the process's, as MLX compiles a
        custom kernel once a process (not a field: a record of the set holds none of it)."""
        return BUILDS

    def as_record(self) -> dict:
        return asdict(self)


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def fast_refusal(force: bool = False) -> str | None:
    """Why the fast tier cannot run here (None when it can)."""
    if force or on_cuda():
        return None
    return f"the fast tier needs MLX's CUDA backend (this process runs on {mx.default_device()})"


def resolve_tier(
    config: KernelConfig, family: str | None = None, passed: Mapping[str, str] = GATE_PASSED
) -> tuple[str, str]:
    """The tier that runs for `config` on a model of `family` (its model_type) here, and why; `auto` takes the
    fast tier for the families in `passed`."""
    if config.tier == EXACT:
        return EXACT, ""
    refusal = fast_refusal(config.force)
    if config.tier == FAST:
        return (EXACT, refusal) if refusal else (FAST, "")
    if refusal:
        return EXACT, f"auto: exact, {refusal}"
    if family not in passed:
        return EXACT, f"auto: exact, no fast-tier numerics gate has passed for {family or 'this model'}"
    return FAST, f"auto: fast, its numerics gate passed for {family} ({passed[family]})"


def install(model: nn.Module, config: KernelConfig = KernelConfig(), family: str | None = None) -> KernelSet:
    """Put the implementations of the tier `config` resolves to into `model`, in place.

    `family`: the model's model_type, which `auto` looks up in `GATE_PASSED`.
    """
    tier, reason = resolve_tier(config, family)
    fast = tier == FAST
    stand_in = config.gemv_stand_in
    use_kernel = on_cuda() or stand_in is not None
    _swap_quantized_linears(model, config if fast else None, use_kernel, stand_in or run_kernel)
    paths = _set_layer_paths(model, config if fast else None)
    linears = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear)]
    gemv_layers = sum(q.use_kernel for q in linears)
    return KernelSet(
        tier=tier,
        requested=config.tier,
        quantized_linears=gemv_layers,
        dense_prefill_linears=sum(q.dense_prefill for q in linears),
        **paths,
        fused_stages=config.fusion.names() if gemv_layers else "none",
        reason=reason,
        settings=config.settings() if fast else {},
    )


def _children(module: nn.Module):
    for name, child in module.items():
        if isinstance(child, nn.Module):
            yield module, name, child
        elif isinstance(child, list):
            for i, item in enumerate(child):
                if isinstance(item, nn.Module):
                    yield child, i, item


def replace_modules(module: nn.Module, replace: Callable[[nn.Module], nn.Module | None]) -> None:
    """Walk `module`'s submodules (in lists too), in place: where `replace(child)` returns a module, it takes
    the child's place and the walk does not go into it; where it returns None, the walk goes on inside."""
    for parent, key, child in list(_children(module)):
        new = replace(child)
        if new is None:
            replace_modules(child, replace)
        elif new is not child:
            parent[key] = new


def _swap_quantized_linears(module: nn.Module, config: KernelConfig | None, use_kernel: bool, launch) -> None:
    """Every nn.QuantizedLinear as the kernel form with `config`'s settings (None: back to MLX's)."""
    if config is not None and config.dense_decode_rows:
        launch = preferring_dense(launch, config.dense_decode_rows)

    def swap(child: nn.Module) -> nn.Module | None:
        if not isinstance(child, nn.QuantizedLinear):
            return None
        if isinstance(child, KernelQuantizedLinear):
            child = retyped(child, nn.QuantizedLinear)
            child.__dict__.pop("kept", None)  # a kept dense copy goes with the kernel form
        if config is None:
            return child
        return KernelQuantizedLinear.from_module(
            child,
            use_kernel,
            min_outputs=config.gemv_min_outputs,
            dense_min_rows=config.dense_min_rows,
            launches=config.launches,
            layouts=config.staged_layouts,
            launch=launch,
            keep_dense=config.keep_dense,
            dequant_kernel=config.dequant_kernel,
        )

    replace_modules(module, swap)
    kept = [m.kept.weight for _, m in module.named_modules() if getattr(m, "kept", None) is not None]
    mx.eval(kept)  # made at load: the memory they take shows before the first request


def chunked_rule(module: nn.Module, config: KernelConfig):
    """The chunked delta rule a DeltaNet layer's prompt chunks run: its chunk-after-chunk states and its chunk-local
    part each as one CUDA launch (`gated_delta_states`, `gated_delta_prepare`) where that runs the layer's heads and
    `config` asks for it, else as MLX operations."""
    dk, dv = module.head_k_dim, module.head_v_dim
    kernels = {}
    if on_cuda() and config.chunk_states_kernel and gated_delta_states.column_block(dk, dv):
        kernels["states"] = gated_delta_states.chunk_states
    if on_cuda() and config.chunk_prepare_kernel and gated_delta_prepare.fits(dk, dv):
        kernels["prepare"] = gated_delta_prepare.chunk_prepare
    return partial(chunked_gated_delta, **kernels) if kernels else chunked_gated_delta


def _set_layer_paths(model: nn.Module, config: KernelConfig | None) -> dict[str, int]:
    """The chunked delta rule for prompts and the one-call decode step (its core the CUDA kernel where it
    applies) in every DeltaNet layer, the compiled decode step in every gated-attention layer (its attention
    the CUDA kernels where they apply) and its prompt chunks' attention kernel where asked for, or none of them
    (config None); the counts for `KernelSet`."""
    counts = dict(
        chunked_delta_layers=0,
        step_kernel_layers=0,
        attention_step_layers=0,
        attention_kernel_layers=0,
        prefill_attention_layers=0,
    )
    links = layer_links(model) if config else {}
    for _, module in model.named_modules():
        if hasattr(module, "prefill_attention"):
            kernel = config is not None and config.prefill_attention_kernel and on_cuda()
            module.prefill_attention = attention_prefill.attention if kernel else None
            counts["prefill_attention_layers"] += kernel
        if hasattr(module, "chunked_rule"):
            module.chunked_rule = chunked_rule(module, config) if config else None
            module.state_dtype = getattr(mx, config.state_dtype if config else "float32")
            counts["chunked_delta_layers"] += config is not None
        if not hasattr(module, "fused_step"):
            continue
        module.fused_step = None
        if config is None:
            continue
        link = links.get(id(module))
        if getattr(module, "is_linear", False):
            kernel = config.delta_step_kernel and on_cuda() and step_kernel_applies(module)
            module.fused_step = layer_step(
                module, config.fusion, kernel, link, config.compiled_prefill, config.scan_tokens
            )
            counts["step_kernel_layers"] += kernel
        elif config.attention_step and attention_decode.applies(module):
            kernel = config.attention_kernels and attention_decode.kernel_applies(module)
            prefill = config.compiled_prefill
            module.fused_step = attention_decode.layer_step(
                module, config.fusion, kernel, link, prefill, config.attention_group_rows
            )
            counts["attention_step_layers"] += 1
            counts["attention_kernel_layers"] += kernel
    return counts
