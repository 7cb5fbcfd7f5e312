import json

import pytest

from engine.cli import main as engine_main
from harness.cli import main as harness_main


def test_help_explains_every_command(capsys):
    for argv in (["--help"], ["models", "--help"], ["parity", "--help"], ["native", "--help"]):
        with pytest.raises(SystemExit) as e:
            harness_main(argv)
        assert e.value.code == 0
    text = capsys.readouterr().out
    assert "bit for bit" in text and "synth" in text and "alternate" in text


def test_models_list_json(capsys, tiny_path):
    tiny_path("tiny-qwen35")
    assert harness_main(["models", "list", "--tier", "tiny", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in rows if r["name"] == "tiny-qwen35")
    assert row["cached"] and row["parameters"] > 0 and row["weight_bytes"] > 0


def test_unknown_model_is_a_clean_error(capsys):
    assert harness_main(["models", "synth", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert engine_main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2


def test_bad_model_path_is_a_clean_error(tmp_path, capsys):
    assert engine_main(["generate", "--model-path", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_synth_into_a_directory(tmp_path, capsys):
    out = tmp_path / "m"
    assert harness_main(["models", "synth", "tiny-llama-4bit", "--out", str(out)]) == 0
    assert (out / "manifest.json").exists() and (out / "model.safetensors").exists()
    written = capsys.readouterr()
    assert written.out.split() == [str(out)] and str(out) not in written.err  # the path once, on stdout
    assert harness_main(["models", "synth", "tiny-llama-4bit", "--out", str(out)]) == 0  # already there
    again = capsys.readouterr()
    assert "already" in again.err and again.out.split() == [str(out)]


def test_parity_command_passes_and_writes_json(tmp_path, capsys):
    report = tmp_path / "p.json"
    rc = harness_main(
        [
            "parity",
            "--models",
            "tiny-llama",
            "--dtypes",
            "f32",
            "--prompt-lengths",
            "5",
            "--steps",
            "4",
            "--json",
            str(report),
        ]
    )
    assert rc == 0
    rows = json.loads(report.read_text())
    assert rows[0]["passed"] and rows[0]["max_abs_diff"] == 0.0


def test_parity_takes_a_model_directory(tmp_path, tiny_path):
    report = tmp_path / "p.json"
    path = tiny_path("tiny-gemma3-f32")
    rc = harness_main(
        ["parity", "--model-path", str(path), "--prompt-lengths", "70", "--steps", "3", "--json", str(report)]
    )
    assert rc == 0 and json.loads(report.read_text())[0]["model_path"] == str(path)


def test_parity_batch_runs_the_same_b_scenarios(tmp_path):
    report = tmp_path / "b.json"
    rc = harness_main(["parity", "--models", "tiny-llama", "--dtypes", "bf16", "--batch", "2", "--json", str(report)])
    rows = json.loads(report.read_text())
    assert rc == 0 and rows[0]["name"] == "B=2 simultaneous" and rows[0]["passed"]
    assert harness_main(["parity", "--batch", "0"]) == 2


def test_engine_generate_prints_text_and_timing(capsys, tiny_path):
    tiny_path("tiny-qwen3")
    assert engine_main(["generate", "--model", "tiny-qwen3", "--prompt", "Hi", "--max-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "generated" in captured.err
    assert engine_main(["generate", "--model", "tiny-qwen3", "--prompt", "Hi", "--top-p", "3"]) == 2


def test_kernel_cache_dir_points_mlx_at_it(tmp_path):
    from engine import env
    from engine.cli import build_parser, use_kernel_cache

    environ = {}
    where = use_kernel_cache(tmp_path / "kernels" / "cuda", environ)
    assert where.is_dir() and environ == {"MLX_PTX_CACHE_DIR": str(where)}
    assert use_kernel_cache(None, environ) == where  # MLX_PTX_CACHE_DIR where set
    default = {}
    assert use_kernel_cache(None, default) == env.kernels_dir() and default["MLX_PTX_CACHE_DIR"] == str(
        env.kernels_dir()
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--kernel-cache-dir"):
        use_kernel_cache(tmp_path / "file" / "sub", {})
    args = build_parser().parse_args(["serve", "--model", "tiny-qwen3", "--kernel-cache-dir", str(tmp_path)])
    assert args.kernel_cache_dir == tmp_path


def test_output_to_a_pipe_is_not_wrapped_at_80_columns(capsys):
    from harness.cli_common import console, out

    line = "word " * 60  # 300 characters: a log line with a server's command, say
    console.print(line, markup=False)
    out.print(line, markup=False)
    written = capsys.readouterr()
    assert written.err.strip() == line.strip() and written.out.strip() == line.strip()
