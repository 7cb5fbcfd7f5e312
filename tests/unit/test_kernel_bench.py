"""harness kernels: shapes from the registry, the done-criteria verdicts, the command (CPU)."""

import json

import mlx.core as mx

from engine.device import device_label
from engine.kernels import on_cuda
from engine.kernels.quantized_gemv import DENSE_MIN_ROWS
from engine.registry import get_spec
from harness.cli import main
from harness.kernels.bench import (
    BenchConfig,
    DeltaResult,
    GemvResult,
    bench_delta,
    bench_prefill,
    linear_shapes,
    projection_groups,
    verdicts,
    weight_copies,
)


def gemv(n, k, m, layers, builtin_us, kernel_us):
    return GemvResult(
        n=n,
        k=k,
        m=m,
        bits=4,
        group_size=64,
        layers=layers,
        builtin_us=builtin_us,
        kernel_us=kernel_us,
        bytes_moved=n * k // 2,
        max_abs_diff=0.0,
        max_abs_ref=1.0,
    )


def test_linear_shapes_come_from_the_geometry_without_weights():
    shapes = linear_shapes(get_spec("qwen27b"))  # 27B parameters, built lazily: nothing is allocated
    assert shapes[(17408, 5120)] == 130  # gate and up projections of 64 layers + the MTP layer
    assert shapes[(5120, 17408)] == 65
    assert shapes[(248320, 5120)] == 1


def test_projection_groups_are_the_layers_that_share_an_input():
    groups = projection_groups(get_spec("qwen27b"))
    assert groups[("gate+up", (17408, 17408), 5120)] == 65  # 64 layers + the MTP layer
    assert groups[("q/k/v", (12288, 1024, 1024), 5120)] == 17  # 16 attention layers + the MTP layer
    assert groups[("DeltaNet inputs", (10240, 6144, 48, 48), 5120)] == 48
    assert len(groups) == 3


def test_verdicts_check_the_main_matrix_and_the_prefill():
    results = [
        gemv(248320, 5120, 1, 1, 700.0, 100.0),  # the head: one layer, not the main matrix
        gemv(17408, 5120, 1, 130, 140.0, 17.0),
        gemv(17408, 5120, 8, 130, 50.0, 30.0),
        gemv(1024, 5120, 1, 34, 9.0, None),
    ]
    delta = [
        DeltaResult(1024, 16, 48, 128, 128, builtin_ms=70.0, kernel_ms=2.5, max_abs_diff_y=0.0, max_abs_diff_state=0.0)
    ]
    got = {v.criterion: v for v in verdicts(results, delta)}
    assert got["GEMV 17408x5120 M=1 GB/s"].ok is True  # 44.6 MB in 17 us
    assert got["GEMV 17408x5120 M=1 speedup vs MLX"].ok is True
    assert got["GEMV 17408x5120 M=8 time / M=1 time"].ok is False  # 30 / 17 > 1.5
    assert got["chunked DeltaNet 1024-token prefill speedup"].ok is True
    off_cuda = verdicts([gemv(17408, 5120, 1, 130, 140.0, None)], [])
    assert [v.ok for v in off_cuda] == [None, None]


def test_batched_rows_are_judged_by_their_slowest_shape_against_the_peak():
    # 44.6 MB (17408x5120) in 12 us is 3.7 TB/s (0.77), 1024x5120 (2.6 MB) in 9 us 0.3: the worst fraction decides
    fast = gemv(17408, 5120, 32, 130, 140.0, 12.0)
    got = {v.criterion: v for v in verdicts([fast, gemv(1024, 5120, 32, 34, 9.0, 9.0)], [], 4800)}
    v = got["GEMV every shape M=32 fraction of 4800 GB/s"]
    assert v.ok is False and v.target == 0.70 and v.measured < 0.1
    assert got_ok(verdicts([fast], [], 4800)) == [True]
    assert not any("every shape" in v.criterion for v in verdicts([fast], [], None))  # no peak, no verdict
    assert got_ok(verdicts([gemv(17408, 5120, 64, 130, 140.0, None)], [], 4800)) == [None]  # not timed here


def got_ok(vs):
    return [v.ok for v in vs if "every shape" in v.criterion]


def test_a_speedup_target_above_the_machines_bandwidth_says_so():
    main = gemv(17408, 5120, 1, 130, 60.0, 25.0)  # 44.6 MB: MLX 743 GB/s, 7x is 5199
    speedup = lambda peak: next(v for v in verdicts([main], [], peak) if "speedup" in v.criterion)  # noqa: E731
    assert "unreachable" in speedup(4800).note and "5199 GB/s" in speedup(4800).note
    assert speedup(8000).note == "" and speedup(None).note == ""


def test_delta_bench_agrees_with_the_recurrence():
    r = bench_delta(32, 2, 4, 16, 16, BenchConfig(repeats=1, warmup=0))
    assert r.max_abs_diff_state < 1e-5 and r.builtin_ms > 0 and r.kernel_ms > 0


def test_kernels_command_writes_json_off_cuda(tmp_path, capsys):
    out = tmp_path / "k.json"
    code = main(
        [
            "kernels",
            "--shapes",
            "tiny-qwen35",
            "--rows",
            "1",
            "--tokens",
            "16",
            "--repeats",
            "1",
            "--max-shapes",
            "2",
            "--cold-mb",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert record["device"] == device_label() and record["cold_bytes"] == 1 << 20
    assert record["gemv"][0]["kernel_us"] is None and "CUDA" in record["gemv"][0]["note"]
    assert record["gemv"][0]["serial_builtin_us"] > 0 and record["gemv"][0]["serial_kernel_us"] is None
    assert record["delta"][0]["tokens"] == 16
    assert {g["label"] for g in record["groups"]} == {"gate+up", "q/k/v", "DeltaNet inputs"}
    assert all(g["kernel_us"] is None and g["builtin_us"] > 0 for g in record["groups"])
    assert record["prefill"] == []  # 16 tokens is no prompt chunk the dense path takes
    printed = capsys.readouterr().out
    assert "not measured" in printed and "rotated over 1 MB" in printed and "serial" in printed


def test_prompt_chunk_bench_times_mlx_and_the_dense_path_where_the_fast_tier_runs_it():
    r = bench_prefill(n=1024, k=128, m=DENSE_MIN_ROWS, bits=4, group_size=64, layers=3, cfg=BenchConfig(repeats=1))
    assert r.builtin_us > 0 and r.tflops(r.builtin_us) > 0 and r.layers == 3
    if on_cuda():
        assert r.kernel_us > 0 and r.max_abs_diff is not None
    else:
        assert r.kernel_us is None and r.speedup is None and "CUDA" in r.note


def test_weight_copies_cover_the_cold_bytes_round_robin():
    w, s, b = mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=4)
    nbytes = w.nbytes + s.nbytes + b.nbytes
    nxt = weight_copies(w, s, b, BenchConfig(cold_bytes=3 * nbytes - 1))
    seen = [nxt() for _ in range(6)]
    assert [c[0] is seen[0][0] for c in seen] == [True, False, False, True, False, False]  # 3 copies, cycled
    assert seen[0][0] is w and mx.array_equal(seen[1][0], w).item() and mx.array_equal(seen[2][1], s).item()
    assert len({id(c[0]) for c in seen}) == 3
    assert weight_copies(w, s, b, BenchConfig(cold_bytes=0))()[0] is w
    capped = weight_copies(w, s, b, BenchConfig(cold_bytes=100 * nbytes, max_copies=2))
    assert [capped()[0] is w for _ in range(4)] == [True, False, True, False]


def test_serial_timing_chains_each_call_on_the_one_before():
    from harness.kernels.bench import BenchConfig, serial_us

    seen = []

    def step(prev):
        seen.append(prev)
        return prev + 1

    us = serial_us(step, mx.array(0), BenchConfig(warmup=1, repeats=2, calls=5))
    assert us > 0
    # each evaluation's calls form one chain from the start: 0, 1, 2, 3, 4
    assert [a.item() for a in seen[:5]] == [0, 1, 2, 3, 4]
