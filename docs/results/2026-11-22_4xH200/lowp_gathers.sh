#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# Low-precision weight gathers on all GPUs of the host (gtp = number of GPUs):
#  (1) step time of the 0.95B decoder with bf16, fp8 and nvfp4 gathers, 1 sequence per GPU so
#      that communication weighs more: $OUT/lowp_step_1b_{none,fp8,nvfp4}.json;
#  (2) training loss of the 100m preset with each gather format against the bf16 gather,
#      150 steps: $OUT/lowp_loss_100m.json.
# Default OUT=runs. The CPU loss comparison of the tiny preset is
# `python benchmarks/lowp_loss.py --json lowp_loss_tiny.json` (no GPU needed).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
for f in none fp8 nvfp4; do
  timeout 60 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 \
    --per-device-batch 1 --timeout 55 --attention cudnn --no-remat-gathered --variants gtp_dots \
    --gather-format $f --json "$OUT/lowp_step_1b_$f.json" 2>&1 | grep -E "^\| gtp" | sed "s/^/gather $f: /"
done
timeout 150 python3 benchmarks/lowp_loss.py --preset 100m --steps 150 --seq 512 --batch 16 \
  --json "$OUT/lowp_loss_100m.json" 2>&1 | grep -E "^\[|^\||^preset"
