"""tools.gpu.batch_parts refuses to time nothing: its layouts alone need a layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def test_layouts_only_needs_a_layout(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import batch_parts

    monkeypatch.setattr(sys, "argv", ["batch_parts", "--rows", "64", "--layouts-only"])
    with pytest.raises(SystemExit) as stop:
        batch_parts.main()
    assert stop.value.code == 2 and "--layouts-only needs a --staged layout" in capsys.readouterr().err
