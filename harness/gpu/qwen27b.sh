#!/usr/bin/env bash
# The GPU tier's runs on qwen27b (and the tiny models' CUDA parity gate), from the repo root on a CUDA
# machine with MLX's CUDA backend installed:
#   PART=native bash harness/gpu/qwen27b.sh
# Settings (environment):
#   PART                  tests (default) | kernels | gate | native | run-all | startup | batch | parity | ncu | profile
#                         | census | lane | prefill | first | burst | dequant | switch | chunks | attention | prompt
#                         | pieces | layouts | waves;
#                         several, space-separated,
#                         run one after another, each under a timed header, the next one also after a failure
#   OUT                   where results land (default /tmp/out)
#   ENGINE_HARNESS_CACHE  where models are synthesized (default /tmp/ehc; qwen27b takes ~1 minute and 15 GB)
# Per part:
#   tests    TESTS_K (a pytest -k expression), WORKERS (pytest -n, default 4), TESTS_TIMEOUT (s, default 1200)
#   kernels  KERNELS_ARGS (more `harness kernels` options, e.g. "--rows 1,8 --tokens 1024")
#   gate     GATE_ROWS (default 1,8), GATE_ARGS (more `harness kernels --gate-model` options)
#   native   KERNELS (auto|exact|fast, default auto), PROMPT (1024), DECODE (128), SAMPLES (5)
#   run-all  TOKENS (64), RUN_ARGS (more `harness run all` options, e.g. "--decode-samples 3")
#   startup  STARTUP_ARGS (more `harness startup` options, e.g. "--bursts 32,64 --no-restart"): load to ready,
#            bursts after ready, lone requests against the serial lane, a restart on the same kernel cache
#   batch    ROWS (1,8,16,32,64), CONCURRENCY (8,16,32,64), DECODE (32): the batched step's wall time and its
#            parts at each row count, then `harness batch-bench --kernels fast` against mlx-lm
#   parity   PARITY_ARGS (more `harness parity` options, e.g. "--batch 2,3,4,8")
#   ncu      ROWS (1), TIERS (fast), STEPS (3), PROMPT (64), TOP (30): the wall step time at each row count
#            and tier, then Nsight Compute (`ncu`) over a few decode steps of each, summed by kernel name
#   profile  ROUNDS (2), STEP_CONFIGS (tools/gpu/decode_step.py's --configs)
#   census   WAVES (1,1,2,3,4,8,9,16), GROW (300): what MLX compiles at each new batcher shape, and its cost
#   lane     a lone row's fast-tier step on the serial lane's caches, on the batcher's, and on the batcher's
#            with each attention kernel switch off; then a lone request's rate at each layer of the stack
#            (tools/gpu/lone_lanes.py; LANES_ARGS, default "--warmup full --burst 64 --reset"): where the
#            continuous lane's lone-row penalty goes
#   prefill  SHAPES (1x1024,1x256,32x64,32x128,64x32), NCU_SHAPES (32x64,1x256): prefill forwards' wall time by
#            group x chunk (tools/gpu/prefill_kernels.py), then ncu over one forward of each NCU_SHAPES
#   first    WARMUP (full), LENGTHS (1024,4096), FIRST_ARGS (more options, e.g. "--prompt-cache-block 0
#            --prompt-cache-bytes 0": the prompt cache off): the first prompts after ready against the ones that
#            follow, then again with MLX's buffer cache emptied and refilled by one prompt (tools/gpu/first_prompts.py)
#   burst    BURST (32), PROMPT (128), ROUNDS (3), WARMUP (full), BURST_TOKENS (2): a burst of prompts served over
#            HTTP against the same burst handed to the gateway in process (tools/gpu/burst_paths.py)
#   dequant  SHAPES (1x96,1x256,1x1024,8x128): MLX's dequantization against the engine's kernel on each matrix
#            (tools/gpu/dequant_speed.py), then prefill forwards with ENGINE_DEQUANT_KERNEL 0 and 1
#   attention SHAPES (1x1024,1x4096): the prompt attention kernel's tests, a layer's attention each way
#            (tools/gpu/attention_prefill_speed.py), then prefill forwards with ENGINE_PREFILL_ATTENTION_KERNEL 0 and 1
#   switch   SWITCH (an engine switch, e.g. ENGINE_KEEP_DENSE), SHAPES, REPS (4): prefill forwards with it 0 and 1
#   chunks   TOKENS (128,1024,4096), SHAPES (1x1024,1x2048,1x4096): the chunked DeltaNet rule's CUDA kernels' tests,
#            a layer's rule each way (tools/gpu/chunk_states_speed.py), then prefill forwards with
#            ENGINE_CHUNK_PREPARE_KERNEL 0 and 1 (ENGINE_KEEP_DENSE as set)
#   prompt   SHAPES (1x1024,1x4096), REPS (4), GATE_ROWS (1,8): both prompt kernels' tests, prefill forwards with
#            ENGINE_PREFILL_ATTENTION_KERNEL and ENGINE_CHUNK_PREPARE_KERNEL both 0, each 1 and both 1 in turn in one
#            process, a 16K prompt in 2K chunks with both 0 and both 1, the gate with both 1, then a layer's attention
#            and DeltaNet rule each way (attention_prefill_speed, chunk_states_speed)
#   pieces   SHAPES (1x16,1x32,1x64), ROWS (1,2,4): prompt pieces of a few dozen tokens (what the prefill pacer
#            can give beside decoding rows) as the tree runs them, with compiled layers, with the DeltaNet scan
#            kernel and with both, in one process; then decode steps at ROWS, the steps those pieces stall
#   layouts  ROWS (16,32,64), LAYOUTS (staged layouts, space-separated; default "RW=1,W=8 RW=1,W=4,MG=2"),
#            ROUNDS (1; more: every layout timed once a round, the order reversed every other round, then medians),
#            GATE_LAYOUT (default none: the tree's), GATE (1; 0 skips it): the staged kernel's CUDA tests, decode
#            steps with each layout against the tree's, then the numerics gate at 32 and 64 rows with
#            ENGINE_STAGED_LAYOUT=GATE_LAYOUT
#   waves    ROWS (1,32,64), LAYOUTS (default "64:W=4,MG=1 64:W=8,MG=1,ST=4 32:KS=640"), ROUNDS (2), CANDIDATES
#            (one-row launch shapes, default "8,1,4;8,1,4,3;4,2,4,5;2,2,4,10"): the host's microseconds an MLX
#            operation with its CUDA graphs on and off (tools/gpu/op_cost.py), decode steps with layouts that fill
#            the launches' last waves (`python3 -m tools.kernel_resources` names them) against the tree's in
#            alternating rounds, then the candidates on the two largest one-row shapes, each call waiting for the
#            one before (tools/gpu/gemv_configs.py --serial); nothing here changes a default
set -euo pipefail
export ENGINE_HARNESS_CACHE=${ENGINE_HARNESS_CACHE:-/tmp/ehc} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
PART=${PART:-tests}
mkdir -p "$OUT"
if [ "$PART" != "${PART%% *}" ]; then
  rc=0
  for part in $PART; do
    echo "=== $part $(date +%T)"
    PART=$part bash "$0" || { rc=$?; echo "=== $part failed ($rc)"; }
  done
  echo "=== done $(date +%T)"
  exit "$rc"
fi

synth() { [ -f "$ENGINE_HARNESS_CACHE/models/qwen27b-s0/manifest.json" ] || python3 -m harness models synth qwen27b; }
switch_prefill() {  # prefill forwards (SHAPES) with the switch $1 at 0 and 1 in turn, REPS (4) passes each, one process
  python3 -m tools.gpu.prefill_kernels --shapes "${SHAPES:-1x96,1x256,1x1024,8x128}" --chunks 1 --reps "${REPS:-4}" \
      --arms "$1=0;$1=1"
}
kernel_part() {  # NAME TESTS SWITCH TOOL [ARGS...]: a kernel's tests, TOOL's layer timings, forwards with SWITCH 0, 1
  local name=$1 tests=$2 switch=$3
  shift 3
  synth
  { timeout -s INT "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider "$tests" 2>&1 | tail -3
    python3 -m "$@"
    switch_prefill "$switch"; } 2>&1 | tee "$OUT/qwen27b-$name.txt"
}

case "$PART" in
  tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"; } | tee "$OUT/gpu.txt"
    # TESTS_TIMEOUT interrupts pytest itself, which then prints its summary: a `timeout` around this script would
    # leave pytest running on the GPU into the next command, and a `| tail` keeps nothing of a killed run
    rc=0
    timeout -s INT "${TESTS_TIMEOUT:-1200}" python3 -m pytest -q -p no:cacheprovider -rs -n "${WORKERS:-4}" \
        tests/unit/test_kernels.py tests/unit/test_attention_kernels.py tests/unit/test_cuda_source.py \
        tests/unit/test_dequantize_kernel.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/kernel-tests.txt" 2>&1 || rc=$?
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
  startup)
    synth
    python3 -m harness startup --models qwen27b ${STARTUP_ARGS:-} --json "$OUT/qwen27b-startup.json" 2>&1 \
        | tee "$OUT/qwen27b-startup.txt"
    ;;
  batch)
    synth
    { python3 -m tools.gpu.step_kernels --rows "${ROWS:-1,8,16,32,64}" --tiers fast --time --steps 16
      python3 -m tools.gpu.batch_parts --rows "${ROWS:-1,8,16,32,64}"; } 2>&1 | tee "$OUT/qwen27b-batch-steps.txt"
    python3 -m harness batch-bench --models qwen27b --kernels fast --concurrency "${CONCURRENCY:-8,16,32,64}" \
        --decode-tokens "${DECODE:-32}" --samples 1 --warmup 1 --json "$OUT/qwen27b-batch-bench.json" 2>&1 \
        | tee "$OUT/qwen27b-batch-bench.txt"
    ;;
  parity)  # the tiny models' B=1 gate: CUDA's matrix kernels differ from the CPU's
    python3 -m harness parity ${PARITY_ARGS:-} --json "$OUT/parity-cuda.json" 2>&1 | tee "$OUT/parity-cuda.txt"
    ;;
  ncu)  # each kernel's device time in STEPS decode steps, summed per step and by kernel name
    synth
    step=(python3 -m tools.gpu.step_kernels --rows "${ROWS:-1}" --tiers "${TIERS:-fast}" --prompt-tokens "${PROMPT:-64}")
    "${step[@]}" --time --steps 24 2>&1 | tee "$OUT/qwen27b-step-times.txt"
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none --profile-from-start off \
        --log-file "$OUT/ncu-step.csv" \
        "${step[@]}" --steps "${STEPS:-3}" --warm 1 2>&1 | tail -5
    python3 -m tools.gpu.step_kernels --summarize "$OUT/ncu-step.csv" --top "${TOP:-30}" 2>&1 \
        | tee "$OUT/qwen27b-step-kernels.txt"
    ;;
  profile)  # a decode step's host build, submit and wait, per configuration, alternating
    synth
    python3 -m tools.gpu.decode_step --tokens 48 --rounds "${ROUNDS:-2}" ${STEP_CONFIGS:+--configs "$STEP_CONFIGS"} 2>&1 \
        | tee "$OUT/decode-step.txt"
    ;;
  census)  # the modules MLX compiles as the continuous batcher meets new shapes, by step
    synth
    python3 -m tools.gpu.compile_census --model qwen27b --waves "${WAVES:-1,1,2,3,4,8,9,16}" --grow "${GROW:-300}" 2>&1 \
        | tee "$OUT/qwen27b-compile-census.txt"
    ;;
  lane)
    synth
    step=(python3 -m tools.gpu.step_kernels --rows 1 --tiers fast --time --steps 64)
    { "${step[@]}"; "${step[@]}" --batch-caches; "${step[@]}" --batch-caches --off attention_kernels
      "${step[@]}" --batch-caches --off attention_step; "${step[@]}"; } 2>&1 | tee "$OUT/qwen27b-lane-steps.txt"
    python3 -m tools.gpu.lone_lanes --model qwen27b --rounds 3 --tokens 128 ${LANES_ARGS:---warmup full --burst 64 --reset} \
        2>&1 | tee "$OUT/qwen27b-lone-lanes.txt"
    ;;
  prefill)
    synth
    python3 -m tools.gpu.prefill_kernels --shapes "${SHAPES:-1x1024,1x256,32x64,32x128,64x32}" --chunks 2 --reps 3 \
        2>&1 | tee "$OUT/qwen27b-prefill.txt"
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none --profile-from-start off \
        --log-file "$OUT/ncu-prefill.csv" python3 -m tools.gpu.prefill_kernels --shapes "${NCU_SHAPES:-32x64,1x256}" --ncu
    python3 -m tools.gpu.step_kernels --summarize "$OUT/ncu-prefill.csv" --top 14 2>&1 | tee -a "$OUT/qwen27b-prefill.txt"
    ;;
  first)  # the first prompts after ready against the following ones: buffer cache or compilation
    synth
    python3 -m tools.gpu.first_prompts --model qwen27b --warmup "${WARMUP:-full}" --lengths "${LENGTHS:-1024,4096}" \
        ${FIRST_ARGS:-} 2>&1 | tee "$OUT/qwen27b-first-prompts.txt"
    ;;
  burst)  # a burst served over HTTP against the same burst handed to the gateway in process
    synth
    python3 -m tools.gpu.burst_paths --model qwen27b --burst "${BURST:-32}" --prompt-tokens "${PROMPT:-128}" \
        --rounds "${ROUNDS:-3}" --warmup "${WARMUP:-full}" --tokens "${BURST_TOKENS:-2}" 2>&1 \
        | tee "$OUT/qwen27b-burst-paths.txt"
    ;;
  dequant)  # the dense path's dequantization: alone on each matrix, then in whole prefill forwards
    synth
    { python3 -m tools.gpu.dequant_speed --model qwen27b
      switch_prefill ENGINE_DEQUANT_KERNEL; } 2>&1 | tee "$OUT/qwen27b-dequant.txt"
    ;;
  chunks)  # the chunked DeltaNet rule's kernels: their tests, a layer's rule each way, whole prefill forwards
    SHAPES="${SHAPES:-1x1024,1x2048,1x4096}" kernel_part chunks tests/unit/test_chunked_rule_kernels.py \
        ENGINE_CHUNK_PREPARE_KERNEL tools.gpu.chunk_states_speed --tokens "${TOKENS:-128,1024,4096}" --rows 1,8
    ;;
  attention)  # the prompt attention kernel: its tests, a layer's attention each way, whole prefill forwards
    SHAPES="${SHAPES:-1x1024,1x4096}" kernel_part attention tests/unit/test_attention_prefill.py \
        ENGINE_PREFILL_ATTENTION_KERNEL tools.gpu.attention_prefill_speed
    ;;
  prompt)  # both prompt kernels: their tests, forwards with neither, each and both, the gate with both on
    synth
    a=ENGINE_PREFILL_ATTENTION_KERNEL p=ENGINE_CHUNK_PREPARE_KERNEL
    { timeout -s INT "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider \
          tests/unit/test_attention_prefill.py tests/unit/test_chunked_rule_kernels.py 2>&1 | tail -3 \
          || echo "=== the kernels' tests failed: the timings below are not a case for a default"
      python3 -m tools.gpu.prefill_kernels --shapes "${SHAPES:-1x1024,1x4096}" --chunks 1 --reps "${REPS:-4}" \
          --arms "$a=0 $p=0;$a=1 $p=0;$a=0 $p=1;$a=1 $p=1"
      python3 -m tools.gpu.prefill_kernels --shapes 1x2048 --chunks 8 --reps 2 --arms "$a=0 $p=0;$a=1 $p=1"
      env "$a=1" "$p=1" python3 -m harness kernels --gate-model qwen27b --gate-rows "${GATE_ROWS:-1,8}" \
          --json "$OUT/qwen27b-prompt-gate.json" || echo "=== the gate failed with both kernels on"
      python3 -m tools.gpu.attention_prefill_speed --shapes 1024x1024,2048x4096,2048x16384
      python3 -m tools.gpu.chunk_states_speed --tokens 1024,4096 --rows 1; } 2>&1 | tee "$OUT/qwen27b-prompt.txt"
    ;;
  pieces)  # small prompt pieces each way against decode steps: can a piece fit beside decoding rows' steps?
    synth
    c=ENGINE_COMPILED_PREFILL t=ENGINE_SCAN_TOKENS
    { python3 -m tools.gpu.prefill_kernels --shapes "${SHAPES:-1x16,1x32,1x64}" --chunks 4 --reps "${REPS:-4}" \
          --arms ";$c=1;$t=64;$c=1 $t=64"
      python3 -m tools.gpu.step_kernels --rows "${ROWS:-1,2,4}" --tiers fast --time --steps 16; } 2>&1 \
        | tee "$OUT/qwen27b-pieces.txt"
    ;;
  switch)  # whole prefill forwards with an engine switch off and on in turn, one process
    synth
    switch_prefill "${SWITCH:?SWITCH names the switch, e.g. ENGINE_KEEP_DENSE}" 2>&1 | tee "$OUT/qwen27b-$SWITCH.txt"
    ;;
  layouts)  # staged layouts at many rows: step times against the tree's, then the gate with one of them
    synth
    timeout -s INT "${TESTS_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" \
        tests/unit/test_kernels.py -k "staged or row_blocks" 2>&1 | tail -5 | tee "$OUT/qwen27b-layout-tests.txt"
    staged=()
    for layout in ${LAYOUTS:-RW=1,W=8 RW=1,W=4,MG=2}; do staged+=(--staged "$layout"); done
    python3 -m tools.gpu.step_kernels --rows "${ROWS:-16,32,64}" --tiers fast --time --steps 16 "${staged[@]}" \
        --rounds "${ROUNDS:-1}" 2>&1 \
        | tee "$OUT/qwen27b-layout-steps.txt"
    [ "${GATE:-1}" = 0 ] && exit 0
    ENGINE_STAGED_LAYOUT="${GATE_LAYOUT:-}" python3 -m harness kernels --gate-model qwen27b \
        --gate-rows 32,64 --json "$OUT/qwen27b-layout-gate.json" 2>&1 | tee "$OUT/qwen27b-layout-gate.txt"
    ;;
  waves)  # launches whose last wave is nearly empty: layouts and launch shapes that fill it, and the host's cost
    synth
    { for graphs in 1 0; do MLX_USE_CUDA_GRAPHS=$graphs python3 -m tools.gpu.op_cost --label "graphs $graphs"; done
      staged=()
      for layout in ${LAYOUTS:-64:W=4,MG=1 64:W=8,MG=1,ST=4 32:KS=640}; do staged+=(--staged "$layout"); done
      python3 -m tools.gpu.step_kernels --rows "${ROWS:-1,32,64}" --tiers fast --time --steps 16 "${staged[@]}" \
          --rounds "${ROUNDS:-2}"
      python3 -m tools.gpu.gemv_configs --serial --no-numerics --quick --rows 1 \
          --candidates "${CANDIDATES:-8,1,4;8,1,4,3;4,2,4,5;2,2,4,10}"; } 2>&1 | tee "$OUT/qwen27b-waves.txt"
    ;;
  *) echo "PART must be tests, kernels, gate, native, run-all, startup, batch, parity, ncu, profile, census, lane," \
          "prefill, first, burst, dequant, switch, chunks, attention, prompt, pieces, layouts or waves (got '$PART')" >&2
     exit 2 ;;
esac
