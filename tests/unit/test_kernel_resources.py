"""tools.kernel_resources builds the quantized matmul's launches as MLX would, on a machine without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def _launches(*args: str) -> str:
    cmd = [sys.executable, "-m", "tools.kernel_resources", "--list", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_each_row_count_lists_its_launches_and_a_layout_changes_them():
    out = _launches("--rows", "1,16", "--shape", "5120x17408", "--staged", "KS=4352,W=2")
    # one row: the register kernel; 16: the staged kernel split in 8 (SPLIT_K_VALUES) and the sums' launch
    assert re.search(r"^5120x17408 M=1 \[default\] engine_affine_qmm1: grid \d+ x \d+ threads", out, re.M), out
    assert re.search(r"^5120x17408 M=16 \[default\] engine_affine_sqmm1_part: grid 320 x 128 threads", out, re.M), out
    assert re.search(r"^5120x17408 M=16 \[default\] engine_affine_sqmm_sum1: grid 80 x 1024 threads", out, re.M), out
    # the layout: 2 warps (64 rows a block) and 4 splits of at most 4352 values
    assert re.search(r"^5120x17408 M=16 \[KS=4352,W=2\] engine_affine_sqmm1_part: grid 320 x 64 threads", out, re.M), (
        out
    )
    assert "M=1 [KS=4352,W=2]" not in out  # layouts are the staged kernel's (2-64 rows)


def test_one_row_launch_shapes_are_listed_as_given():
    out = _launches("--rows", "1,16", "--shape", "5120x17408", "--launch", "4,2,4")
    assert re.search(r"^5120x17408 M=1 \[4,2,4\] engine_affine_qmm1: grid 160 x 128 threads", out, re.M), out
    assert "M=16 [4,2,4]" not in out  # one-row launches only


def test_a_staged_launch_says_what_it_reads_from_l2():
    # 64 rows of 17408 values a block (2176 a split), 320 blocks: 89.1 MB of activations, twice that in 2-warp blocks
    out = _launches("--rows", "64", "--shape", "5120x17408", "--staged", "64:W=2")
    default = "5120x17408 M=64 [default] engine_affine_sqmm1_part: grid 320 x 128 threads"
    assert re.search(rf"^{re.escape(default)}.*; L2 reads 89\.1 MB of activations for 50\.1 MB of weights$", out, re.M)
    assert re.search(r"^5120x17408 M=64 \[64:W=2\] .*L2 reads 178\.3 MB of activations", out, re.M), out
    assert not re.search(r"sqmm_sum1.*L2 reads", out)


def test_the_parts_of_a_batched_step_are_listed():
    out = _launches("--rows", "32", "--parts", "gate+up prenormed,down+residual")
    assert "M=32 gate+up prenormed [default] engine_affine_sqmm2_part" in out, out
    assert "M=32 gate+up prenormed [default] engine_affine_sqmm_sum2_g_pn" in out, out
    assert "M=32 down+residual [default] engine_affine_sqmm1_part" in out, out
    assert "M=32 down+residual [default] engine_affine_sqmm_sum1_r" in out, out
    bad = subprocess.run(
        [sys.executable, "-m", "tools.kernel_resources", "--list", "--rows", "32", "--parts", "gate+down"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "'gate+down' launches nothing" in bad.stderr, bad.stderr


def test_the_deltanet_kernels_are_listed_per_row_count_and_state_dtype():
    out = _launches("--rows", "1,64", "--delta", "16,48,128,128", "--state-dtypes", "float32,float16")
    # a block of 512 threads per (row, value head): 48 blocks at one row, 3072 at 64; step and scan each
    for m, blocks in ((1, 48), (64, 3072)):
        for dtype in ("float32", "float16"):
            for kernel in ("step", "scan"):
                line = f"delta 16,48,128,128 M={m} {dtype} engine_gated_delta_{kernel}_512: grid {blocks} x 512 threads"
                assert line in out, out


def test_the_main_loop_is_the_backward_branch_with_the_most_hmma(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.kernel_resources import loop_mix

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   LDS.128 R8, [R2] ;
        /*0040*/                   PRMT R10, R8, 0x5410, R9 ;
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R8, R10, R12 ;
        /*0070*/               @P1 BRA 0x30 ;
        /*0080*/                   BRA 0x80;
        /*0090*/                   EXIT ;
"""
    count, hmma, mix = loop_mix(sass)
    assert (count, hmma) == (5, 2)
    assert mix == {"LDS": 1, "PRMT": 1, "HMMA": 2, "BRA": 1}
    assert loop_mix("") == (0, 0, {})


def test_blocks_an_sm_and_the_last_wave(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.kernel_resources import blocks_per_sm, waves_line

    # 128 threads at 106 registers: 3328 a warp, 19 warps, 4 blocks; 48 KB of shared memory would allow 4 too
    assert blocks_per_sm(128, 106, 48128) == (4, "registers")
    assert blocks_per_sm(64, 164, 48128) == (4, "shared")  # 6 by registers, 4 by 48 KB + 1 KB
    assert blocks_per_sm(1024, 22, 0) == (2, "threads")
    assert blocks_per_sm(32, 16, 0) == (32, "blocks")
    # the 64-row down projection's products: 640 blocks on 132 SMs x 4 is a full wave and 112 blocks more
    assert (
        waves_line(640, 128, 106, 48128, 132) == "4 blocks an SM (registers), 1.21 waves on 132 SMs, the last 21% full"
    )
    assert waves_line(528, 128, 106, 48128, 132).endswith("1.00 waves on 132 SMs, the last 100% full")
    assert waves_line(1, 128, 106, 300_000, 132) == "does not fit an SM (shared)"
