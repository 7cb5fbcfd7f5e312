"""Write a synthetic model artifact in mlx-lm's on-disk format.

    config.json, generation_config.json
    tokenizer.json, tokenizer_config.json
    model.safetensors                       (or model-0000i-of-0000n.safetensors
    model.safetensors.index.json             plus the index, above 5 GiB)
    manifest.json                           sha256 of every file, how it was made

The weights stream to disk tensor by tensor, so a 27B artifact never sits in
memory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from engine import env
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.registry import ModelSpec, get_spec
from engine.synth import plan as P
from engine.synth.safetensors_writer import TensorEntry, WrittenFile, write_safetensors
from engine.synth.tokenizer import BuiltTokenizer, build_tokenizer
from engine.synth.weights import Guard, is_quantized, tensor_entries

GENERATOR = "engine-harness synth v1"
MAX_SHARD_BYTES = 5 << 30
MANIFEST = "manifest.json"

# progress(done_bytes, total_bytes, current_tensor_name)
Progress = Callable[[int, int, str], None]


def artifact_dir(name: str, seed: int = 0) -> Path:
    """Where a registry name's artifact is: the cache (per seed), or goldens/trained/ for a trained model."""
    spec = get_spec(name)
    if spec.tier == "trained":
        return env.trained_dir() / spec.name
    return env.models_dir() / f"{spec.name}-s{seed}"


def is_cached(name: str, seed: int = 0) -> bool:
    return (artifact_dir(name, seed) / MANIFEST).exists()


def ensure_model(name: str, seed: int = 0, progress: Progress | None = None) -> Path:
    """The artifact for a registry name: synthesized on first use, or a trained model's committed weights."""
    target = artifact_dir(name, seed)
    if not (target / MANIFEST).exists():
        spec = get_spec(name)
        if spec.tier == "trained":
            raise ModelLoadError(
                f"{spec.name} has no weights in {target.parent}: train them with "
                f"`python -m oracles.train` (trained models are never synthesized)"
            )
        synthesize(spec, seed, target, progress=progress)
    return target


def _shards(entries: list[TensorEntry], max_bytes: int = MAX_SHARD_BYTES) -> list[list[TensorEntry]]:
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_files(out: Path, config: dict, tok: BuiltTokenizer) -> None:
    """config.json, generation_config.json and the tokenizer's files: what an artifact holds beside its weights
    (a synthesized one, and a trained one from `oracles/train.py`)."""
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": tok.eos_ids, "do_sample": False})
    (out / "tokenizer.json").write_text(json.dumps(tok.tokenizer_json, ensure_ascii=False), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tok.tokenizer_config)


def file_record(path: Path) -> dict[str, object]:
    import hashlib

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}


def parameter_count(spec: ModelSpec) -> int:
    return sum(math.prod(t.shape) for t in P.tensor_plan(spec))


def _write_weights(
    spec: ModelSpec, seed: int, guard: Guard, out: Path, progress: Progress | None, shard_bytes: int = MAX_SHARD_BYTES
):
    entries = [e for t in P.tensor_plan(spec) for e in tensor_entries(t, spec, seed, guard)]
    entries.sort(key=lambda e: e.name)
    total = sum(e.nbytes for e in entries)
    shards = _shards(entries, shard_bytes)
    done = 0
    written: list[WrittenFile] = []
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"

        def counted(e: TensorEntry) -> TensorEntry:
            def produce():
                nonlocal done
                for chunk in e.produce():
                    done += chunk.nbytes
                    if progress:
                        progress(done, total, e.name)
                    yield chunk

            return TensorEntry(e.name, e.dtype, e.shape, produce)

        written.append(write_safetensors(out / fname, [counted(e) for e in shard], {"format": "mlx"}))
        weight_map.update({e.name: fname for e in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)
    return written


def _manifest(
    spec: ModelSpec, seed: int, guard: Guard, tok: BuiltTokenizer, out: Path, weights: list[WrittenFile], seconds: float
):
    files = {w.path.name: {"sha256": w.sha256, "bytes": w.nbytes} for w in weights}
    for p in sorted(out.iterdir()):
        if p.name not in files and p.name != MANIFEST:
            files[p.name] = file_record(p)
    quantized = [t.name for t in P.tensor_plan(spec) if is_quantized(t, spec)]
    return {
        "generator": GENERATOR,
        "name": spec.name,
        "seed": seed,
        "spec": {
            "base": spec.base,
            "tier": spec.tier,
            "dtype": spec.dtype,
            "quantization": asdict(spec.quantization) if spec.quantization else None,
            "geometry": asdict(spec.geometry),
        },
        "parameters": parameter_count(spec),
        "quantized_matrices": len(quantized),
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "files": files,
        "weights": (
            "uniform random from PCG64 raw bits seeded by (seed, tensor name); float matrices std "
            "1/sqrt(fan_in), embeddings std 1; quantized matrices drawn directly as random affine codes "
            "with per-group scales jittered in [0.75, 1.25]"
        ),
        "utf8_guard": {
            "method": (
                "embedding columns [0, width) carry one +-1 pattern for every token; residual writers "
                "(o_proj, down_proj, out_proj) have zero output rows there, so the pattern survives every "
                "layer; the final norm scales those dims by gain; head rows of suppressed ids hold -pattern "
                "there, giving them a large negative logit"
            ),
            "width": guard.width,
            "gain": guard.gain,
            "suppressed": "token ids whose text alone is not complete UTF-8, and the special tokens",
            "suppressed_count": int(guard.suppressed.sum()),
        },
        "special_tokens": tok.special_ids,
        "synthesis_seconds": round(seconds, 2),
    }


def synthesize(
    spec: ModelSpec, seed: int, out: Path, progress: Progress | None = None, shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write the artifact for `spec` into `out` (atomically: a temp dir, then a rename), in safetensors
    shards of at most `shard_bytes`."""
    if spec.tier == "trained":
        raise UnsupportedModelError(
            f"{spec.name} is a trained model: `python -m oracles.train` makes it, not synthesis"
        )
    start = time.perf_counter()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        g = spec.geometry
        tok = build_tokenizer(g.model_type, g.vocab_size)
        guard = Guard.make(spec, tok.suppressed_ids)
        write_model_files(tmp, P.model_config(spec, tok.eos_ids), tok)
        weights = _write_weights(spec, seed, guard, tmp, progress, shard_bytes)
        manifest = _manifest(spec, seed, guard, tok, tmp, weights, time.perf_counter() - start)
        _write_json(tmp / MANIFEST, manifest)
        try:
            os.replace(tmp, out)  # atomic; refused while `out` is a directory with files in it
        except OSError:
            if (out / MANIFEST).exists():
                shutil.rmtree(tmp)  # another process finished the same deterministic artifact first
            else:
                shutil.rmtree(out, ignore_errors=True)  # a partial artifact left by a crash
                os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
