#!/usr/bin/env bash
# On the GPU machine (after hold.sh): source .device-kit/b/env.sh && bash harness/gpu/batch_qwen27b.sh
# Synthesizes qwen27b (if this machine has not yet) and runs the scheduler overhead
# benchmark on it: one request continuous vs serial, C concurrent vs mlx-lm BatchGenerator.
set -euo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m harness models synth "${MODEL:-qwen27b}" 2>&1 | tail -2
python3 -m harness batch-bench --models "${MODEL:-qwen27b}" --prompt-tokens "${PROMPT:-128}" \
    --decode-tokens "${DECODE:-64}" --concurrency "${CONCURRENCY:-4,8}" --samples "${SAMPLES:-2}" --warmup 1 \
    --json "$OUT/batch-bench.json" 2>&1 | tee "$OUT/batch-bench.log"
