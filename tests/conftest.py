"""Shared test setup: a model cache that survives between runs of the suite, the `cuda` marker's skip, and a line
at the end for a test skipped for want of a tool.

Synthesized tiny models are deterministic, so tests share one cache
(ENGINE_HARNESS_CACHE if set, else the user's cache) instead of paying for
synthesis per test; concurrent xdist workers synthesize atomically.
"""

from __future__ import annotations

import pytest

from engine.synth import ensure_model


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need MLX's CUDA backend: skipped on any other device."""
    from engine.kernels import on_cuda  # lazily: only this hook needs the kernels package

    if on_cuda():
        return
    skip = pytest.mark.skip(reason="needs MLX's CUDA backend (the cuda marker)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """A test skipped for want of a tool says so at the end of every run, not only under -rs: the report's
    browser test needs chromium, which only .ci/run installs."""
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        if "chromium" in reason:
            terminalreporter.write_line(f"{report.nodeid} skipped: {reason.removeprefix('Skipped: ')}")


@pytest.fixture(scope="session")
def tiny_path():
    """tiny_path(name) -> the cached artifact directory for a registry name."""
    return lambda name, seed=0: ensure_model(name, seed)


@pytest.fixture(scope="session")
def foreign_tokenizer_draft(tmp_path_factory):
    """A copy of tiny-qwen35-draft whose tokenizer maps two tokens to each other's ids.

    Same size, same model: only the id of two strings differs, which is
    exactly what makes a draft's proposals mean other tokens.
    """
    import json
    import shutil

    src = ensure_model("tiny-qwen35-draft")
    dst = tmp_path_factory.mktemp("foreign") / "tiny-qwen35-draft-swapped"
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    return dst
