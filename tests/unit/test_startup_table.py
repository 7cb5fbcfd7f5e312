"""`harness startup`'s table of server starts: the warm-up's stages and what keep-dense auto kept after them."""

from harness.bench.cli import start_row
from harness.bench.startup import Start

STAGES = [{"name": "decode rows 1-66", "seconds": 46.4, "kernel_builds": 0}]


def test_a_start_row_names_the_stages_and_the_dense_copies_kept_after_them():
    kept = {"budget": 50e9, "matrices": 300, "bytes": 40e9, "candidates": 448, "candidate_bytes": 54e9}
    warmup = {"seconds": 124.1, "stages": STAGES, "kept_dense": kept, "kernel_cache": {"compiled": 146, "found": 0}}
    row = start_row(Start("start", [], 146.2, warmup))
    assert row[:3] == ("start", "146.2", "124.1")
    assert row[3] == (
        "decode rows 1-66 46.4 s (0 kernel builds); then kept dense copies of 300 of 448 matrices (40.0 of 54.0 GB)"
    )
    assert row[4] == "146 / 0 / -"


def test_a_start_without_copies_or_a_warm_up_record_has_dashes():
    assert start_row(Start("restart", [], 59.0, {"stages": STAGES}))[3] == "decode rows 1-66 46.4 s (0 kernel builds)"
    assert start_row(Start("restart", [], 59.0))[2:] == ("-", "-", "-")
