#!/usr/bin/env bash
# The campaign runner: PARTS="part part ..." bash benchmarks/campaign.sh, on a GPU host, from
# the repository root. Every part writes a log and a JSON file under $OUT (default
# runs/campaign); SCALE=cpu runs each part scaled down on simulated CPU devices (no PyTorch
# peer), to check the script without GPUs.
#
# Parts:
#   breakdown  where one step's time and memory go, gtp_jax beside compiled FSDP2
#              (python -m gtp_jax.bench breakdown), for each of SHAPES ("SEQxSEQS_PER_GPU",
#              default "2048x1 8192x1") on PRESET (default llama3-8b) and every GPU;
#              EXTRA: options for gtp_jax's side (bench overlap), TORCH_ENV: for the peer's.
#   step       gtp_jax's step beside compiled FSDP2 on GPUS (default: all) for each of
#              SHAPES, each side its best recipe (REMAT for gtp_jax, AC for the peer).
# Environment: OUT, PARTS, SHAPES, PRESET, STEPS (timed steps, default 8), LIMIT (seconds per
# side, default 400).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-runs/campaign}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/gtp_campaign}; mkdir -p "$WORK"
PARTS=${PARTS:-breakdown}
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
if [ "${SCALE:-gpu}" = cpu ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
  PRESET=${PRESET:-tiny}; SHAPES=${SHAPES:-"64x2"}; STEPS=${STEPS:-2}; NOTORCH="--no-torch"
else
  PRESET=${PRESET:-llama3-8b}; SHAPES=${SHAPES:-"2048x1 8192x1"}; STEPS=${STEPS:-8}; NOTORCH=""
fi
LIMIT=${LIMIT:-400}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

part_breakdown() {
  for shape in $SHAPES; do
    seq=${shape%x*}; mb=${shape#*x}; dir="$WORK/breakdown_${PRESET}_${seq}x${mb}"
    log "breakdown $PRESET seq $seq x $mb per GPU"
    rm -rf "$dir"
    python3 -m gtp_jax.bench breakdown --preset "$PRESET" --seq "$seq" --per-device-batch "$mb" \
      --steps "$STEPS" --timeout "$LIMIT" --out "$dir" $NOTORCH \
      ${TORCH_ENV:+--torch-env "$TORCH_ENV"} ${EXTRA:+-- $EXTRA} \
      > "$OUT/breakdown_${seq}x${mb}.log" 2>&1
    grep -v -i "deprecat\|warn" "$OUT/breakdown_${seq}x${mb}.log" | tail -60
    cp "$dir/breakdown.json" "$OUT/breakdown_${seq}x${mb}.json" 2>/dev/null
  done
}

for part in $PARTS; do
  if ! declare -F "part_$part" >/dev/null; then
    echo "unknown part '$part'; parts: $(declare -F | sed -n 's/.*part_//p' | tr '\n' ' ')"
    exit 2
  fi
  "part_$part"
done
log done
