"""Random weights must not emit ids whose text alone is incomplete UTF-8 (see weights.py)."""

import mlx.core as mx
import numpy as np
import pytest

from engine.loading import load_model
from engine.registry import all_specs, get_spec
from engine.synth.tokenizer import build_tokenizer
from oracles.cases import frozen_prompt_ids


@pytest.mark.parametrize("spec", all_specs(("tiny",)), ids=lambda s: s.name)
def test_suppressed_ids_stay_far_below_the_best_logit(spec, tiny_path):
    model, _ = load_model(tiny_path(spec.name))
    g = spec.geometry
    suppressed = np.array(build_tokenizer(g.model_type, g.vocab_size).suppressed_ids)
    ids = mx.array([frozen_prompt_ids(200, g.vocab_size, seed=7)])
    logits = np.array(model(ids).astype(mx.float32))[0]  # [positions, vocab]
    margin = logits.max(axis=-1) - logits[:, suppressed].max(axis=-1)
    # Sampling at temperature 1 picks a token 10 logits below the best with probability < e^-10 each.
    assert margin.min() > 10.0, f"closest suppressed id came within {margin.min():.2f} of the best logit"


def test_guard_covers_incomplete_utf8_and_specials():
    tok = build_tokenizer("qwen3", 4096)
    assert set(tok.special_ids.values()) <= set(tok.suppressed_ids)
    # every lone byte 0x80-0xFF is in the base alphabet and must be suppressed
    assert len(tok.suppressed_ids) >= 128 + len(tok.special_ids)
    assert get_spec("tiny-qwen3").geometry.vocab_size == 4096
