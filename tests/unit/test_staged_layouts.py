"""Staged GEMV layouts by row count as a setting (`KernelConfig.staged_layouts`, ENGINE_STAGED_LAYOUT): parsed once,
carried by the fast tier's layers, and taken by the launches they build."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.kernels import FAST, KernelConfig, install
from engine.kernels.quantized_gemv import KernelQuantizedLinear, StagedLayouts
from engine.kernels.quantized_gemv.layouts import NO_LAYOUTS, StagedLayout
from engine.kernels.quantized_gemv.staged import staged_config

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def test_layouts_parse_print_and_refuse_what_they_cannot_take():
    layouts = StagedLayouts.parse("32,64:RW=1,W=4; MG=2")
    assert layouts.items == (
        StagedLayout(frozenset({32, 64}), (("rounded", 1), ("warps", 4))),
        StagedLayout(None, (("m_groups", 2),)),
    )
    assert StagedLayouts.parse(layouts.text()) == layouts and StagedLayouts.parse("") == NO_LAYOUTS
    for bad in ("X=1", "W=four", "0:W=4", "65:W=4", "a,b:W=4"):
        with pytest.raises(ValueError, match="staged layout"):
            StagedLayouts.parse(bad)


def test_a_launch_takes_the_first_layout_that_names_its_rows():
    layouts = StagedLayouts.parse("32,64:RW=0,W=4;MG=2")
    base = staged_config(64, 5120, 64, 4)
    assert staged_config(64, 5120, 64, 4, layouts) == base.__class__(**{**vars(base), "rounded": 0, "warps": 4})
    assert staged_config(16, 5120, 64, 4, layouts).m_groups == 2  # the catch-all
    assert staged_config(16, 5120, 64, 4).m_groups == 1
    # K's split: as `splits` chooses at the layout's chunk, at most KS values a split, or S as given
    assert staged_config(16, 5120, 64, 4).splits == 4
    assert staged_config(16, 5120, 64, 4, StagedLayouts.parse("KS=5120")).splits == 1
    assert staged_config(16, 5120, 64, 4, StagedLayouts.parse("S=2")).splits == 2


def test_the_setting_reaches_every_layer_and_the_record():
    config = KernelConfig.from_env(FAST, {"ENGINE_STAGED_LAYOUT": "64:RW=1"})
    assert config.staged_layouts == StagedLayouts.parse("64:RW=1") and config.settings()["staged_layouts"] == "64:RW=1"
    assert KernelConfig(FAST).settings()["staged_layouts"] == ""
    with pytest.raises(ValueError, match="staged layout"):
        KernelConfig.from_env(FAST, {"ENGINE_STAGED_LAYOUT": "64:RW"})

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.QuantizedLinear.from_linear(nn.Linear(128, 2048, bias=False), group_size=64, bits=4)

    model = Holder()
    install(model, KernelConfig(FAST, force=True, staged_layouts=config.staged_layouts))
    assert model.proj.layouts == config.staged_layouts
    assert "layouts" not in model.proj  # an attribute, not a child of the module


def test_a_layer_s_launches_are_laid_out_by_its_layouts(monkeypatch):
    # the launches `run_kernel` builds for a 64-row call, recorded instead of run (no GPU needed)
    monkeypatch.syspath_prepend(str(ROOT))
    from engine.kernels.quantized_gemv import calls
    from tools.kernel_resources import recorded

    linear = nn.Linear(512, 2048, bias=False)
    linear.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4)
    assert KernelQuantizedLinear.from_module(q, True).kernel_refusal is None
    x = mx.zeros((64, 1, 512), dtype=mx.bfloat16)
    templates = {}
    for text in ("", "64:RW=0,W=2", "32:RW=0"):
        layer = KernelQuantizedLinear.from_module(q, True, layouts=StagedLayouts.parse(text))
        builds = []
        calls._compiled.cache_clear()
        try:
            with recorded(builds):
                mx.eval(layer(x))
        finally:
            calls._compiled.cache_clear()
        part = next(dict(build.template) for build, *_ in builds if build.name.startswith("engine_affine_sqmm1"))
        templates[text] = (part["RW"], part["W"])
    assert templates == {"": (1, 4), "64:RW=0,W=2": (0, 2), "32:RW=0": (1, 4)}
