#!/usr/bin/env bash
# Device call 2 (after `bash .device-kit/a/hold.sh`), from the repo root:
#   source .device-kit/b/env.sh && bash harness/gpu/native_qwen27b.sh
# Synthesizes qwen27b on the GPU machine (nothing that large can travel) and
# runs the in-process speed check, engine vs mlx-lm, writing under $OUT.
set -euo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)" | tee -a "$OUT/gpu.txt"
{ time python3 -m harness models synth "${MODEL:-qwen27b}" ; } 2>&1 | tee "$OUT/synth.log"
cp "/tmp/ehc/models/${MODEL:-qwen27b}-s0/manifest.json" "$OUT/manifest.json"
python3 -m harness native --models "${MODEL:-qwen27b}" --prompt-tokens "${PROMPT:-1024}" --decode-tokens "${DECODE:-128}" \
    --samples "${SAMPLES:-5}" --warmup 1 --json "$OUT/native-qwen27b.json" 2>&1 | tee "$OUT/native-qwen27b.log"
