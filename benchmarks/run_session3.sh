#!/usr/bin/env bash
# One device call: (1) issue 3's side-by-side table on all GPUs of the machine (gtp = #GPUs),
# (2) low-precision gathers end to end where communication is exposed (1 sequence/GPU),
# (3) loss of low-precision gather training vs bf16 gather (100m preset),
# (4) `bench parallel` (TP / SP / MoE) if time is left.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof; rm -rf "$PROF"
T0=$(date +%s)
timeout 230 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 \
  --per-device-batch 4 --timeout 70 --attention cudnn --no-remat-gathered --torch \
  --variants compute_only_dots,replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --profile-dir "$PROF" --profile-variants gtp_dots,gtp_prefetch_dots \
  --json "$OUT/overlap.json" 2>&1 | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -12
echo "t=$(( $(date +%s) - T0 ))s"
for f in none fp8 nvfp4; do
  timeout 60 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 \
    --per-device-batch 1 --timeout 55 --attention cudnn --no-remat-gathered --variants gtp_dots \
    --gather-format $f --json "$OUT/lowp_step_$f.json" 2>&1 | grep -E "^\| gtp" | sed "s/^/gather $f: /"
done
echo "t=$(( $(date +%s) - T0 ))s"
timeout 150 python3 benchmarks/lowp_loss.py --preset 100m --steps 150 --seq 512 --batch 16 \
  --json "$OUT/lowp_loss_100m.json" 2>&1 | grep -E "^\[|^\||^preset"
echo "t=$(( $(date +%s) - T0 ))s"
if python3 -c "import gtp_jax.bench.parallel" 2>/dev/null; then
  timeout 100 python3 -m gtp_jax.bench parallel --json "$OUT/parallel.json" 2>&1 | grep -v -i deprecat | tail -14
fi
echo "t=$(( $(date +%s) - T0 ))s"
