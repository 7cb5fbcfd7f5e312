#!/usr/bin/env bash
# Device call 2 (after `bash .device-kit/a/hold.sh`), from the repo root:
#   source .device-kit/b/env.sh && PART=tests bash harness/gpu/kernels_qwen27b.sh
# PART=tests:  the kernel numerics tests on CUDA, then `harness kernels` on qwen27b's shapes. The tests
#              take ~7 min in all (165 cases): TESTS_K="matches_mlx" (~130 s), "not matches_mlx and not
#              one_launch" (~225 s) and "one_launch" (~60 s) split them over device calls (pytest -k); with
#              TESTS_K set the kernel table is skipped. TESTS_TIMEOUT (1200 s) stops pytest with its summary.
# PART=gate:   synthesizes qwen27b and runs the whole-model numerics gate (exact vs fast tier)
# PART=native: `harness native --kernels fast` on qwen27b (synthesized if missing)
# PART=diag:   the compiled decode steps', the DeltaNet step kernel's and the fused stages' CUDA tests, then
#              diag_decode_step.py (the fast tier with and without the GEMV epilogues, 3 rounds)
#              and diag_prefill.py on qwen27b
# PART=graphs: diag_decode_step.py once per MLX CUDA graph setting (GRAPH_SETTINGS: space-separated settings,
#              each VAR=value[,VAR=value...], e.g. MLX_MAX_MB_PER_BUFFER=100000,MLX_MAX_OPS_PER_BUFFER=1000)
# PART=gemv:   the register-capped GEMV's CUDA test, then the M = 1 launch-shape sweeps (single 50 MB
#              matrices, then each projection group as one launch); GEMV_ARGS="--serial --no-numerics"
#              sweeps every shape with each call waiting for the one before, as in a decode step, and
#              GROUPS_ARGS=--serial the groups' launches that way (gate+up gated); each writes the
#              ENGINE_GEMV_LAUNCH setting it prefers ($OUT/gemv-launch.txt, gemv-launch-groups.txt)
# PART=clock:  diag_gemv_clock.py (wall time per call by calls an evaluation; the order of events on the
#              device from a timer read inside the kernel), then the row-tile CUDA tests
# PART=profile: diag_decode_step.py on STEP_CONFIGS, ROUNDS rounds: rates, the pipelined loop's host / device
#              split (build, submit, wait) and the step's graph nodes
# PART=ncu:    diag_step_kernels.py under Nsight Compute: each kernel's device time in STEPS decode steps
#              after a PROMPT-token prefill (64; 1024 to see attention at native's context)
# PART=launches: PART=ncu once per ENGINE_GEMV_LAUNCH setting in LAUNCH_SETS ('|'-separated; an empty one
#              is launch_config's choice), STEPS (2) steps each, the summaries in $OUT/step-kernels-launches.txt
#              (~90 s a setting after synth): launch shapes compared in the model, not in isolation;
#              LAUNCH_VAR names another variable for the settings (e.g. ENGINE_GEMV_ACTIVATIONS)
# PART=merge:  diag_launch_merge.py: an MLP-sized stand-in as two dependent launches against one launch with a
#              grid-wide barrier (with and without the second phase's first loads before it); no model needed
# PART=detail: Nsight Compute's full set of sections (stall reasons, memory throughput, occupancy, source
#              counters) on DETAIL_COUNT (8) GEMV launches of a fast decode step's third step (the first two
#              layers' launches), a report and its details page in $OUT; DETAIL_KERNELS (a regex) picks others
# PART=all:    native, then the kernel table, then the tests (-x)
# Results land in $OUT.
set -euo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PART=${PART:-tests}
# each kernel's device time in STEPS ($2 when unset) fast decode steps under Nsight Compute, as csv in $1
ncu_step() {
  ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none --log-file "$1" \
      python3 harness/gpu/diag_step_kernels.py --steps "${STEPS:-$2}" --prompt-tokens "${PROMPT:-64}" 2>&1 | tail -5
}
synth() { [ -f "/tmp/ehc/models/qwen27b-s0/manifest.json" ] || { time python3 -m harness models synth qwen27b ; } 2>&1 | tee -a "$OUT/synth.log"; }
case "$PART" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
    # TESTS_TIMEOUT (s) interrupts pytest itself, which then prints its summary: a `timeout` around this script
    # would leave pytest running on the GPU into the next command, and a `| tail` keeps nothing of a killed run
    timeout -s INT "${TESTS_TIMEOUT:-1200}" python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_kernels.py \
        ${TESTS_K:+-k "$TESTS_K"} \
        > "$OUT/test_kernels.txt" 2>&1 || true
    tail -20 "$OUT/test_kernels.txt"
    [ -n "${TESTS_K:-}" ] || python3 -m harness kernels --shapes qwen27b ${KERNELS_ARGS:-} \
        --json "$OUT/kernels-qwen27b.json" 2>&1 | tee "$OUT/kernels-qwen27b.txt"
    ;;
  gate)
    synth
    python3 -m harness kernels --shapes qwen27b --rows 1 --tokens 1024 --max-shapes 1 --gate-model qwen27b \
        --json "$OUT/gate-qwen27b.json" 2>&1 | tee "$OUT/gate-qwen27b.txt"
    ;;
  native)
    synth
    python3 -m harness native --models qwen27b --kernels fast --prompt-tokens "${PROMPT:-1024}" \
        --decode-tokens "${DECODE:-128}" --samples "${SAMPLES:-5}" --warmup 1 \
        --json "$OUT/native-qwen27b-fast.json" 2>&1 | tee "$OUT/native-qwen27b-fast.txt"
    ;;
  diag)
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py -k "fused or layer_runs or compiled_attention or dense" 2>&1 | tail -20 \
        | tee "$OUT/test_kernels_fused.txt" || true
    synth
    python3 harness/gpu/diag_decode_step.py --tokens 48 --rounds 3 --configs fast_step_kernel_attention,fast_epilogues 2>&1 \
        | tee "$OUT/decode-step.txt" || true
    python3 harness/gpu/diag_prefill.py 2>&1 | tee "$OUT/prefill.txt" || true
    ;;
  graphs)  # decode rate by MLX's CUDA graph settings, one process each (they are read once)
    synth
    for setting in ${GRAPH_SETTINGS:-"default" "MLX_MAX_OPS_PER_BUFFER=50" "MLX_MAX_OPS_PER_BUFFER=100" \
        "MLX_MAX_OPS_PER_BUFFER=200" "MLX_USE_CUDA_GRAPHS=0"}; do
      label=$(echo "$setting" | tr ' ,=' '_+-')
      env $([ "$setting" = default ] || echo "$setting" | tr ',' ' ') python3 harness/gpu/diag_decode_step.py --tokens 48 \
          --rounds "${ROUNDS:-2}" --configs "${STEP_CONFIGS:-fast_norm_out}" --label "$label" 2>&1 \
          | tee -a "$OUT/decode-graphs.txt" || true
    done
    ;;
  gemv)
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py -k "register_cap" 2>&1 | tail -5 \
        | tee "$OUT/test_kernels_capped.txt" || true
    python3 harness/gpu/diag_gemv_configs.py ${GEMV_ARGS:---quick --no-numerics} 2>&1 | tee "$OUT/gemv-configs.txt" || true
    python3 harness/gpu/diag_gemv_groups.py ${GROUPS_ARGS:---sweep} 2>&1 | tee "$OUT/gemv-groups.txt" || true
    ;;
  clock)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
    timeout 420 python3 harness/gpu/diag_gemv_clock.py ${CLOCK_ARGS:-} 2>&1 | tee "$OUT/gemv-clock.txt" || true
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py -k "row_tile" 2>&1 | tail -8 \
        | tee "$OUT/test_kernels_rows.txt" || true
    ;;
  profile)
    synth
    python3 harness/gpu/diag_decode_step.py --tokens 48 --rounds "${ROUNDS:-2}" \
        --configs "${STEP_CONFIGS:-fast_residual_gated,fast_norm_out}" 2>&1 | tee "$OUT/decode-step.txt" || true
    ;;
  ncu)  # each kernel's device time in a fast decode step (Nsight Compute), summed per step and by name
    synth
    ncu_step "$OUT/ncu-step.csv" 3
    python3 harness/gpu/diag_step_kernels.py --summarize "$OUT/ncu-step.csv" --top 30 2>&1 | tee "$OUT/step-kernels.txt"
    ;;
  launches)  # the model's GEMV launches under Nsight Compute, one ENGINE_GEMV_LAUNCH setting after another
    synth
    IFS='|' read -ra settings <<< "${LAUNCH_SETS?LAUNCH_SETS: ENGINE_GEMV_LAUNCH settings separated by |}"
    for i in "${!settings[@]}"; do
      export "${LAUNCH_VAR:-ENGINE_GEMV_LAUNCH}=${settings[$i]}"  # each setting replaces the one before
      ncu_step "$OUT/ncu-step-launches-$i.csv" 2
      { echo "# ${LAUNCH_VAR:-ENGINE_GEMV_LAUNCH}='${settings[$i]}'"
        python3 harness/gpu/diag_step_kernels.py --summarize "$OUT/ncu-step-launches-$i.csv" --top 8; } 2>&1 \
          | tee -a "$OUT/step-kernels-launches.txt"
    done
    ;;
  merge)  # one launch with a grid-wide barrier against two dependent launches (no model needed)
    python3 harness/gpu/diag_launch_merge.py 2>&1 | tee "$OUT/launch-merge.txt" || true
    ;;
  detail)  # why the GEMV launches read slower than a streaming kernel: stalls, bytes in flight, waves
    synth
    ncu --set full --import-source no --clock-control none -k "regex:${DETAIL_KERNELS:-engine_affine_qmm}" \
        --launch-skip "${DETAIL_SKIP:-514}" --launch-count "${DETAIL_COUNT:-8}" -o "$OUT/ncu-detail" \
        python3 harness/gpu/diag_step_kernels.py --steps 1 --prompt-tokens 64 2>&1 | tail -5
    ncu --import "$OUT/ncu-detail.ncu-rep" --page details > "$OUT/ncu-detail.txt" 2>&1 || true
    grep -E 'engine_|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Block Limit|Warp Cycles Per Issued|Long Scoreboard|L2 Hit' \
        "$OUT/ncu-detail.txt" | head -200
    ;;
  all)  # what one device call can hold after hold.sh: native first, then the kernel table, then the tests
    synth
    PART=native bash "$0"
    python3 -m harness kernels --shapes qwen27b --repeats 5 --json "$OUT/kernels-qwen27b.json" 2>&1 | tee "$OUT/kernels-qwen27b.txt"
    python3 -m pytest -x -q -p no:cacheprovider tests/unit/test_kernels.py 2>&1 | tail -60 | tee "$OUT/test_kernels.txt" || true
    ;;
  *) echo "PART must be tests, gate, native, diag, graphs, gemv, clock, profile, ncu, launches, merge, detail or all" >&2; exit 2 ;;
esac
