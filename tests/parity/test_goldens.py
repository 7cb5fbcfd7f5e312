"""The engine against frozen mlx-lm outputs (goldens/b1), without running mlx-lm.

The goldens were written by oracles/make_goldens.py; if an artifact changes
(synthesis changed), this fails and says so: regenerate the goldens with that
script and give the reason in the commit.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.generate import generate
from engine.loading import load_model
from engine.registry import get_spec
from engine.request import StopCriteria
from engine.synth import ensure_model
from oracles.cases import frozen_prompt_ids
from oracles.make_goldens import artifact_digest, ids_digest, logits_record

pytestmark = pytest.mark.parity

GOLDENS = sorted((Path(__file__).resolve().parents[2] / "goldens" / "b1").glob("*.json"))


def test_goldens_exist_for_every_tiny_family():
    names = {p.stem for p in GOLDENS}
    for base in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen35", "tiny-gemma3"):
        assert {base, f"{base}-f32", f"{base}-4bit"} <= names


@pytest.mark.parametrize("golden_file", GOLDENS, ids=lambda p: p.stem)
def test_engine_reproduces_the_goldens(golden_file):
    golden = json.loads(golden_file.read_text())
    path = ensure_model(golden["model"], golden["seed"])
    assert artifact_digest(path) == golden["artifact"], (
        "the synthesized artifact differs from the one the goldens were made from; "
        "if synthesis changed on purpose, rerun `python -m oracles.make_goldens --reason ...`"
    )
    model = load_model(path)[0]
    vocab = get_spec(golden["model"]).geometry.vocab_size
    for case in golden["cases"]:
        ids = frozen_prompt_ids(case["prompt_len"], vocab, golden["seed"])
        assert ids_digest(ids) == case["prompt_sha256"], "the frozen prompt ids changed"
        logits = []
        tokens = [
            t.token_id
            for t in generate(
                model,
                ids,
                stop=StopCriteria(max_tokens=case["steps"] + 1, ignore_eos=True),
                tap=lambda s: logits.append(s.logits.astype(mx.float32)),
            )
        ]
        mx.eval(logits)
        assert tokens[: case["steps"]] == case["tokens"], f"L={case['prompt_len']}: tokens differ"
        assert len(logits) == len(case["forwards"])
        for i, (x, want) in enumerate(zip(logits, case["forwards"])):
            got = logits_record(np.array(x[0]))
            assert got == want, f"L={case['prompt_len']}: forward {i} differs (top5 {got['top5']} vs {want['top5']})"
