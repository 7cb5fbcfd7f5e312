"""A float32 reference forward: the engine's own model code with every weight in float32.

The same artifact, loaded as the exact tier loads it, with each quantized (or
half-precision) linear layer and embedding computed from its weights
dequantized to float32 as it runs (one matrix at a time, so a 27B model fits
where its 4-bit form does), and every other parameter (norms, convolutions,
gates) in float32. The activations, norms, attention and recurrences follow in
float32. This is the function the artifact defines, up to float32 rounding: a
kernel tier is judged by how far it moves from it (`harness.kernels.gate`).

On CUDA MLX runs float32 matrix products as TF32 unless MLX_ENABLE_TF32=0 is
set when it starts, so there `reference_files` runs in a child process with
that setting; on the CPU it runs in this process.

Each sequence's logits go to a file of their own as soon as they are made
(`reference_files`), and a caller loads one when it uses it (`load_reference`):
[count, V] float32 is 1 GB a sequence for a 248K vocabulary at 1,024 steps, so
a long gate holding them all in device memory ran out of it on an 80 GB card.

    python -m harness.kernels.float_reference REQUEST.json   (what the child runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import on_cuda, replace_modules
from engine.loading import load_model

F32 = mx.float32


def dequantize_f32(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """Affine codes [N, K * bits / 32] (uint32 words, the low bits first) as float32 [N, K]: scale * q + bias
    per group, in float32 elementwise operations (no quantized kernel, so the same on every backend)."""
    if 32 % bits:
        raise ValueError(f"the float32 reference takes 2-, 4- or 8-bit codes, not {bits}-bit")
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(F32).reshape(w.shape[0], -1, group_size)
    return (q * scales.astype(F32)[..., None] + biases.astype(F32)[..., None]).reshape(w.shape[0], -1)


def _dequantized(layer: nn.Module, rows: mx.array | None = None) -> mx.array:
    """The layer's weight matrix (or its `rows`) in float32, dequantized where it is quantized."""

    def take(name):
        return layer[name] if rows is None else layer[name][rows]

    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if layer.mode != "affine":
            raise ValueError(f"the float32 reference takes affine quantization, not {layer.mode!r}")
        return dequantize_f32(take("weight"), take("scales"), take("biases"), layer.group_size, layer.bits)
    return take("weight").astype(F32)


class Float32Linear(nn.Module):
    """A linear layer (plain or quantized) computed in float32 from its float32 weights."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(F32) @ _dequantized(self.layer).T
        return y + self.layer["bias"].astype(F32) if "bias" in self.layer else y


class Float32Embedding(nn.Module):
    """An embedding (plain or quantized) in float32; `as_linear` is the tied head in float32."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __call__(self, ids: mx.array) -> mx.array:
        return _dequantized(self.layer, ids.reshape(-1)).reshape(*ids.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x.astype(F32) @ _dequantized(self.layer).T


_WEIGHT_LAYERS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def to_float32(model: nn.Module) -> nn.Module:
    """`model` in place as its float32 reference: other parameters cast, weight layers wrapped."""
    for _, module in model.named_modules():
        if isinstance(module, _WEIGHT_LAYERS):
            continue
        for name, value in list(module.items()):
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                module[name] = value.astype(F32)

    def wrap(child: nn.Module):
        if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
            return Float32Embedding(child)
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            return Float32Linear(child)
        return None

    replace_modules(model, wrap)
    return model


# Sequences of one length and start share a forward up to this many tokens: every float32 weight is made once a
# forward (~108 GB written for a 27B model), so a gate of 64 prompts of four lengths makes 6 such passes, not 64.
BATCH_TOKENS = 16384


def forward_logits(model: nn.Module, sequence: Sequence[int], start: int, count: int) -> mx.array:
    """[count, V] float32 logits of one forward over `sequence`, at the positions predicting tokens
    start .. start + count - 1 (the reference for a prompt of `start` ids and `count` generated tokens)."""
    return next(batch_logits(model, [sequence], start, count))


def batch_logits(model: nn.Module, sequences: Sequence[Sequence[int]], start: int, count: int) -> Iterator[mx.array]:
    """`forward_logits` of sequences of one length, as one forward: each row's [count, V] in turn, evaluated (the
    forward's hidden states once, the logits a row at a time, so only one row's are made at once)."""
    hidden = model.hidden(mx.array([list(s) for s in sequences]), model.make_cache())[:, start - 1 : start - 1 + count]
    mx.eval(hidden)
    for row in range(len(sequences)):
        logits = model.logits(hidden[row : row + 1])[0].astype(F32)
        mx.eval(logits)
        yield logits


def batches(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[int]]:
    """The reference's forwards: indices of sequences of one length and start, `BATCH_TOKENS` tokens at most each
    (one sequence at least)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        groups.setdefault((len(seq), start), []).append(i)
    out = []
    for (length, _), members in groups.items():
        size = max(1, BATCH_TOKENS // length)
        out += [members[b : b + size] for b in range(0, len(members), size)]
    return out


def _file(directory: Path, i: int) -> Path:
    return directory / f"r{i}.safetensors"


def _in_process(path: Path, sequences: Sequence[Sequence[int]], starts: Sequence[int], count: int, directory: Path):
    """Each sequence's reference written to `_file(directory, i)`, a forward for each of `batches`."""
    model, _ = load_model(path)
    to_float32(model)
    for batch in batches(sequences, starts):
        rows = batch_logits(model, [sequences[i] for i in batch], starts[batch[0]], count)
        for i, logits in zip(batch, rows):
            mx.save_safetensors(str(_file(directory, i)), {"logits": logits})
        rows.close()
        mx.clear_cache()


def reference_files(
    path: Path,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    count: int,
    directory: Path,
    child: bool | None = None,
) -> list[Path]:
    """The float32 reference's logits [count, V] for each sequence (`forward_logits`), a file each in
    `directory` (`load_reference` reads one), computed in a child process without TF32 where this process runs
    float32 matrix products as TF32 (CUDA; `child` forces either)."""
    if child is None:
        child = on_cuda() and os.environ.get("MLX_ENABLE_TF32") != "0"
    if not child:
        _in_process(path, sequences, starts, count, directory)
    else:
        mx.clear_cache()  # what this process has freed and MLX keeps, the child's to take
        request = directory / "request.json"
        request.write_text(
            json.dumps(
                {
                    "path": str(path),
                    "sequences": [list(s) for s in sequences],
                    "starts": list(starts),
                    "count": count,
                    "directory": str(directory),
                }
            )
        )
        env = {**os.environ, "MLX_ENABLE_TF32": "0"}
        done = subprocess.run(
            [sys.executable, "-m", "harness.kernels.float_reference", str(request)],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the float32 reference failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return [_file(directory, i) for i in range(len(sequences))]


def load_reference(file: Path) -> mx.array:
    """One sequence's reference logits from `reference_files`, read when evaluated."""
    return mx.load(str(file))["logits"]


def reference_logits(
    path: Path, sequences: Sequence[Sequence[int]], starts: Sequence[int], count: int, child: bool | None = None
) -> list[mx.array]:
    """`reference_files`' logits, all of them evaluated in memory (for few or short sequences)."""
    with tempfile.TemporaryDirectory(prefix="float-reference-") as tmp:
        logits = [load_reference(f) for f in reference_files(path, sequences, starts, count, Path(tmp), child)]
        mx.eval(logits)
        return logits


def main(argv: Sequence[str] = ()) -> int:
    (request,) = argv or sys.argv[1:]
    r = json.loads(Path(request).read_text())
    _in_process(Path(r["path"]), r["sequences"], r["starts"], r["count"], Path(r["directory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
