"""Where a prefill forward's time goes, part by part: each layer part timed to its evaluated output, and the
graph nodes (on CUDA, mostly one kernel each) every part adds.

    python3 -m tools.gpu.prefill_parts --model qwen27b --shapes 1x96,1x1024 --reps 3

For each GROUPxCHUNK shape (as `tools.gpu.prefill_kernels` takes it: one forward of [G, L] on fresh batched
caches, the uncompiled prompt chunk) the forward first runs as the engine runs it, timed whole. Then it runs
with every part below evaluated as it returns, so each part's wall time holds its own graph's build, submit
and device time and nothing of the parts before it: the decoder layer, its norms, its MLP, and its mixer, with
the mixer's stages (a DeltaNet layer: input projections, conv and heads, the delta rule, gated norm; an
attention layer: inputs (projections, norms, heads), attention, output; the mixer's `rest` is what its stages leave out, e.g. the
output projection). A last untimed pass counts each part's graph nodes by primitive (`--nodes`, the largest
few). Nested parts count inside their parent; the synced forward's total against the whole one is what the
syncs cost. Set against the forward's fixed cost (a 96-token forward against a 1,024-token one), the parts
whose time does not grow with the chunk are where a short prompt's time goes.

A synced part's time holds a round trip to the device and its kernels' launch latency, which the unsynced
forward hides behind the host's work, so small parts look larger than they cost. `--ablate PART,...` measures
what a part costs inside the whole forward instead: the forward timed with that part (a name from the table,
e.g. deltanet.rule, mlp, attention) answering with zeros of its output's shapes (learned from one real call at
each input shape), against the whole forward, in turn, with no syncs between parts. The zeros change the
numbers downstream but not the shapes, so every other kernel still runs; work whose only use was the part
(a DeltaNet layer's q/k norms for its rule) is left out with it, as MLX evaluates only what is used.

    python3 -m tools.gpu.prefill_parts --model qwen27b --shapes 1x96,1x1024 --ablate deltanet.rule,mlp,attention
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from tools.gpu.prefill_kernels import one_pass, parse_shapes

# the methods timed, by class name, and the name each is reported under
PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "DecoderLayer": ("layer", ("__call__",)),
    "GatedDeltaNet": ("deltanet", ("__call__", "input_projections", "conv_heads", "rule", "gated_norm")),
    "Attention": ("attention", ("__call__", "inputs", "attend", "output")),
    "MLP": ("mlp", ("__call__",)),
    "RMSNorm": ("norm", ("__call__",)),
}


@dataclasses.dataclass
class Tally:
    """Seconds and calls a part took over the timed passes, and the graph nodes of one pass by primitive."""

    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    calls: Counter = dataclasses.field(default_factory=Counter)
    nodes: dict[str, Counter] = dataclasses.field(default_factory=lambda: defaultdict(Counter))


def _arrays(out) -> list[mx.array]:
    return [x for _, x in tree_flatten(out) if isinstance(x, mx.array)]


def _nodes(out) -> Counter:
    dot = io.StringIO()
    mx.export_to_dot(dot, *_arrays(out))
    return Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', dot.getvalue()))


def instrument(model, tally: Tally, counting: Callable[[], bool]) -> Callable[[], None]:
    """Give every module of a class in PARTS a subclass whose timed methods evaluate their output and add their
    wall time (or, while `counting()`, their graph's nodes) to `tally`. Returns the undo."""

    def methods(cls: type) -> dict:
        label, names = PARTS[cls.__name__]
        return {m: _timed(getattr(cls, m), label, m, tally, counting) for m in names}

    return _subclassed(model, set(PARTS), "Timed", methods)


def _subclassed(model, class_names: set[str], prefix: str, methods: Callable[[type], dict]) -> Callable[[], None]:
    """Give every module of `model` whose class is named in `class_names` a subclass (`prefix` + its name, one a
    class) with `methods(cls)` in place of its own. Returns the undo, which gives each module its class back."""
    made: dict[type, type] = {}
    changed = []
    for _, module in model.named_modules():
        cls = type(module)
        if cls.__name__ not in class_names:
            continue
        if cls not in made:
            made[cls] = type(f"{prefix}{cls.__name__}", (cls,), methods(cls))
        changed.append((module, cls))
        module.__class__ = made[cls]

    def undo() -> None:
        for module, cls in changed:
            module.__class__ = cls

    return undo


def _timed(fn, label: str, method: str, tally: Tally, counting: Callable[[], bool]):
    name = label if method == "__call__" else f"{label}.{method}"

    def run(self, *args, **kwargs):
        if counting():
            out = fn(self, *args, **kwargs)
            tally.nodes[name] += _nodes(out)
            mx.eval(_arrays(out))
            return out
        start = time.perf_counter()
        out = fn(self, *args, **kwargs)
        mx.eval(_arrays(out))
        tally.seconds[name] += time.perf_counter() - start
        tally.calls[name] += 1
        return out

    return run


# parts the residual stream goes around, so zeros in their place leave the rest of the forward to run (zeros
# for a whole layer or every norm would leave the caches depending on nothing before them)
ABLATABLE = ("deltanet", "attention", "mlp")


def part_method(part: str) -> tuple[str, str]:
    """The class name and method a part's name (as the table prints it) stands for, where `--ablate` takes
    it; ValueError for another."""
    label, _, method = part.partition(".")
    for cls_name, (name, methods) in PARTS.items():
        if name == label and name in ABLATABLE and (method or "__call__") in methods:
            return cls_name, method or "__call__"
    names = [f"{n}.{m}" if m != "__call__" else n for n, ms in PARTS.values() if n in ABLATABLE for m in ms]
    raise ValueError(f"--ablate takes {', '.join(names)}, not {part!r}")


def ablate(model, part: str) -> Callable[[], None]:
    """Make `part` answer with zeros of its output's shapes and dtypes (its first call at each input shape
    runs it for real, to learn them; later calls add no graph node). Returns the undo."""
    cls_name, method = part_method(part)
    zeros: dict[tuple, object] = {}

    def stand_in(fn):
        def run(self, *args, **kwargs):
            key = tuple((tuple(a.shape), a.dtype) for a in _arrays((args, kwargs)))
            if key not in zeros:
                out = fn(self, *args, **kwargs)
                mx.eval(_arrays(out))
                zeros[key] = tree_map(lambda a: mx.zeros(a.shape, a.dtype) if isinstance(a, mx.array) else a, out)
                mx.eval(_arrays(zeros[key]))
                return out
            return zeros[key]

        return run

    return _subclassed(model, {cls_name}, "Ablated", lambda cls: {method: stand_in(getattr(cls, method))})


def ablations(eng, group: int, length: int, reps: int, parts: list[str], whole: list[float]) -> None:
    """Each part's cost inside the whole forward: the forward without it (zeros in its place) against with."""
    full = statistics.median(whole) * 1e3
    print(f"  {'part answered with zeros':28s} {'forward ms':>10s} {'part costs ms':>14s} {'share':>6s}", flush=True)
    for part in parts:
        undo = ablate(eng.model, part)
        try:
            one_pass(eng, group, length, 1)  # the part's real first call at this shape, and the new graph's
            without = statistics.median(one_pass(eng, group, length, 1)[0] for _ in range(reps)) * 1e3
        finally:
            undo()
        print(f"  {part:28s} {without:10.1f} {full - without:14.1f} {(full - without) / full:6.0%}", flush=True)


def report(tally: Tally, reps: int, top: int) -> None:
    stages = defaultdict(float)
    for name, s in tally.seconds.items():
        if "." in name:
            stages[name.split(".")[0]] += s
    rows = []
    for name in sorted(tally.seconds, key=lambda n: (n.split(".")[0], "." in n, n)):
        rows.append((name, tally.calls[name] // reps, tally.seconds[name] / reps, sum(tally.nodes[name].values())))
        parent = name.split(".")[0]
        if "." not in name and parent in stages:
            rest = (tally.seconds[name] - stages[parent]) / reps
            rows.append((f"{parent}.rest", tally.calls[name] // reps, rest, None))
    print(
        f"  {'part':28s} {'calls':>6s} {'ms a pass':>10s} {'ms a call':>10s} {'nodes a pass':>13s}  largest primitives"
    )
    for name, calls, seconds, nodes in sorted(rows, key=lambda r: (r[0].split(".")[0], "." in r[0], r[0])):
        common = ", ".join(f"{op} {n}" for op, n in tally.nodes[name].most_common(top)) if nodes else ""
        print(
            f"  {name:28s} {calls:6d} {seconds * 1e3:10.2f} {seconds * 1e3 / max(calls, 1):10.3f} "
            f"{'' if nodes is None else nodes:>13}  {common}",
            flush=True,
        )


def run(
    model_name,
    model_path,
    shapes,
    reps: int,
    tier: str,
    dense_min_rows,
    top: int,
    force: bool = False,
    ablate_parts: list[str] | None = None,
) -> None:
    from engine.engine import Engine
    from engine.kernels import KernelConfig

    kernels = dataclasses.replace(KernelConfig.from_env(tier), compiled_prefill=False, force=force)
    if dense_min_rows is not None:
        kernels = dataclasses.replace(kernels, dense_min_rows=dense_min_rows)
    eng = Engine.load(None if model_path else model_name, model_path, with_tokenizer=False, kernels=kernels)
    print(
        f"{model_path or model_name}: prefill parts on the {eng.kernels.tier.value} tier, dense prefill from "
        f"{kernels.dense_min_rows} rows",
        flush=True,
    )
    for group, length in shapes:
        one_pass(eng, group, length, 1)  # compiles this shape
        whole = [one_pass(eng, group, length, 1)[0] for _ in range(reps)]
        if ablate_parts:
            print(f"prefill {group}x{length}: whole forward {statistics.median(whole) * 1e3:.1f} ms", flush=True)
            ablations(eng, group, length, reps, ablate_parts, whole)
            mx.clear_cache()
            continue
        tally, count = Tally(), [False]
        undo = instrument(eng.model, tally, lambda: count[0])
        try:
            one_pass(eng, group, length, 1)  # the synced path's own first run, untimed
            tally.seconds.clear(), tally.calls.clear()
            synced = [one_pass(eng, group, length, 1)[0] for _ in range(reps)]
            count[0] = True
            one_pass(eng, group, length, 1)
        finally:
            undo()
        mx.clear_cache()
        print(
            f"prefill {group}x{length}: whole forward {statistics.median(whole) * 1e3:.1f} ms, with every part synced "
            f"{statistics.median(synced) * 1e3:.1f} ms (medians of {reps})",
            flush=True,
        )
        report(tally, reps, top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--model-path", help="a model directory instead of a registry name")
    p.add_argument("--shapes", default="1x96,1x1024", help="comma-separated GROUPxCHUNK")
    p.add_argument("--reps", type=int, default=3, help="timed passes a shape")
    p.add_argument("--tier", default="fast", help="kernel tier (fast, exact, auto)")
    p.add_argument("--dense-min-rows", type=int, help="KernelConfig.dense_min_rows (default the tree's)")
    p.add_argument(
        "--force",
        action="store_true",
        help="run the fast tier off CUDA too (its chunked delta rule and other paths; quantized layers then run "
        "MLX's op): the parts and their nodes as on CUDA, on a CPU",
    )
    p.add_argument(
        "--ablate",
        help="comma-separated parts (as the table names them: deltanet.rule, mlp, ...): time the forward with each "
        "answering with zeros instead of the synced parts",
    )
    p.add_argument("--nodes", type=int, default=4, help="primitives listed a part (the most frequent)")
    args = p.parse_args()
    parts = [x.strip() for x in args.ablate.split(",") if x.strip()] if args.ablate else None
    for part in parts or ():
        try:
            part_method(part)
        except ValueError as e:
            p.error(str(e))
    run(
        args.model,
        args.model_path,
        parse_shapes(args.shapes),
        max(1, args.reps),
        args.tier,
        args.dense_min_rows,
        args.nodes,
        args.force,
        parts,
    )


if __name__ == "__main__":
    main()
