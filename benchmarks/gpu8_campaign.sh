#!/usr/bin/env bash
# Everything measured on an 8-GPU host, in one call:
#   1. the 0.95B training step with gtp = 8 beside PyTorch FSDP2 (compiled and eager blocks)
#      on 8 GPUs ($OUT/step_1b_gtp8.json);
#   2. the same with dp = 2 x gtp = 4 (the batch split over both) beside PyTorch HSDP 2 x 4
#      ($OUT/step_1b_dp2_gtp4.json);
#   3. scaling for notebook 03: gtp_jax step time and peak memory per GPU on 1, 2, 4 and 8
#      GPUs at the same per-GPU batch ($OUT/scaling_{1,2,4,8}gpu.json).
# PART=step|hsdp|scaling runs one part (one call may not hold all three at full size).
# SCALE=cpu runs the same steps scaled down on 8 simulated CPU devices (tiny preset, no
# PyTorch peer), to check the script without GPUs.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/gpu8}; PART=${PART:-all}; mkdir -p "$OUT"
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
show() { grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -20; }
if [ "${SCALE:-gpu}" = cpu ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu
  STEP="--preset tiny --seq 64 --steps 2 --warmup 1 --per-device-batch 2 --timeout 300"
  TORCH=""; NGPU=8
else
  STEP="--preset 1b --seq 2048 --steps 20 --warmup 2 --per-device-batch 4 --timeout 110 --attention cudnn --no-remat-gathered"
  TORCH="--torch"; NGPU=$(nvidia-smi -L | wc -l)
fi
if [ "$PART" = all ] || [ "$PART" = step ]; then
  log "gtp = 8"
  python3 -m gtp_jax.bench overlap $STEP $TORCH --variants compute_only_dots,gtp_dots,gtp_prefetch_dots \
    --json "$OUT/step_1b_gtp8.json" 2>&1 | show
fi
if [ "$PART" = all ] || [ "$PART" = hsdp ]; then
  log "dp = 2 x gtp = 4"
  python3 -m gtp_jax.bench overlap $STEP $TORCH --gtp 4 --variants gtp_dots,gtp_prefetch_dots \
    --json "$OUT/step_1b_dp2_gtp4.json" 2>&1 | show
fi
if [ "$PART" = all ] || [ "$PART" = scaling ]; then
  for n in 1 2 4 8; do
    [ "$n" -gt "$NGPU" ] && continue
    log "scaling: $n GPUs"
    if [ "${SCALE:-gpu}" = cpu ]; then
      XLA_FLAGS="--xla_force_host_platform_device_count=$n" python3 -m gtp_jax.bench overlap $STEP \
        --variants gtp_dots --json "$OUT/scaling_${n}gpu.json" 2>&1 | show
    else
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) python3 -m gtp_jax.bench overlap $STEP \
        --variants gtp_dots --json "$OUT/scaling_${n}gpu.json" 2>&1 | show
    fi
  done
fi
log done
ls "$OUT"
