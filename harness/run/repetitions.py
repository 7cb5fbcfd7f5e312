"""Repeated load cells (`harness run all --cell-repeats N`): which cells repeat, and where a run keeps them.

A concurrency or rate cell's aggregate rate (a burst's output tokens over its span, its goodput likewise) is one
number a burst; its requests are not samples of it, so one burst gives a ratio and no interval
(`stats.ONE_BURST`). With `--cell-repeats N`, block 0 of a run measures every phase and blocks 1 .. N-1 measure
the warm-up and the load cells again on the same workload, each arm's server started afresh, the arms in
alternating order (as `harness trials` orders its blocks, so that drift over the run falls on both arms alike).
A repeated cell's ratio is then the geometric mean of its per-repetition ratios with an interval over them
(`stats.repeated`). A trials file's blocks are paired blocks of their own (other seeds), never repetitions.
"""

from __future__ import annotations

from harness.run import cells


def is_load_phase(phase: str) -> bool:
    """A cell whose aggregate rate is one number a burst: concurrency and open-loop rate cells (`CellKind.repeated`)."""
    kind = cells.kind_of(phase)
    return kind is not None and kind.repeated


def repeated_phases(phases: list[str]) -> list[str]:
    """What a repetition block measures of a run's phases: the warm-up (a fresh server), then the load cells."""
    return [cells.WARMUP.name] + [p for p in phases if is_load_phase(p)]


def is_repetition(run: dict, model: dict) -> bool:
    """Whether a model record of `run` is a repetition block (block 1 .. N-1 of a plain run)."""
    return run.get("kind") == "run" and model.get("block", 0) > 0


def repetitions(run: dict, model: dict) -> list[dict]:
    """The repetition blocks of the model record `model` (block 0 of a plain run), in block order."""
    if is_repetition(run, model) or run.get("kind") != "run":
        return []
    return [m for m in run["models"] if m["model"] == model["model"] and is_repetition(run, m)]


def arm_named(model: dict, name: str) -> dict | None:
    return next((a for a in model["arms"] if a["arm"] == name), None)


def repeat_pairs(run: dict, model: dict, arm: str, baseline: str) -> list[tuple[dict, dict]]:
    """(arm, baseline) arm records of each repetition block of `model` that holds both."""
    pairs = [(arm_named(m, arm), arm_named(m, baseline)) for m in repetitions(run, model)]
    return [(a, b) for a, b in pairs if a is not None and b is not None]
