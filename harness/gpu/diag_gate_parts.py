"""Which part of the fast tier moves the logits: the numerics gate's KL and greedy agreement with one part
on at a time (the GEMV layers, the chunked DeltaNet prefill, the compiled DeltaNet layer decode step), then all.

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gate_parts.py [--model qwen27b] [--steps 16]
Run it with MLX_ENABLE_TF32=0 too: MLX runs float32 matmuls (the chunked form's) as TF32 by default.
"""

import argparse
import os

from engine.engine import Engine
from engine.kernels import EXACT, FAST, _swap_quantized_linears, install
from harness.gpu.results import save_json
from harness.kernel_gate import _kl, teacher_forced
from harness.parity import PROMPT_LENGTHS, vocab_size
from harness.prompts import frozen_prompt_ids

PARTS = ("gemv", "chunked_rule", "fused_step", "all")


def only(model, part: str) -> None:
    """The fast tier with every part but `part` put back (`all`: the whole fast tier)."""
    install(model, FAST)
    if part not in ("gemv", "all"):
        _swap_quantized_linears(model, fast=False, use_kernel=False)
    for _, module in model.named_modules():
        for attr in ("chunked_rule", "fused_step"):
            if hasattr(module, attr) and part not in (attr, "all"):
                setattr(module, attr, None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-lengths", default=",".join(map(str, PROMPT_LENGTHS)))
    args = p.parse_args()
    eng = Engine.load(args.model, with_tokenizer=False)
    prompts = [frozen_prompt_ids(n, vocab_size(eng.path), 0) for n in map(int, args.prompt_lengths.split(","))]
    install(eng.model, EXACT)
    exact = [teacher_forced(eng.model, ids, args.steps) for ids in prompts]
    rows = {"tf32": os.environ.get("MLX_ENABLE_TF32", "default"), "steps": args.steps}
    for part in PARTS:
        only(eng.model, part)
        per_prompt = []
        for ids, (tokens, ref) in zip(prompts, exact):
            choices, got = teacher_forced(eng.model, ids, args.steps, forced=tokens)
            kls = [_kl(e, f) for e, f in zip(ref, got)]
            equal = [c == t for c, t in zip(choices, tokens)]
            per_prompt.append({"prompt_len": len(ids), "mean_kl": sum(kls) / len(kls), "max_kl": max(kls),
                               "greedy_equal_steps": next((i for i, e in enumerate(equal) if not e), len(equal))})
        rows[part] = per_prompt
        mean = sum(r["mean_kl"] for r in per_prompt) / len(per_prompt)
        print(f"{part}: mean KL {mean:.2e} | " + " | ".join(
            f"{r['prompt_len']} ids: KL {r['mean_kl']:.1e} equal {r['greedy_equal_steps']}/{args.steps}" for r in per_prompt),
            flush=True)
    install(eng.model, EXACT)
    save_json(f"gate-parts-{args.model}-tf32-{rows['tf32']}.json", rows)


if __name__ == "__main__":
    main()
