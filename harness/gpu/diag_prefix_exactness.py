"""Why a cached prefix is not bit-exact for a model on this device: per-layer cache differences.

    python3 harness/gpu/diag_prefix_exactness.py --model tiny-qwen35 --split 17

Prefills the same 300 tokens in one chunk and in two (split, rest); prints, per
layer, the max |difference| of every cache array, so the first layer and the
kind of layer where the two orders part show.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from engine.generate import prefill
from engine.loading import load_model
from engine.synth import ensure_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen35")
    ap.add_argument("--split", type=int, default=17)
    ap.add_argument("--length", type=int, default=300)
    args = ap.parse_args()
    model = load_model(ensure_model(args.model))[0]
    ids = mx.array(list(range(50, 50 + args.length)))
    one, two = model.make_cache(), model.make_cache()
    prefill(model, one, ids)
    prefill(model, two, ids[: args.split + 1])
    prefill(model, two, ids[args.split :])
    for i, (a, b) in enumerate(zip(one, two)):
        diffs = [mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item() for x, y in zip(a.state, b.state)]
        print(f"layer {i:2d} {type(a).__name__:15s} max|diff| per array: {['%.3g' % d for d in diffs]}")


if __name__ == "__main__":
    main()
