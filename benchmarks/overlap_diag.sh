#!/usr/bin/env bash
# Where llama3-8b's communication goes on a multi-GPU host, in one call: how the GPUs are
# linked, the bus bandwidth NCCL reaches through XLA at one layer's size, which scheduling
# mechanism pins a gather and a reduce-scatter behind GEMMs in a GTP-shaped toy
# (benchmarks/sched_probe.py), and the llama3-8b step (2048 and 8192 tokens per GPU) with
# XLA's scheduler log. OLD=DIR (a folder holding an older gtp_jax/) adds that version's
# 2048-token step beside this one's.
#   OUT=dir bash benchmarks/overlap_diag.sh          (from the repository root, on GPUs)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/diag}; mkdir -p "$OUT"
PY=${PY:-python3}
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
HLO=/tmp/diag_hlo; mkdir -p "$HLO"

log "topology"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; cat "$OUT/topo.txt"

log "toy: bandwidth and scheduling mechanisms"
TF_CPP_MIN_LOG_LEVEL=${TOY_LOG:-1} OUT=$HLO B=${B:-2048} MODES=${MODES:-bw,compute,plain,groups,streams,chained} \
  timeout 240 $PY benchmarks/sched_probe.py "${TOY_LAYERS:-16}" > "$OUT/probe.log" 2> "$OUT/probe.err"
cat "$OUT/probe.log"; tail -3 "$OUT/probe.err"
echo "synchronous-conversion warnings: $(grep -c 'converted to a synchronous' "$OUT/probe.err")"
for f in "$HLO"/hlo_*.txt; do
  [ -f "$f" ] || continue
  echo "$(basename "$f"): is_sync $(grep -c '"is_sync":true' "$f"), gemm lines with a group id" \
       "$(grep -E 'custom-call' "$f" | grep -i gemm | grep -c _scheduling_group_id)"
done
tar -czf "$OUT/toy_hlo.tgz" -C "$HLO" . 2>/dev/null

step() {  # name, seq, extra env..., -- extra bench options...
  local name=$1 seq=$2; shift 2
  local envs=() opts=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  opts=("$@")
  log "step $name (seq $seq)"
  env "${envs[@]}" timeout "${STEP_LIMIT:-170}" $PY -m gtp_jax.bench overlap --preset llama3-8b \
    --seq "$seq" --per-device-batch 1 --steps "${STEPS:-6}" --warmup 2 --variants gtp_dots \
    --timeout "${STEP_LIMIT:-170}" --json "$OUT/step_$name.json" "${opts[@]}" \
    > "$OUT/step_$name.log" 2> "$OUT/step_$name.err"
  grep -E "^\[|^\| gtp" "$OUT/step_$name.log" | head -4
  grep -hoE "LatencyHidingScheduler current memory usage[^\"]*" "$OUT/step_$name.err" | head -3
}
step new_2048 2048 TF_CPP_MIN_LOG_LEVEL=0 -- --profile-dir /tmp/diag_prof_2048 --profile-variants gtp_dots
step new_8192 8192 TF_CPP_MIN_LOG_LEVEL=0 -- --profile-dir /tmp/diag_prof_8192 --profile-variants gtp_dots
step slop_8192 8192 TF_CPP_MIN_LOG_LEVEL=0 \
  "XLA_FLAGS=--xla_gpu_memory_limit_slop_factor=200" -- --profile-dir /tmp/diag_prof_slop \
  --profile-variants gtp_dots
step scan_2048 2048 -- --variants gtp_prefetch_dots --no-unroll-layers
if [ -n "${OLD:-}" ]; then
  step old_2048 2048 "PYTHONPATH=$OLD" --
fi
log "compiled memory of the trainer's step, 2048 x 1 per GPU"
timeout 120 $PY -m gtp_jax.bench memory --preset llama3-8b --seq 2048 --batch "$(nvidia-smi -L | wc -l)" \
  --dp 1 --json "$OUT/memory_2048.json" > "$OUT/memory_2048.log" 2>&1
head -16 "$OUT/memory_2048.log"
log "done"
