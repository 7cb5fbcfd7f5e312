"""Write the B=1 goldens: what mlx-lm computes for each parity case, compactly.

    python -m oracles.make_goldens [--models tiny-llama,...] [--reason "why"]

For every case (tiny family x f32/bf16/4bit x prompt length) mlx-lm's
`generate_step` runs greedily; per forward the golden keeps the sha256 of the
float32 logits and the top-5 ids and values. The engine is checked against
these in CI without running mlx-lm (tests/parity/test_goldens.py).

A golden changes only through this script, and the commit that changes it
says why (pass --reason; it is stored in the file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import mlx
import numpy as np

from engine.registry import base_names, get_spec
from engine.synth import ensure_model
from oracles import reference
from oracles.cases import DEFAULT_STEPS, DTYPES, PROMPT_LENGTHS, frozen_prompt_ids, model_name

GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "b1"
FORMAT = 1


def logits_record(logits: np.ndarray) -> dict:
    x = np.ascontiguousarray(logits, dtype=np.float32)
    top = np.argsort(-x, kind="stable")[:5]
    return {"sha256": hashlib.sha256(x.tobytes()).hexdigest(), "top5": [[int(i), float(x[i])] for i in top]}


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def artifact_digest(path: Path) -> dict[str, str]:
    files = json.loads((path / "manifest.json").read_text())["files"]
    return {k: v["sha256"] for k, v in files.items() if k.endswith(".safetensors") or k == "config.json"}


def golden_for(name: str, seed: int = 0) -> dict:
    import mlx_lm

    path = ensure_model(name, seed)
    model = reference.load_model(path)
    vocab = get_spec(name).geometry.vocab_size
    cases = []
    for n in PROMPT_LENGTHS:
        ids = frozen_prompt_ids(n, vocab, seed)
        run = reference.generate(model, ids, DEFAULT_STEPS)
        cases.append(
            {
                "prompt_len": n,
                "prompt_sha256": ids_digest(ids),
                "steps": DEFAULT_STEPS,
                "tokens": run.tokens,
                "forwards": [logits_record(x) for x in run.logits],
            }
        )
    return {
        "format": FORMAT,
        "model": name,
        "seed": seed,
        "oracle": f"mlx-lm {mlx_lm.__version__} generate_step, mlx {mlx.core.__version__}",
        "artifact": artifact_digest(path),
        "cases": cases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated tiny bases (default: all)")
    parser.add_argument("--reason", required=True, help="why the goldens change (stored in each file)")
    args = parser.parse_args()
    bases = args.models.split(",") if args.models else base_names("tiny")
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for base in bases:
        for dtype in DTYPES:
            name = model_name(base, dtype)
            golden = golden_for(name)
            golden["reason"] = args.reason
            (GOLDENS / f"{name}.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
            print(f"wrote {name}: {len(golden['cases'])} cases")


if __name__ == "__main__":
    main()
