"""Float32 numerics tests on CUDA: MLX runs float32 matmuls as TF32 (10-bit mantissas in) unless
MLX_ENABLE_TF32=0, read when MLX starts, so such a test reruns itself in a process started without TF32."""

import os
import subprocess
import sys

from engine.kernels import on_cuda


def rerun_without_tf32(test_file: str, test: str) -> bool:
    """Whether `test` (a test function of `test_file`) ran here in a child process without TF32, and passed
    there (False off CUDA or where TF32 is already off: run the test as it is)."""
    if not on_cuda() or os.environ.get("MLX_ENABLE_TF32") == "0":
        return False
    env = {**os.environ, "MLX_ENABLE_TF32": "0"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{test}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    return True
