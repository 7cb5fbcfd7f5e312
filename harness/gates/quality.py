"""What a weight quantization, a quantized KV cache or a kernel tier costs in quality: held-out perplexity and
the mean KL divergence of each position's next-token distribution from the bf16 (or the artifact's own)
weights on the exact tier, in process.

The held-out text is `oracles.train_data`'s held-out files, tokenized by the model's own tokenizer: for a
trained model the text it never saw; for a synthetic one just text (its perplexity is that of random
weights, the baseline a trained model must beat). Each window starts from an empty cache and goes through
the model in chunks, as a prompt is prefilled, so a quantized KV cache takes effect after the first chunk
(as `engine serve --kv-bits` quantizes after a prompt's first chunk).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from oracles.train_data import load_corpus

WEIGHT_BITS = (8, 4)  # in-memory quantizations of a bf16 model (affine, group 64, the registry's variants')
KV_BITS = (8, 4)


@dataclass(frozen=True)
class QualitySettings:
    tokens: int = 4096  # held-out tokens scored
    window: int = 512  # tokens a window (each from an empty cache)
    chunk: int = 128  # tokens a forward within a window
    kv_group_size: int = 64


@dataclass(frozen=True)
class QualityRow:
    variant: str  # "bf16", "4bit", "bf16 kv8", "bf16 fast" ...
    weights: str
    kv_bits: int | None
    tier: str
    nll: float  # mean next-token negative log-likelihood, nats
    perplexity: float
    mean_kl: float | None  # KL(reference || variant) per position, mean; None for the reference itself
    top1_agreement: float | None


@dataclass
class QualityResult:
    model: str
    settings: QualitySettings
    tokens: int
    rows: list[QualityRow] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "settings": asdict(self.settings),
            "tokens": self.tokens,
            "rows": [asdict(r) for r in self.rows],
        }


@lru_cache(maxsize=1)
def held_out_texts() -> tuple[str, ...]:
    """The held-out files' text, read once a process (choosing them reads the whole standard library)."""
    return tuple(f.text for f in load_corpus().held_out)


def held_out_ids(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` + 1 ids of the held-out files' text, file after file, in the model's tokenizer."""
    ids: list[int] = []
    for text in held_out_texts():
        ids.extend(tokenizer.encode(text))
        if len(ids) >= tokens + 1:
            break
    if len(ids) < tokens + 1:
        raise ValueError(f"the held-out text gives {len(ids)} tokens, fewer than {tokens + 1}")
    return ids[: tokens + 1]


def logprobs(model, ids: list[int], s: QualitySettings, kv_bits: int | None) -> np.ndarray:
    """Log-softmax of every position's next-token logits [len(ids) - 1, V], float32, window after window."""
    # on use: MLX and the model code; `harness --help` imports this module (the run's `held_out_score`)
    import mlx.core as mx

    from engine.generate import KVQuantization

    kv = KVQuantization(bits=kv_bits, group_size=s.kv_group_size, start=0) if kv_bits else None
    rows = []
    for w in range(0, len(ids) - 1, s.window):
        window = ids[w : min(w + s.window, len(ids) - 1)]
        cache = model.make_cache()
        if kv:
            kv.check(cache)
        for c in range(0, len(window), s.chunk):
            logits = model(mx.array(window[c : c + s.chunk])[None], cache)[0].astype(mx.float32)
            rows.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
            if kv:
                kv.apply(cache)
    return np.concatenate(rows)


def score(
    variant: str,
    weights: str,
    kv_bits: int | None,
    tier: str,
    lp: np.ndarray,
    targets: np.ndarray,
    ref: np.ndarray | None,
) -> QualityRow:
    nll = float(-lp[np.arange(len(targets)), targets].mean())
    kl = top1 = None
    if ref is not None:
        kl = float((np.exp(ref) * (ref - lp)).sum(axis=-1).mean())
        top1 = float((ref.argmax(-1) == lp.argmax(-1)).mean())
    return QualityRow(
        variant,
        weights,
        kv_bits,
        tier,
        round(nll, 5),
        round(math.exp(nll), 3),
        None if kl is None else round(kl, 6),
        None if top1 is None else round(top1, 4),
    )


def measure(
    label: str,
    model_path,
    s: QualitySettings = QualitySettings(),
    weight_bits=WEIGHT_BITS,
    kv_bits=KV_BITS,
    fast: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> QualityResult:
    """Every variant of one model against its reference, the artifact on the exact tier. An unquantized
    artifact is also quantized in memory to each of `weight_bits`; the reference weights run with each of
    `kv_bits`; `fast` adds the fast tier where this device runs it."""
    # on use: MLX and the model code; `harness --help` imports this module (the run's `held_out_score`)
    import mlx.nn as nn

    from engine.engine import Engine

    def load(kernels: str) -> Engine:
        return Engine.load(None, model_path, kernels=kernels)

    exact = load("exact")
    quantized = "quantization" in exact.config
    base = "artifact" if quantized else _dtype_name(exact.model)
    ids = held_out_ids(exact.tokenizer, s.tokens)
    targets = np.array(ids[1:])
    result = QualityResult(label, s, len(targets))
    progress(f"reference ({base}, exact tier)")
    ref = logprobs(exact.model, ids, s, None)
    result.rows.append(score(base, base, None, "exact", ref, targets, None))
    for bits in kv_bits:
        progress(f"{base} with kv{bits}")
        lp = logprobs(exact.model, ids, s, bits)
        result.rows.append(score(f"{base} kv{bits}", base, bits, "exact", lp, targets, ref))
    if fast:
        engine = load("fast")
        if engine.kernels.tier == "fast":
            progress(f"{base}, fast tier")
            lp = logprobs(engine.model, ids, s, None)
            result.rows.append(score(f"{base} fast", base, None, "fast", lp, targets, ref))
    if not quantized:
        for bits in weight_bits:
            progress(f"{bits}-bit weights")
            engine = load("exact")
            nn.quantize(engine.model, group_size=64, bits=bits, class_predicate=_quantizable)
            lp = logprobs(engine.model, ids, s, None)
            result.rows.append(score(f"{bits}bit", f"{bits}bit", None, "exact", lp, targets, ref))
    return result


def held_out_score(model_path, tier: str, tokens: int) -> dict:
    """The artifact's held-out perplexity on `tier` (one row, no reference): what `harness run all` records for
    an engine arm, the same first `tokens` held-out tokens every run."""
    # on use: MLX and the model code; `harness --help` imports this module (the run's `held_out_score`)
    from engine.engine import Engine

    engine = Engine.load(None, model_path, kernels=tier)
    s = QualitySettings(tokens=tokens)
    ids = held_out_ids(engine.tokenizer, tokens)
    row = score(
        engine.kernels.tier,
        "artifact",
        None,
        engine.kernels.tier,
        logprobs(engine.model, ids, s, None),
        np.array(ids[1:]),
        None,
    )
    config = json.loads((Path(model_path) / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return {"tokens": tokens, "tier": row.tier, "nll": row.nll, "perplexity": row.perplexity, "vocab_size": vocab}


def _dtype_name(model) -> str:
    """'bf16', 'f16' or 'f32': the dtype of an unquantized model's first weight."""
    # on use: MLX and the model code; `harness --help` imports this module (the run's `held_out_score`)
    from mlx.utils import tree_flatten

    dtype = str(tree_flatten(model.parameters())[0][1].dtype)
    return {"mlx.core.bfloat16": "bf16", "mlx.core.float16": "f16", "mlx.core.float32": "f32"}.get(dtype, dtype)


def _quantizable(_path: str, module) -> bool:
    """Every Linear and Embedding whose input size is a multiple of the group (64)."""
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % 64 == 0


def markdown(results: list[QualityResult]) -> str:
    lines = [
        "| model | variant | tier | perplexity | mean NLL | mean KL vs reference | top-1 agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r.rows:
            kl = "reference" if row.mean_kl is None else f"{row.mean_kl:.5f}"
            top1 = "" if row.top1_agreement is None else f"{100 * row.top1_agreement:.1f}%"
            lines.append(
                f"| {r.model} | {row.variant} | {row.tier} | {row.perplexity:.2f} | {row.nll:.4f} | {kl} | {top1} |"
            )
    return "\n".join(lines) + "\n"
