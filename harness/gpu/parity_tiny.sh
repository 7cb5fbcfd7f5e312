#!/usr/bin/env bash
# On a warm GPU machine: source .device-kit/b/env.sh && bash harness/gpu/parity_tiny.sh
# The B=1 parity gate on the CUDA backend: matrix kernels differ from the CPU's,
# so this is where device-dependent numerics would show.
set -euo pipefail
export ENGINE_HARNESS_CACHE=/tmp/ehc PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m harness parity --json "$OUT/parity-gpu.json" ${PARITY_ARGS:-} 2>&1 | tee "$OUT/parity-gpu.log"
