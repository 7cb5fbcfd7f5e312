"""Is the machine quiet enough to measure? A snapshot of load, memory and swap, and a verdict.

A benchmark on a machine that something else is using measures that other
thing. `harness run` refuses a loaded machine unless `--diagnostic`, which
labels the run so no one mistakes it for a clean measurement.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import psutil

MAX_OTHER_CPU_PERCENT = 25.0  # of the whole machine, used by processes other than this one
MIN_AVAILABLE_BYTES = 2 << 30
MAX_SWAP_USED_BYTES = 512 << 20


@dataclass(frozen=True)
class Preflight:
    cpu_count: int
    other_cpu_percent: float
    load_avg_1m: float
    memory_total_bytes: int
    memory_available_bytes: int
    swap_used_bytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_record(self) -> dict:
        return asdict(self)


def _own_cpu_percent(interval_s: float) -> tuple[float, float]:
    """(whole-machine CPU %, this process tree's share of it) over `interval_s`."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    for p in procs:
        p.cpu_percent(None)
    total = psutil.cpu_percent(interval=interval_s)
    own = 0.0
    for p in procs:
        try:
            own += p.cpu_percent(None)
        except psutil.NoSuchProcess:
            pass
    return total, own / psutil.cpu_count()


def check(interval_s: float = 1.0) -> Preflight:
    total, own = _own_cpu_percent(interval_s)
    other = max(total - own, 0.0)
    mem, swap = psutil.virtual_memory(), psutil.swap_memory()
    problems = []
    if other > MAX_OTHER_CPU_PERCENT:
        problems.append(f"other processes use {other:.0f}% of the CPUs (limit {MAX_OTHER_CPU_PERCENT:.0f}%)")
    if mem.available < MIN_AVAILABLE_BYTES:
        problems.append(f"only {mem.available / 2**30:.1f} GiB of memory available (need {MIN_AVAILABLE_BYTES >> 30})")
    if swap.used > MAX_SWAP_USED_BYTES:
        problems.append(f"{swap.used / 2**20:.0f} MiB of swap in use (limit {MAX_SWAP_USED_BYTES >> 20})")
    return Preflight(
        psutil.cpu_count(),
        round(other, 1),
        round(os.getloadavg()[0], 2),
        mem.total,
        mem.available,
        swap.used,
        tuple(problems),
    )
