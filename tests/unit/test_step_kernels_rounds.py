"""tools.gpu.step_kernels --rounds: every cell timed once a round, the order reversed every other round."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sk(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # the tools are run from the checkout
    from tools.gpu import step_kernels

    return step_kernels


def test_cells_keep_each_layouts_rows_and_rounds_alternate(sk):
    layouts = [(None, {}, ""), ({64}, {"row_blocks": 2}, " [64:NR=2]"), (None, {"rounded": 1}, " [RW=1]")]
    cells = sk.cells_of(["fast"], layouts, [1, 32, 64], min_rows=2)
    assert [(c.label, c.rows) for c in cells] == [
        ("", 1),
        ("", 32),
        ("", 64),
        (" [64:NR=2]", 64),
        (" [RW=1]", 32),  # no staged layout at one row
        (" [RW=1]", 64),
    ]
    assert sk.round_order(cells, 0) == cells and sk.round_order(cells, 1) == cells[::-1]


def test_the_summary_gives_medians_and_ratios_to_the_trees_layout(sk):
    tree, nr = sk.cells_of(["fast"], [(None, {}, ""), ({64}, {"row_blocks": 2}, " [64:NR=2]")], [64], min_rows=2)
    lines = sk.summary({tree: [0.036, 0.030, 0.032], nr: [0.040, 0.033, 0.036]})
    assert "median   32.00 ms over 3 rounds (30.00-36.00)" in lines[0] and "x the tree's" not in lines[0]
    assert lines[1].endswith("(33.00-40.00)  1.125x the tree's")


def test_the_host_side_is_the_build_and_the_submit_of_steps_on_an_idle_device(sk):
    import mlx.core as mx

    from engine.engine import Engine

    eng = Engine.load("tiny-qwen35")
    cache = eng.model.make_cache()
    build, submit = sk.host_side(eng, mx.array([[1]]), cache, 3)
    assert build > 0 and submit > 0
    assert cache[0].offset == 3  # three steps ran, one token each


def test_dense_rows_run_each_tier_again_on_kept_copies():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tools.gpu.step_kernels", "--model", "tiny-qwen35", "--rows", "2", "--tiers", "exact"]
    cmd += ["--time", "--steps", "4", "--warm", "1", "--dense-rows", "0,2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact  rows   2: step" in proc.stdout and "exact+dense2 rows   2: step" in proc.stdout


def test_the_batch_prefills_in_forwards_of_a_bounded_size(sk, monkeypatch):
    # 64 rows x 384 positions in one forward ran out of memory on an 80 GB card: the prompts go in pieces of at most
    # PREFILL_TOKENS tokens, to the same caches and next tokens
    import mlx.core as mx

    from engine.engine import Engine

    eng = Engine.load("tiny-qwen35")
    whole_cache, whole = sk.batch_state(eng, 4, 40)
    monkeypatch.setattr(sk, "PREFILL_TOKENS", 32)  # 8 positions a forward: 5 forwards
    forwards, hidden = [], type(eng.model).hidden
    monkeypatch.setattr(type(eng.model), "hidden", lambda m, x, c: forwards.append(x.shape) or hidden(m, x, c))
    pieces_cache, pieces = sk.batch_state(eng, 4, 40)
    assert forwards == [(4, 8)] * 5
    assert mx.array_equal(whole, pieces).item()

    def offsets(cache):
        return [mx.array(c.offset).tolist() for c in cache if hasattr(c, "offset")]

    assert offsets(pieces_cache) == offsets(whole_cache) and offsets(whole_cache)
