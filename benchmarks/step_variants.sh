#!/usr/bin/env bash
# One llama3-8b step per row, each row a version of gtp_jax (a folder holding gtp_jax/,
# "." for this checkout) and bench overlap options, in one call; then the bus bandwidth of
# one layer's collectives under NCCL settings (benchmarks/sched_probe.py bw).
#   ROWS="name|seq|folder|options;..." NCCL_ROWS="name|env;..." OUT=dir bash benchmarks/step_variants.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/variants}; mkdir -p "$OUT"
PY=${PY:-python3}
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
IFS=';' read -ra rows <<< "${NCCL_ROWS:-}"
for row in "${rows[@]}"; do
  [ -n "$row" ] || continue
  IFS='|' read -r name envs <<< "$row"
  log "bandwidth $name ($envs)"
  env $envs MODES=bw timeout 60 $PY benchmarks/sched_probe.py 2 2>/dev/null | grep "^bw" | sed "s/^/$name /"
done
if [ -n "${TOY_MODES:-}" ]; then
  log "toy $TOY_MODES"
  MODES=$TOY_MODES B=${B:-2048} timeout 120 $PY benchmarks/sched_probe.py 16 2> "$OUT/toy.err" | tail -8
  echo "synchronous-conversion warnings: $(grep -c 'converted to a synchronous' "$OUT/toy.err")"
fi
IFS=';' read -ra rows <<< "${ROWS:-}"
for row in "${rows[@]}"; do
  [ -n "$row" ] || continue
  IFS='|' read -r name seq folder opts <<< "$row"
  log "step $name (seq $seq, $folder)"
  PYTHONPATH="$(cd "$folder" && pwd)" timeout "${STEP_LIMIT:-150}" $PY -m gtp_jax.bench overlap \
    --preset "${PRESET:-llama3-8b}" --seq "$seq" --per-device-batch 1 --steps "${STEPS:-6}" \
    --warmup 2 --variants gtp_dots --timeout "${STEP_LIMIT:-150}" --json "$OUT/step_$name.json" \
    $opts > "$OUT/step_$name.log" 2> "$OUT/step_$name.err"
  grep -E "^\| gtp" "$OUT/step_$name.log" | head -2 | sed "s/^/$name /"
  grep -E "Error|error" "$OUT/step_$name.err" | tail -2
done
log done
