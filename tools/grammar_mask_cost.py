"""What grammar masks cost a decode step: B constrained rows masked by `engine.grammar.mask_rows` (the
batch's path) and one at a time (the serial lane's processor), on a model's tokenizer and a small schema.

    python3 -m tools.grammar_mask_cost --model small-qwen35 --rows 8 --steps 30

Each step feeds every row an allowed token (random among the mask), so the matchers advance as in
decoding; the time is the mask work alone (feeding, filling, applying), not a forward.
"""

import argparse
import statistics
import time

import mlx.core as mx

from engine.engine import Engine
from engine.grammar import Grammars, mask_rows
from engine.loading import vocab_size

SCHEMA = {
    "type": "object",
    "required": ["city", "days"],
    "properties": {"city": {"enum": ["Oslo", "Paris"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}


def step_times(grammars: Grammars, rows: int, steps: int, batched: bool) -> list[float]:
    constraint = grammars.json_schema(SCHEMA)
    matchers = [constraint.processor() for _ in range(rows)]
    history = [mx.array(list(range(10)), dtype=mx.uint32) for _ in range(rows)]
    logits = mx.zeros((rows, grammars.vocab_size))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if batched:
            out = mask_rows(logits, [(i, matchers[i], history[i]) for i in range(rows)])
        else:
            out = mx.concatenate([matchers[i](history[i], logits[i : i + 1]) for i in range(rows)])
        mx.eval(out)
        times.append(time.perf_counter() - start)
        tokens = mx.argmax(out + 0.01 * mx.random.uniform(shape=out.shape), axis=-1).tolist()
        history = [mx.concatenate([h, mx.array([t], dtype=mx.uint32)]) for h, t in zip(history, tokens)]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small-qwen35", help="registry model whose tokenizer the grammar runs on")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    engine = Engine.load(args.model)
    grammars = Grammars(engine.tokenizer.backend, sorted(engine.tokenizer.eos_ids), vocab_size(engine.config))
    for label, batched in (("batch (mask_rows)", True), ("one row at a time", False)):
        times = sorted(step_times(grammars, args.rows, args.steps, batched))
        print(
            f"{label}: {args.rows} rows, vocabulary {grammars.vocab_size}: median "
            f"{statistics.median(times) * 1e3:.2f} ms a step, p90 {times[int(0.9 * len(times))] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
