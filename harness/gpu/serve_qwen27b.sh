#!/usr/bin/env bash
# Device call 2 (after `bash .device-kit/a/hold.sh`), from the repo root:
#   source .device-kit/b/env.sh && bash harness/gpu/serve_qwen27b.sh
# The server on CUDA: the live server tests and the prompt-cache exactness
# tests on tiny models, then `harness server-overhead` on qwen27b (in process
# vs through `engine serve`, serial and continuous lanes). Results under $OUT.
# Each server process compiles its CUDA kernels afresh, so the two parts fit
# one device call each: PART=live (tests + synthesis), then PART=bench.
set -uo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" | tee "$OUT/gpu.txt"
if [ "${PART:-live}" = live ]; then
python3 -m pytest -q -n "${WORKERS:-4}" tests/live tests/unit/test_prompt_cache.py \
    2>&1 | tail -60 > "$OUT/live-cuda.log"
tail -5 "$OUT/live-cuda.log"
{ time python3 -m harness models synth "${MODEL:-qwen27b}" ; } > "$OUT/synth.log" 2>&1
tail -3 "$OUT/synth.log"
else
python3 -m harness server-overhead --models "${MODEL:-qwen27b}" --prompt-tokens "${PROMPT:-1024}" \
    --decode-tokens "${DECODE:-64}" --samples "${SAMPLES:-3}" --json "$OUT/server-overhead.json" 2>&1 \
    | tee "$OUT/server-overhead.log"
fi
