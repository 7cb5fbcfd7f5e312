#!/usr/bin/env bash
# The GPU tier's runs on qwen27b (and the tiny models' CUDA parity gate), from the repo root on a CUDA
# machine with MLX's CUDA backend installed:
#   PART=native bash harness/gpu/qwen27b.sh
# Settings (environment):
#   PART                  tests (default) | kernels | gate | native | run-all | parity | ncu | profile
#   OUT                   where results land (default /tmp/out)
#   ENGINE_HARNESS_CACHE  where models are synthesized (default /tmp/ehc; qwen27b takes ~1 minute and 15 GB)
# Per part:
#   tests    TESTS_K (a pytest -k expression), WORKERS (pytest -n, default 4), TESTS_TIMEOUT (s, default 1200)
#   kernels  KERNELS_ARGS (more `harness kernels` options, e.g. "--rows 1,8 --tokens 1024")
#   gate     GATE_ROWS (default 1,8), GATE_ARGS (more `harness kernels --gate-model` options)
#   native   KERNELS (auto|exact|fast, default auto), PROMPT (1024), DECODE (128), SAMPLES (5)
#   run-all  TOKENS (64), RUN_ARGS (more `harness run all` options, e.g. "--decode-samples 3")
#   parity   PARITY_ARGS (more `harness parity` options, e.g. "--batch 2,3,4,8")
#   ncu      STEPS (3), PROMPT (64), TOP (30): Nsight Compute (`ncu`) over a few fast decode steps
#   profile  ROUNDS (2), STEP_CONFIGS (tools/gpu/decode_step.py's --configs)
set -euo pipefail
export ENGINE_HARNESS_CACHE=${ENGINE_HARNESS_CACHE:-/tmp/ehc} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
PART=${PART:-tests}
mkdir -p "$OUT"

synth() { [ -f "$ENGINE_HARNESS_CACHE/models/qwen27b-s0/manifest.json" ] || python3 -m harness models synth qwen27b; }

case "$PART" in
  tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"; } | tee "$OUT/gpu.txt"
    # TESTS_TIMEOUT interrupts pytest itself, which then prints its summary: a `timeout` around this script would
    # leave pytest running on the GPU into the next command, and a `| tail` keeps nothing of a killed run
    rc=0
    timeout -s INT "${TESTS_TIMEOUT:-1200}" python3 -m pytest -q -p no:cacheprovider -rs -n "${WORKERS:-4}" \
        tests/unit/test_kernels.py tests/unit/test_cuda_source.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/kernel-tests.txt" 2>&1 || rc=$?
    tail -20 "$OUT/kernel-tests.txt"
    exit "$rc"
    ;;
  kernels)
    python3 -m harness kernels --shapes qwen27b ${KERNELS_ARGS:-} --json "$OUT/qwen27b-kernels.json" 2>&1 \
        | tee "$OUT/qwen27b-kernels.txt"
    ;;
  gate)
    synth
    python3 -m harness kernels --gate-model qwen27b --gate-rows "${GATE_ROWS:-1,8}" ${GATE_ARGS:-} \
        --json "$OUT/qwen27b-gate.json" 2>&1 \
        | tee "$OUT/qwen27b-gate.txt"
    ;;
  native)
    synth
    python3 -m harness native --models qwen27b --kernels "${KERNELS:-auto}" --prompt-tokens "${PROMPT:-1024}" \
        --decode-tokens "${DECODE:-128}" --samples "${SAMPLES:-5}" --warmup 1 --json "$OUT/qwen27b-native.json" 2>&1 \
        | tee "$OUT/qwen27b-native.txt"
    ;;
  run-all)  # the Markdown summary is written next to the JSON
    synth
    python3 -m harness run all --models qwen27b --tokens "${TOKENS:-64}" --skip-context ${RUN_ARGS:-} \
        --out "$OUT/qwen27b-run-all.json" --db "$OUT/runs.sqlite" 2>&1 | tee "$OUT/qwen27b-run-all.txt"
    ;;
  parity)  # the tiny models' B=1 gate: CUDA's matrix kernels differ from the CPU's
    python3 -m harness parity ${PARITY_ARGS:-} --json "$OUT/parity-cuda.json" 2>&1 | tee "$OUT/parity-cuda.txt"
    ;;
  ncu)  # each kernel's device time in STEPS fast decode steps, summed per step and by kernel name
    synth
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none --log-file "$OUT/ncu-step.csv" \
        python3 -m tools.gpu.step_kernels --steps "${STEPS:-3}" --prompt-tokens "${PROMPT:-64}" 2>&1 | tail -5
    python3 -m tools.gpu.step_kernels --summarize "$OUT/ncu-step.csv" --top "${TOP:-30}" 2>&1 \
        | tee "$OUT/qwen27b-step-kernels.txt"
    ;;
  profile)  # a decode step's host build, submit and wait, per configuration, alternating
    synth
    python3 -m tools.gpu.decode_step --tokens 48 --rounds "${ROUNDS:-2}" ${STEP_CONFIGS:+--configs "$STEP_CONFIGS"} 2>&1 \
        | tee "$OUT/decode-step.txt"
    ;;
  *) echo "PART must be tests, kernels, gate, native, run-all, parity, ncu or profile (got '$PART')" >&2; exit 2 ;;
esac
