"""The engine owns its model code: importing mlx-lm's models or generation would
make every parity test compare mlx-lm with itself."""

import ast
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "engine"
FORBIDDEN = ("mlx_lm.models", "mlx_lm.generate")


def _imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_no_engine_file_imports_mlx_lm_models_or_generate():
    offenders = [
        f"{p.relative_to(ENGINE.parent)}: {name}"
        for p in ENGINE.rglob("*.py")
        for name in _imports(p)
        if name.startswith(FORBIDDEN) or name in ("mlx_lm.models", "mlx_lm.generate")
    ]
    assert offenders == []


def test_loading_and_generating_leaves_mlx_lm_models_unimported(tiny_path):
    path = tiny_path("tiny-qwen35")
    code = (
        "import sys\n"
        "from engine.engine import Engine\n"
        f"e = Engine.load(model_path={str(path)!r}, with_tokenizer=False)\n"
        "list(e.generate([1, 2, 3], max_tokens=3))\n"
        "bad = [m for m in sys.modules if m.startswith(('mlx_lm.models', 'mlx_lm.generate'))]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
