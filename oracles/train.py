"""Train the registry's `trained` tier with MLX and write each model in mlx-lm's format, bf16 and 4-bit, with a
manifest (command, seed, settings, data hash, losses), under goldens/trained/ by default.

    python -m oracles.train                                   # the whole family (minutes on an H200)
    python -m oracles.train --models trained-qwen3-draft --steps 300 --out /tmp/trained
    python -m oracles.train --prepare data.npz                # text, tokenizer and ids only, for another machine
    python -m oracles.train --data data.npz                   # train on them (the same text on any Python)
    python -m oracles.train --data data.npz --models M --quantize  # M's -4bit from its bf16 files under --out

Deterministic for a given machine kind and Python version: the text (`oracles.train_data`), the tokenizer
learned from it, the initial weights (`--seed`) and the batches (`--seed`) are fixed. The family shares one
byte-level BPE tokenizer; the hybrid target trains its MTP head beside its next-token loss (the head sees the
target's hidden state at t and the embedding of token t + 1, and predicts token t + 2, as `engine.speculative.mtp`
runs it). Weights train in float32 and are saved as bf16, then quantized from the bf16 weights to 4 bits
(group 64, the matrices a synthesized 4-bit artifact quantizes).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TRAINED = ("trained-qwen35", "trained-qwen3", "trained-qwen3-draft")
GENERATOR = "engine-harness train v1"
BASE_VOCAB = 4093  # the BPE's ids; the three special tokens make the registry's 4096


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 3000
    batch: int = 32
    seq: int = 512
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.5  # the MTP head's loss beside the next-token loss
    seed: int = 0
    eval_tokens: int = 65536  # held-out tokens the final loss is measured on


def shared_tokenizer(texts: list[str]):
    """The family's tokenizer, learned from the training text (qwen3_5's split rule: it equals qwen3's on text
    without combining marks)."""
    from engine.synth.tokenizer import build_tokenizer

    return build_tokenizer("qwen3_5", 4096, texts=texts, base_size=BASE_VOCAB)


def token_stream(texts, tok) -> np.ndarray:
    """Each text's ids followed by <|endoftext|>, one int32 array."""
    from tokenizers import Tokenizer

    from engine.synth.tokenizer import END_OF_TEXT

    encoder = Tokenizer.from_str(json.dumps(tok.tokenizer_json))
    end = tok.special_ids[END_OF_TEXT]
    ids: list[int] = []
    for enc in encoder.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(end)
    return np.asarray(ids, dtype=np.int32)


def prepare(max_bytes: int) -> tuple[object, np.ndarray, np.ndarray, dict]:
    """The tokenizer, the train and held-out ids and the data's summary, from the running interpreter's text."""
    from oracles.train_data import load_corpus

    corpus = load_corpus(max_bytes)
    tok = shared_tokenizer([f.text for f in corpus.train])
    train_ids = token_stream([f.text for f in corpus.train], tok)
    held_ids = token_stream([f.text for f in corpus.held_out], tok)
    return (
        tok,
        train_ids,
        held_ids,
        {**corpus.summary(), "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(held_ids))},
    )


def save_prepared(path: Path, tok, train_ids: np.ndarray, held_ids: np.ndarray, data: dict) -> None:
    """One compressed file (ids as uint16: the vocabulary has 4096 entries) that `load_prepared` reads."""
    meta = json.dumps({"tokenizer": asdict(tok), "data": data})
    np.savez_compressed(
        path, train=train_ids.astype(np.uint16), held_out=held_ids.astype(np.uint16), meta=np.array(meta)
    )


def load_prepared(path: Path):
    """What `prepare` returned, from a `save_prepared` file."""
    from engine.synth.tokenizer import BuiltTokenizer

    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["meta"]))
        tok = meta["tokenizer"]
        tok = BuiltTokenizer(**{**tok, "suppressed_ids": tuple(tok["suppressed_ids"])})
        return tok, f["train"].astype(np.int32), f["held_out"].astype(np.int32), meta["data"]


def build_model(spec, eos_ids: list[int], seed: int):
    import mlx.core as mx

    from engine.kernels.gated_delta_chunked import chunked_gated_delta
    from engine.models import model_module
    from engine.synth import plan as P

    config = P.model_config(spec, eos_ids)
    mx.random.seed(seed)
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    for layer in getattr(model, "layers", []):
        lin = getattr(layer, "linear_attn", None)
        if lin is not None:  # decay rates spread over heads (A in [1, 16], as Qwen3-Next initializes them)
            lin.A_log = mx.log(mx.random.uniform(1.0, 16.0, lin.A_log.shape))
            lin.chunked_rule = chunked_gated_delta  # 64-token blocks: a few products, not a kernel chain a token
    return model, config


def losses(model, x, y, mtp_weight: float):
    """Mean next-token cross entropy, plus `mtp_weight` times the MTP head's (token t + 2) where there is one;
    returns (total, next-token loss)."""
    import mlx.core as mx
    import mlx.nn as nn

    hidden = model.hidden(x)
    lm = nn.losses.cross_entropy(model.logits(hidden).astype(mx.float32), y, reduction="mean")
    if not getattr(model, "has_mtp", False):
        return lm, lm
    text = model.language_model
    head = text.mtp(hidden[:, :-1], text.model.embed_tokens(y[:, :-1]))
    mtp = nn.losses.cross_entropy(model.logits(head).astype(mx.float32), y[:, 1:], reduction="mean")
    return lm + mtp_weight * mtp, lm


def held_out_loss(model, ids: np.ndarray, seq: int, tokens: int) -> float:
    """Mean next-token loss over the first `tokens` held-out tokens, in windows of `seq`."""
    import mlx.core as mx
    import mlx.nn as nn

    n = min(tokens, len(ids) - 1) // seq
    if n == 0:
        raise ValueError(f"{len(ids)} held-out tokens are fewer than one window of {seq}")
    total = 0.0
    for i in range(0, n, 8):
        rows = min(8, n - i)
        window = ids[i * seq : (i + rows) * seq + 1]
        x = mx.array(np.stack([window[r * seq : (r + 1) * seq] for r in range(rows)]))
        y = mx.array(np.stack([window[r * seq + 1 : (r + 1) * seq + 1] for r in range(rows)]))
        loss = nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="sum")
        total += loss.item()
    return total / (n * seq)


MAX_SKIPPED_IN_A_ROW = 20  # non-finite steps in a row that stop training: the weights themselves went bad


def train(model, ids: np.ndarray, s: TrainSettings, log) -> tuple[list[float], list[int]]:
    """AdamW with a linear warm-up and a cosine decay to a tenth. A step whose loss or gradient is not finite
    is skipped (logged with the parameters whose gradient it was); returns the next-token loss of every step
    taken and the skipped steps' numbers."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    warm = optim.linear_schedule(s.lr / s.warmup, s.lr, s.warmup)
    decay = optim.cosine_decay(s.lr, max(1, s.steps - s.warmup), s.lr / 10)
    schedule = optim.join_schedules([warm, decay], [s.warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=s.weight_decay)
    grad = nn.value_and_grad(model, lambda m, x, y: losses(m, x, y, s.mtp_weight))
    rng = np.random.default_rng(s.seed)
    history, skipped, start = [], [], time.perf_counter()
    for step in range(s.steps):
        offsets = rng.integers(0, len(ids) - s.seq - 1, size=s.batch)
        window = np.stack([ids[o : o + s.seq + 1] for o in offsets])
        (_, lm), grads = grad(model, mx.array(window[:, :-1]), mx.array(window[:, 1:]))
        grads, norm = optim.clip_grad_norm(grads, 1.0)
        mx.eval(lm, norm)
        if not (np.isfinite(lm.item()) and np.isfinite(norm.item())):
            bad = [k for k, g in tree_flatten(grads) if not mx.isfinite(g).all().item()]
            skipped.append(step + 1)
            log(
                f"  step {step + 1}: loss {lm.item()}, gradient norm {norm.item()}; skipped (not finite: "
                f"{', '.join(bad[:6]) or 'loss only'}{' ...' if len(bad) > 6 else ''})"
            )
            if skipped[-MAX_SKIPPED_IN_A_ROW:] == list(range(step + 2 - MAX_SKIPPED_IN_A_ROW, step + 2)):
                raise RuntimeError(f"{MAX_SKIPPED_IN_A_ROW} steps in a row were not finite (to step {step + 1})")
            continue
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        history.append(lm.item())
        if step % 100 == 0 or step == s.steps - 1:
            rate = (step + 1) * s.batch * s.seq / (time.perf_counter() - start)
            log(
                f"  step {step + 1}/{s.steps}: loss {np.mean(history[-100:]):.3f} ({rate:,.0f} tokens/s"
                f"{f'; {len(skipped)} skipped' if skipped else ''})"
            )
    return history, skipped


def quantized_names(spec) -> set[str]:
    """The matrices a synthesized artifact of `spec`'s 4-bit variant quantizes."""
    from engine.registry import get_spec
    from engine.synth import plan as P
    from engine.synth.weights import is_quantized

    four = get_spec(f"{spec.base}-4bit")
    return {t.name for t in P.tensor_plan(four) if is_quantized(t, four)}


def write_artifact(model, config: dict, tok, out: Path, manifest: dict) -> None:
    """config.json, generation_config.json, tokenizer files, model.safetensors and manifest.json (every file's
    sha256) into `out`, replacing what was there."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.synth.artifact import file_record, write_model_files

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_model_files(out, config, tok)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    files = {p.name: file_record(p) for p in sorted(out.iterdir())}
    total = sum(f["bytes"] for f in files.values())
    (out / "manifest.json").write_text(json.dumps({**manifest, "files": files, "total_bytes": total}, indent=2) + "\n")


def write_four_bit(
    model, spec, config: dict, tok, held_ids: np.ndarray, settings: TrainSettings, out_root: Path, manifest: dict, log
) -> None:
    """Quantize the bf16 `model` to 4 bits (group 64, the matrices a synthesized 4-bit artifact quantizes), measure
    its held-out loss and write it as `<name>-4bit` with `manifest` (the bf16 model's, its result's loss replaced)."""
    import mlx.nn as nn

    names4 = quantized_names(spec)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, _m: path in names4)
    held4 = held_out_loss(model, held_ids, settings.seq, settings.eval_tokens)
    four = {
        **manifest["result"],
        "held_out_loss": round(held4, 4),
        "held_out_perplexity": round(float(np.exp(held4)), 2),
    }
    config4 = {**config, "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}
    config4["quantization_config"] = config4["quantization"]
    name = f"{manifest['name']}-4bit"
    manifest = {k: v for k, v in manifest.items() if k not in ("files", "total_bytes")}
    write_artifact(
        model,
        config4,
        tok,
        out_root / name,
        {**manifest, "name": name, "result": four, "weights": "4-bit affine, group 64, bf16 scales"},
    )
    log(f"{name}: held-out loss {held4:.3f}")


def load_trained(spec, path: Path, eos_ids: list[int]):
    """(model, config, manifest) of a bf16 artifact `write_artifact` wrote for `spec`."""
    import mlx.core as mx

    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("weights") != "bf16":
        raise SystemExit(f"{path}: not a bf16 trained model (weights: {manifest.get('weights')})")
    config = json.loads((path / "config.json").read_text())
    model, _ = build_model(spec, eos_ids, manifest["settings"]["seed"])
    model.set_dtype(mx.bfloat16)
    model.load_weights(str(path / "model.safetensors"), strict=True)
    return model, config, manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(TRAINED), help=f"comma-separated, of {', '.join(TRAINED)}")
    p.add_argument("--out", type=Path, help="write here instead of goldens/trained/")
    p.add_argument("--max-bytes", type=int, help="text read at most (default oracles.train_data's)")
    p.add_argument("--prepare", type=Path, metavar="FILE", help="write the tokenizer and ids to FILE and stop")
    p.add_argument("--data", type=Path, metavar="FILE", help="train on a --prepare file instead of this Python's text")
    p.add_argument(
        "--quantize",
        action="store_true",
        help="write each model's -4bit from its bf16 weights already under --out (no training): for a "
        "machine whose outputs came back without the 4-bit files",
    )
    defaults = TrainSettings()
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    import mlx.core as mx

    from engine import env
    from engine.registry import get_spec
    from oracles.train_data import DEFAULT_MAX_BYTES

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRAINED]
    if unknown:
        p.error(f"not trained models: {', '.join(unknown)} (choose from {', '.join(TRAINED)})")
    settings = TrainSettings(**{f: getattr(args, f) for f in asdict(defaults)})
    out_root = args.out or env.trained_dir()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    if args.data:
        tok, train_ids, held_ids, data = load_prepared(args.data)
    else:
        tok, train_ids, held_ids, data = prepare(args.max_bytes or DEFAULT_MAX_BYTES)
    log(
        f"text: {data['train_files']} train files ({len(train_ids):,} tokens), {data['held_out_files']} held out "
        f"({len(held_ids):,}); Python {data['python']}, sha256 {data['sha256'][:16]}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    if args.prepare:
        save_prepared(args.prepare, tok, train_ids, held_ids, data)
        log(f"wrote {args.prepare} ({args.prepare.stat().st_size / 1e6:.1f} MB)")
        return 0
    if args.quantize:
        for name in names:
            model, config, manifest = load_trained(get_spec(name), out_root / name, tok.eos_ids)
            settings = TrainSettings(**manifest["settings"])
            write_four_bit(
                model,
                get_spec(name),
                config,
                tok,
                held_ids,
                settings,
                out_root,
                {
                    **manifest,
                    "quantized_by": "python -m oracles.train " + " ".join(argv or sys.argv[1:]),
                    "quantized_on": str(mx.default_device()),
                },
                log,
            )
        return 0
    for name in names:
        spec = get_spec(name)
        model, config = build_model(spec, tok.eos_ids, settings.seed)
        initial = held_out_loss(model, held_ids, settings.seq, settings.eval_tokens)
        log(
            f"{name}: held-out loss {initial:.3f} before training; {settings.steps} steps of "
            f"{settings.batch}x{settings.seq}"
        )
        began = time.perf_counter()
        history, skipped = train(model, train_ids, settings, log)
        model.set_dtype(mx.bfloat16)
        held = held_out_loss(model, held_ids, settings.seq, settings.eval_tokens)
        result = {
            "train_loss": round(float(np.mean(history[-100:])), 4),
            "held_out_loss": round(held, 4),
            "held_out_perplexity": round(float(np.exp(held)), 2),
            "held_out_loss_at_init": round(initial, 4),
            "training_seconds": round(time.perf_counter() - began, 1),
            "skipped_steps": skipped,
        }
        log(
            f"{name}: train loss {result['train_loss']}, held-out loss {held:.3f} (perplexity "
            f"{result['held_out_perplexity']}) in {result['training_seconds']} s"
        )
        command = "python -m oracles.train " + " ".join(argv or sys.argv[1:])
        manifest = {
            "generator": GENERATOR,
            "name": name,
            "command": command,
            "settings": asdict(settings),
            "data": data,
            "result": result,
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "machine": platform.machine(),
            "special_tokens": tok.special_ids,
        }
        write_artifact(model, config, tok, out_root / name, {**manifest, "weights": "bf16"})
        write_four_bit(model, spec, config, tok, held_ids, settings, out_root, {**manifest, "result": result}, log)
    log(f"wrote {', '.join(names)} (and -4bit) under {out_root} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
