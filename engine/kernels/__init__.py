"""Kernel tiers: which implementation of the hot operations a model runs.

- `exact`: MLX's operations, the graph mlx-lm runs; bit-exact with mlx-lm.
- `fast`: this package's kernels where their gates pass (affine-quantized
  GEMV / small-M GEMM and, for prompt chunks, dequantize + GEMM in
  `quantized_gemv`; chunked Gated DeltaNet prefill in `gated_delta_chunked`;
  the compiled DeltaNet decode step in `gated_delta_decode`, its core one
  CUDA kernel from `gated_delta_step`; the gated-attention decode step in
  `attention_decode`, its attention two CUDA kernels from `attention_step`
  and the rest compiled; in both steps the stages
  `quantized_gemv.FUSE` names inside the GEMV launches); the sums run in
  another order, so results agree with the exact tier to rounding, not bit
  for bit.

The fast tier runs only on MLX's CUDA backend: asked for elsewhere, the model
keeps the exact tier and `KernelSet.reason` says why. `install` changes a
loaded model in place (no copy of its weights) and returns what it did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import attention_decode, quantized_gemv
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.kernels.gated_delta_decode import layer_step, step_kernel_applies
from engine.kernels.norm_handoff import layer_links
from engine.kernels.quantized_gemv import KernelQuantizedLinear, retyped

EXACT, FAST = "exact", "fast"
TIERS = (EXACT, FAST)


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
    fused_stages: str = "none"  # quantized_gemv.FUSE where the GEMV kernel runs (Fusion.names)
    reason: str = ""

    def as_record(self) -> dict:
        return asdict(self)


def check_tier(tier: str) -> None:
    """ValueError for a name that is not a tier."""
    if tier not in TIERS:
        raise ValueError(f"unknown kernel tier {tier!r} (choose from {', '.join(TIERS)})")


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def default_tier() -> str:
    """The tier a server or benchmark runs when none is named."""
    return EXACT


def fast_refusal(force: bool = False) -> Optional[str]:
    """Why the fast tier cannot run here (None when it can)."""
    if force or on_cuda():
        return None
    return f"the fast tier needs MLX's CUDA backend (this process runs on {mx.default_device()})"


def install(model: nn.Module, tier: Optional[str] = None, *, force: bool = False) -> KernelSet:
    """Put `tier`'s implementations into `model` (default: `default_tier()`).

    `force` installs the fast tier off CUDA too, for tests: the chunked
    delta rule is plain MLX and runs anywhere; the quantized layers fall back
    to MLX's operation when not on CUDA.
    """
    tier = tier or default_tier()
    check_tier(tier)
    reason = fast_refusal(force) if tier == FAST else None
    use_fast = tier == FAST and reason is None
    _swap_quantized_linears(model, use_fast, use_kernel=on_cuda())
    deltas, step_kernels, attention_steps, attention_kernels = _set_layer_paths(model, use_fast)
    linears = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear)]
    gemv_layers = sum(q.use_kernel for q in linears)
    return KernelSet(
        tier=FAST if use_fast else EXACT,
        requested=tier,
        quantized_linears=gemv_layers,
        dense_prefill_linears=sum(q.dense_prefill for q in linears),
        chunked_delta_layers=deltas if use_fast else 0,
        step_kernel_layers=step_kernels,
        attention_step_layers=attention_steps,
        attention_kernel_layers=attention_kernels,
        fused_stages=quantized_gemv.FUSE.names() if gemv_layers else "none",
        reason=reason or "",
    )


def _children(module: nn.Module):
    for name, child in module.items():
        if isinstance(child, nn.Module):
            yield module, name, child
        elif isinstance(child, list):
            for i, item in enumerate(child):
                if isinstance(item, nn.Module):
                    yield child, i, item


def replace_modules(module: nn.Module, replace: Callable[[nn.Module], Optional[nn.Module]]) -> None:
    """Walk `module`'s submodules (in lists too), in place: where `replace(child)` returns a module, it takes
    the child's place and the walk does not go into it; where it returns None, the walk goes on inside."""
    for parent, key, child in list(_children(module)):
        new = replace(child)
        if new is None:
            replace_modules(child, replace)
        elif new is not child:
            parent[key] = new


def _swap_quantized_linears(module: nn.Module, fast: bool, use_kernel: bool) -> None:
    """Replace every nn.QuantizedLinear by the kernel form (or back)."""
    def swap(child: nn.Module) -> Optional[nn.Module]:
        if not isinstance(child, nn.QuantizedLinear):
            return None
        is_kernel = isinstance(child, KernelQuantizedLinear)
        if fast and not is_kernel:
            return KernelQuantizedLinear.from_module(child, use_kernel)
        if not fast and is_kernel:
            return retyped(child, nn.QuantizedLinear)
        return child

    replace_modules(module, swap)


def _set_layer_paths(model: nn.Module, fast: bool) -> tuple[int, int, int, int]:
    """The chunked delta rule for prompts and the one-call decode step (its core the CUDA kernel where it
    applies) in every DeltaNet layer, the compiled decode step in every gated-attention layer, or none of
    them; returns how many layers have the chunked rule, how many steps run the kernel and how many
    attention layers have the compiled step, of them how many run the attention kernels."""
    count = kernels = attention = attention_kernels = 0
    links = layer_links(model) if fast else {}
    for _, module in model.named_modules():
        if hasattr(module, "chunked_rule"):
            module.chunked_rule = chunked_gated_delta if fast else None
            count += 1
        if not hasattr(module, "fused_step"):
            continue
        if getattr(module, "is_linear", False):
            kernel = fast and on_cuda() and step_kernel_applies(module)
            module.fused_step = layer_step(module, kernel, links.get(id(module))) if fast else None
            kernels += kernel
        elif fast and attention_decode.applies(module):
            kernel = attention_decode.kernel_applies(module)
            module.fused_step = attention_decode.layer_step(module, kernel, links.get(id(module)))
            attention += 1
            attention_kernels += kernel
        else:
            module.fused_step = None
    return count, kernels, attention, attention_kernels
