"""The few environment variables the project reads, parsed in one place.

Every benchmark run records `snapshot()` so a result can be traced to the
settings it ran under.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PROJECT = "engine-harness"

_VARS = {
    "ENGINE_HARNESS_CACHE": "where synthesized models live (default ~/.cache/engine-harness)",
    "ENGINE_API_KEY": "the key `engine serve` requires when --api-key is not given (recorded redacted)",
    "ENGINE_FUSE": "the fast tier's stages inside its GEMV launches, comma-separated (residual, gated, norm_scale, "
    "norm_out; 'none'), in place of the default residual,gated,norm_out (KernelConfig.fusion)",
    "ENGINE_COMPILED_PREFILL": "'1': the fast tier runs a prompt chunk's layers as compiled calls "
    "(KernelConfig.compiled_prefill; default '0')",
    "ENGINE_SCAN_TOKENS": "the fast tier runs a DeltaNet layer's core over verify windows and prompt chunks of up "
    "to this many tokens as one CUDA launch (KernelConfig.scan_tokens; default 0: off)",
    "ENGINE_KEEP_DENSE": "'1': the fast tier dequantizes the weights its dense prompt chunks use once and keeps "
    "them (KernelConfig.keep_dense; memory: 2 bytes a weight more); 'auto': engine serve keeps as many as the "
    "memory left after its warm-up takes (KernelConfig.keep_dense_auto); default '0'",
    "ENGINE_CHUNK_STATES_KERNEL": "'0': the fast tier's chunked DeltaNet prefill runs its chunk-after-chunk states "
    "as MLX operations instead of one CUDA launch a layer (KernelConfig.chunk_states_kernel; default '1')",
    "ENGINE_CHUNK_PREPARE_KERNEL": "'1': the fast tier's chunked DeltaNet prefill runs its chunk-local part (decays, "
    "the triangular solve, Q K^T) as one CUDA launch a layer instead of MLX operations "
    "(KernelConfig.chunk_prepare_kernel; default '0')",
    "ENGINE_PREFILL_ATTENTION_KERNEL": "'1': the fast tier's prompt chunks run causal attention (bfloat16, head dim "
    "64, 128 or 256) as one CUDA launch a layer instead of MLX's products and softmax over the scores "
    "(KernelConfig.prefill_attention_kernel; default '0')",
    "ENGINE_DEQUANT_KERNEL": "'1': the fast tier's dense prompt chunks dequantize their weights with the engine's "
    "kernel (the same values as MLX's, 16 bytes a load; KernelConfig.dequant_kernel; default '0')",
    "ENGINE_DENSE_DECODE_ROWS": "from this many rows a fast-tier GEMV launch whose layers keep dense copies "
    "(ENGINE_KEEP_DENSE) multiplies the copies instead of the 4-bit weights (KernelConfig.dense_decode_rows; "
    "default 0: never)",
    "ENGINE_ATTENTION_GROUP_ROWS": "from this many rows a fast-tier attention decode step runs a block per kv head "
    "for all its q heads, which read the same keys and values, instead of a block per q head "
    "(KernelConfig.attention_group_rows; default 0: never)",
    "ENGINE_STAGED_LAYOUT": "the fast tier's staged GEMV launches (2-64 rows) laid out otherwise, by row count: "
    "'[ROWS:]KEY=VALUE,...;...' with KEY one of W, RT, CK, ST, S, MINB, MG, RW, KS, NR (e.g. '32,64:RW=0': "
    "exact-integer weights at 32 and 64 rows; KernelConfig.staged_layouts)",
    "ENGINE_GEMV_LAUNCH": "launch shapes for the fast tier's one-row GEMV launches, in place of launch_config's: "
    "'ROWSxK=W,RT,U[,MINB];...' (a launch's rows in all its matrices; e.g. '5120x17408=8,1,4')",
}
_SECRETS = {"ENGINE_API_KEY"}


def known(name: str) -> bool:
    """Whether `name` is one of the environment variables the project reads."""
    return name in _VARS


def api_key() -> str | None:
    return os.environ.get("ENGINE_API_KEY") or None


def fuse_stages(environ: Mapping[str, str] = os.environ) -> str | None:
    """ENGINE_FUSE as given (None when unset); `KernelConfig.from_env` parses and checks it."""
    return environ.get("ENGINE_FUSE")


def gemv_launch(environ: Mapping[str, str] = os.environ) -> str | None:
    """ENGINE_GEMV_LAUNCH as given (None when unset); `KernelConfig.from_env` parses and checks it."""
    return environ.get("ENGINE_GEMV_LAUNCH")


def staged_layout(environ: Mapping[str, str] = os.environ) -> str | None:
    """ENGINE_STAGED_LAYOUT as given (None when unset); `KernelConfig.from_env` parses and checks it."""
    return environ.get("ENGINE_STAGED_LAYOUT")


def _switch(name: str, environ: Mapping[str, str]) -> bool | None:
    """A 0/1 variable as a bool (None when unset); ValueError for another value."""
    value = environ.get(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def compiled_prefill(environ: Mapping[str, str] = os.environ) -> bool | None:
    """ENGINE_COMPILED_PREFILL as a bool (None when unset); ValueError for a value other than 0 or 1."""
    return _switch("ENGINE_COMPILED_PREFILL", environ)


def keep_dense(environ: Mapping[str, str] = os.environ) -> str | None:
    """ENGINE_KEEP_DENSE: '0', '1' or 'auto' (None when unset); ValueError for another value."""
    value = environ.get("ENGINE_KEEP_DENSE")
    if value is not None and value not in ("0", "1", "auto"):
        raise ValueError(f"ENGINE_KEEP_DENSE must be 0, 1 or auto, got {value!r}")
    return value


def dequant_kernel(environ: Mapping[str, str] = os.environ) -> bool | None:
    """ENGINE_DEQUANT_KERNEL as a bool (None when unset); ValueError for a value other than 0 or 1."""
    return _switch("ENGINE_DEQUANT_KERNEL", environ)


def chunk_states_kernel(environ: Mapping[str, str] = os.environ) -> bool | None:
    """ENGINE_CHUNK_STATES_KERNEL as a bool (None when unset); ValueError for a value other than 0 or 1."""
    return _switch("ENGINE_CHUNK_STATES_KERNEL", environ)


def chunk_prepare_kernel(environ: Mapping[str, str] = os.environ) -> bool | None:
    """ENGINE_CHUNK_PREPARE_KERNEL as a bool (None when unset); ValueError for a value other than 0 or 1."""
    return _switch("ENGINE_CHUNK_PREPARE_KERNEL", environ)


def prefill_attention_kernel(environ: Mapping[str, str] = os.environ) -> bool | None:
    """ENGINE_PREFILL_ATTENTION_KERNEL as a bool (None when unset); ValueError for a value other than 0 or 1."""
    return _switch("ENGINE_PREFILL_ATTENTION_KERNEL", environ)


def scan_tokens(environ: Mapping[str, str] = os.environ) -> int | None:
    """ENGINE_SCAN_TOKENS as a count (None when unset); ValueError for anything but a whole number >= 0."""
    return _count("ENGINE_SCAN_TOKENS", environ)


def _count(name: str, environ: Mapping[str, str]) -> int | None:
    """A whole-number variable (None when unset); ValueError for anything but a whole number >= 0."""
    value = environ.get(name)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number (0: off), got {value!r}")
    return int(value)


def dense_decode_rows(environ: Mapping[str, str] = os.environ) -> int | None:
    """ENGINE_DENSE_DECODE_ROWS as a count (None when unset); ValueError for anything but a whole number >= 0."""
    return _count("ENGINE_DENSE_DECODE_ROWS", environ)


def attention_group_rows(environ: Mapping[str, str] = os.environ) -> int | None:
    """ENGINE_ATTENTION_GROUP_ROWS as a count (None when unset); ValueError for anything but a whole number >= 0."""
    return _count("ENGINE_ATTENTION_GROUP_ROWS", environ)


def cache_root() -> Path:
    root = os.environ.get("ENGINE_HARNESS_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / PROJECT


def models_dir() -> Path:
    return cache_root() / "models"


def trained_dir() -> Path:
    """The trained models' committed weights (`oracles/train.py` writes them): goldens/trained/ in the checkout."""
    return Path(__file__).resolve().parents[1] / "goldens" / "trained"


def kernels_dir() -> Path:
    """Compiled CUDA kernels, per MLX version (MLX names some modules by their kind, not their source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        import mlx.core as mx

        mlx = mx.__version__
    return cache_root() / "kernels" / f"mlx-{mlx}"


def snapshot() -> dict[str, str]:
    """The project's environment variables that are set, for run provenance."""
    return {k: "<redacted>" if k in _SECRETS else os.environ[k] for k in _VARS if k in os.environ}
