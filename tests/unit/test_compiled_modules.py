"""/stats `compiled_modules`: the kernel cache directory's compiled modules, and those written since ready."""

from types import SimpleNamespace

from engine.kernels.kernel_cache import module_files
from engine.server.app import compiled_modules


def test_modules_written_after_ready_are_counted(tmp_path):
    assert module_files(None) is None and module_files(tmp_path / "absent") is None
    (tmp_path / "gather_bfloat16_int32_1.ptx").write_text("")
    (tmp_path / "gather_bfloat16_int32_1.txt").write_text("")  # its kernel names: not a module of its own
    ctx = SimpleNamespace(kernel_cache_dir=tmp_path, modules_at_ready=module_files(tmp_path))
    assert compiled_modules(ctx) == {"directory": str(tmp_path), "files": 1, "since_ready": 0}
    (tmp_path / "nested").mkdir()  # MLX nests module names too long for one file name
    (tmp_path / "nested" / "scatter_float32_int32_Assign_2.ptx").write_text("")
    assert compiled_modules(ctx)["since_ready"] == 1
    assert compiled_modules(SimpleNamespace(kernel_cache_dir=None, modules_at_ready=None)) is None
