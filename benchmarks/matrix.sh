#!/usr/bin/env bash
# The performance matrix (python -m gtp_jax.bench matrix) on all GPUs of the host: the 1b
# step over loop x prefetch x remat x gather format, the CLI beside its benchmark twin and a
# user's own decoder wrapped and unwrapped; then, for the traced cells, the hidden share of
# communication, its longest exposed stretches and the kernel time by category.
# Writes $OUT/matrix.json, $OUT/matrix.log and $OUT/traces.log.
# Usage: OUT=dir [CELLS=a,b] [PROFILE_CELLS=a,b] [STEPS=10] bash benchmarks/matrix.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/matrix}; mkdir -p "$OUT"
TRACES=${TRACES:-/tmp/gtp_jax_matrix_traces}
PROFILE_CELLS=${PROFILE_CELLS:-unrolled_dots_bf16,user_gtp,user_xla_fsdp}
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
python3 -m gtp_jax.bench matrix ${CELLS:+--cells "$CELLS"} --steps "${STEPS:-10}" \
  --timeout "${TIMEOUT:-150}" --json "$OUT/matrix.json" \
  --profile-dir "$TRACES" --profile-cells "$PROFILE_CELLS" 2>&1 | tee "$OUT/matrix.log"
for cell in ${PROFILE_CELLS//,/ }; do
  [ -d "$TRACES/$cell" ] || continue
  echo "== $cell"
  python3 -m gtp_jax.bench.trace "$TRACES/$cell" --steps 3 --exposed 12
  python3 -m gtp_jax.bench.kernels "$TRACES/$cell" --steps 3 --top 25
done > "$OUT/traces.log" 2>&1
