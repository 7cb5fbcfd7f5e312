#!/usr/bin/env bash
# Device call 2 (after `bash .device-kit/a/hold.sh`), from the repo root:
#   source .device-kit/b/env.sh && PART=tests bash harness/gpu/spec_qwen27b.sh
#   source .device-kit/b/env.sh && PART=bench bash harness/gpu/spec_qwen27b.sh
# PART=tests: the speculative-decoding tests on CUDA (unit, mlx-lm speculative
# oracle, live server), then synthesizes qwen27b and its draft companion.
# PART=bench: `harness spec` on qwen27b (plain, prompt lookup, the MTP head,
# the 0.8B draft, self-draft; POLICY=fixed|adaptive). Results under $OUT.
set -uo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" | tee "$OUT/gpu.txt"
if [ "${PART:-tests}" = tests ]; then
python3 -m pytest -q -n "${WORKERS:-4}" tests/unit/test_spec.py tests/unit/test_spec_policy.py \
    tests/parity/test_spec_oracle.py tests/live/test_server_spec.py 2>&1 | tail -80 > "$OUT/spec-tests-cuda.log"
tail -5 "$OUT/spec-tests-cuda.log"
{ time python3 -m harness models synth "${MODEL:-qwen27b}" qwen35-0.8b ; } > "$OUT/synth.log" 2>&1
tail -3 "$OUT/synth.log"
else
python3 -m harness spec --model "${MODEL:-qwen27b}" --arms "${ARMS:-plain,ngram,mtp,draft:qwen35-0.8b,self}" \
    --prompt-tokens "${PROMPT:-256}" --decode-tokens "${DECODE:-64}" --blocks "${BLOCKS:-5}" \
    --policy "${POLICY:-fixed}" --json "$OUT/spec-qwen27b-${POLICY:-fixed}.json" \
    --md "$OUT/spec-qwen27b-${POLICY:-fixed}.md" 2>&1 | tail -30 | tee "$OUT/spec.log"
fi
