"""Every synthesized tiny and small model is a valid mlx-lm model directory."""

import pytest

from engine.registry import all_specs


@pytest.mark.parametrize("spec", all_specs(("tiny", "small")), ids=lambda s: s.name)
def test_mlx_lm_loads_and_generates(spec, tiny_path):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_path(spec.name)))  # strict: every weight present, none extra
    if spec.tier == "tiny":
        text = mlx_lm.generate(model, tokenizer, "The quick brown fox", max_tokens=8)
        assert isinstance(text, str) and text.strip()
        assert "\ufffd" not in text  # the UTF-8 guard at work
