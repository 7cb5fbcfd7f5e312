"""What a measured cell's requests show that its workload does not explain, read from a run's JSON, so that the
summary at the end of `harness run all`, `harness report` and `comparable` read it alike (docs/benchmark.md
states the rules):

- cached prompt tokens that no earlier request of the run could have left (`unexplained_cache`): a server that
  outlived an earlier run still held its prompts, and the cell timed that cache; its ratios are withheld
  (`comparable.cell_reason`);
- a stall (`stall`): the cell's largest gap between two tokens over STALL_MIN_MS and over STALL_X_MEDIAN times
  its median gap (a server stopped for 30 s left a decode cell at a median 124 tok/s, one request at 2 tok/s).
  Flagged, its ratios kept: where requests overlap, the pause can be the server's own (a prefill its decoding rows
  waited for), which is what such a cell measures.
"""

from __future__ import annotations

import statistics

from harness.run import cells
from harness.run.measured import ok_requests
from harness.run.records import MEASURED, RECOVERED

# A prompt may share the first token of its nonce's hex, or a chat template's opening, with any earlier prompt.
SHARED_OPENING_TOKENS = 8
STALL_MIN_MS = 1000.0
STALL_X_MEDIAN = 20.0


def cacheable_tokens(phase: str, index: int, requests: list[dict], load: dict) -> int:
    """The prompt tokens request `index` of a cell could find cached by earlier requests of its run (`load`: the
    run's workload settings): the whole prompt in the warm cell (the cold prompt again) and in the decode cell after
    its first request (one prompt, sent again), its group's system prompt for a shared-prefix request after the
    group's first, the chat's previous turn for a multi-turn request after the first turn; none elsewhere."""
    r = requests[index]
    if phase == "warm" or (phase == "decode" and index):
        return r.get("prompt_tokens") or r["prompt_tokens_sent"]
    if phase == cells.PREFIX.name and index % load.get("prefix_group_size", 4):
        return load.get("prefix_tokens", 512)
    if phase == cells.MULTITURN.name and index % load.get("turns", 4):
        return requests[index - 1].get("prompt_tokens") or 0
    return 0


def unexplained_cache(cell: dict, load: dict) -> str | None:
    """Why the cell's cached tokens are more than its workload explains (`cacheable_tokens` and
    SHARED_OPENING_TOKENS), or None."""
    if not cells.timed(cell["phase"]):
        return None
    reqs = ok_requests(cell)
    over = [(i, r, cacheable_tokens(cell["phase"], i, reqs, load)) for i, r in enumerate(reqs)]
    over = [(i, r, most) for i, r, most in over if (r.get("cached_tokens") or 0) > most + SHARED_OPENING_TOKENS]
    if not over:
        return None
    i, r, most = over[0]
    prompt = r.get("prompt_tokens") or r["prompt_tokens_sent"]
    return (
        f"cached tokens the workload does not explain: {len(over)} of {len(reqs)} requests (request {i}: "
        f"{r['cached_tokens']} of {prompt} prompt tokens cached, at most {most} expected; a cache an earlier "
        "run filled?)"
    )


def stall(cell: dict) -> str | None:
    """'stall: ...' when the cell's largest gap between two tokens passes STALL_MIN_MS and STALL_X_MEDIAN times
    its median gap, or None."""
    gaps = [g for r in ok_requests(cell) for g in r.get("itl_ms") or ()]
    if not cells.timed(cell["phase"]) or not gaps:
        return None
    worst, median = max(gaps), statistics.median(gaps)
    if worst <= STALL_MIN_MS or worst <= STALL_X_MEDIAN * median:
        return None
    times = f"{worst / median:,.0f}x" if median else "far past"
    return f"stall: a {worst / 1e3:.1f} s gap between two tokens, {times} the median gap ({median:.1f} ms)"


def cell_flags(cell: dict, load: dict) -> list[str]:
    """What `unexplained_cache` and `stall` say of a measured cell."""
    if cell["status"] not in (MEASURED, RECOVERED):
        return []
    return [why for why in (unexplained_cache(cell, load), stall(cell)) if why]


def flagged_lines(run: dict) -> list[str]:
    """'model / arm / phase: flag' for every flag of every measured cell of the run."""
    load = (run.get("settings") or {}).get("workload") or {}
    return [
        f"{m['model']} / {a['arm']} / {c['phase']}: {why}"
        for m in run.get("models", [])
        for a in m["arms"]
        for c in a["cells"]
        for why in cell_flags(c, load)
    ]
