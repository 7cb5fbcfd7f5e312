"""tools.gpu.op_cost times chains of each kind it can run here and refuses what it does not know."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_a_line_per_kind_with_its_three_times(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import op_cost

    op_cost.main(["--ops", "20", "--reps", "2", "--kinds", "add,compiled", "--label", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("# cpu [")
    for kind in ("add", "compiled"):
        assert re.search(rf"^{kind} +build +[0-9.]+  submit +[0-9.]+  wait +[0-9.]+$", out, re.M), out


def test_unknown_kind_is_refused(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import op_cost

    with pytest.raises(SystemExit):
        op_cost.main(["--kinds", "add,nope"])


def test_unused_source_is_as_long_as_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import op_cost

    assert len(op_cost.unused_source(9000)) >= 9000
    assert op_cost.KERNEL_KINDS <= set(op_cost.KINDS)
