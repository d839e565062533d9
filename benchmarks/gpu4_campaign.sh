#!/usr/bin/env bash
# Everything measured on a 4-GPU host, in one call (gtp = 4):
#   1. the 0.95B training step: compute only, replicated, XLA automatic FSDP, gtp_jax with and
#      without prefetch, PyTorch FSDP2 with compiled and eager blocks; traces read per stream
#      (bench overlap; $OUT/step_1b.json);
#   2. tensor parallelism (bench parallel, 1b with 8 layers): tp4 plain vs tp4 with ring
#      collective matmuls ($OUT/parallel_tp4.json); tp2 x gtp2 plain and with rings
#      ($OUT/parallel_tp2_gtp2.json); MoE (8 experts, top-2) on ep2 x gtp2 (tp = 1, so no ring)
#      ($OUT/parallel_moe_ep2_gtp2.json).
# SCALE=cpu runs the same steps scaled down on 4 simulated CPU devices (tiny preset, no
# PyTorch peer), to check the script without GPUs.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/gpu4}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof4; rm -rf "$PROF"
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
show() { grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -20; }
if [ "${SCALE:-gpu}" = cpu ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
  STEP="--preset tiny --seq 64 --steps 2 --warmup 1 --per-device-batch 2 --timeout 300"
  PAR="--preset tiny --seq 64 --steps 2 --warmup 1 --batch 4 --cpu-devices 4 --timeout 300"
  TORCH=""
else
  STEP="--preset 1b --seq 2048 --steps 20 --warmup 2 --per-device-batch 4 --timeout 110 --attention cudnn --no-remat-gathered"
  PAR="--preset 1b --layers 8 --seq 2048 --batch 4 --attention xla --remat dots --steps 10 --timeout 150"
  TORCH="--torch"
fi

log "training step, gtp = 4"
python3 -m gtp_jax.bench overlap $STEP $TORCH \
  --variants compute_only_dots,replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --profile-dir "$PROF" --profile-variants gtp_dots,gtp_prefetch_dots \
  --json "$OUT/step_1b.json" 2>&1 | show
log "tp4 plain vs rings"
python3 -m gtp_jax.bench parallel $PAR --tp 4 --variants tp,tp_overlap \
  --json "$OUT/parallel_tp4.json" 2>&1 | show
log "tp2 x gtp2 plain vs rings"
python3 -m gtp_jax.bench parallel $PAR --tp 2 --gtp 2 --variants tp_gtp,tp_gtp_overlap \
  --json "$OUT/parallel_tp2_gtp2.json" 2>&1 | show
log "MoE ep2 x gtp2"
python3 -m gtp_jax.bench parallel $PAR --tp 1 --gtp 2 --variants tp_gtp_overlap_moe \
  --json "$OUT/parallel_moe_ep2_gtp2.json" 2>&1 | show
if [ "${SCALE:-gpu}" != cpu ]; then  # cuDNN only: which remat policies compile on 4 GPUs
  log "cuDNN attention under each remat policy, in and out of shard_map"
  python3 docs/repro/cudnn_attention_remat.py 2>&1 | tee "$OUT/cudnn_attention_remat.md"
fi
log done
ls "$OUT"
