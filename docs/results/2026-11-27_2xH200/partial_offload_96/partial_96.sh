# Partial optimizer offload at the largest offloaded size on two GPUs: the llama3-8b shape
# with 96 layers (20.9B parameters) at seq 4096, `train --plan auto --offload-optimizer`
# (the planner keeps on the device the moments its spare memory holds), then, with what is
# left of the time, the same layout fully offloaded. JAX's persistent compilation cache lets
# the trainer reuse the planner's compiles.
# Run from the repository root: OUT=dir bash docs/results/2026-11-27_2xH200/partial_offload_96/partial_96.sh
# and, for the plain scanned loop, OUT=dir SCANNED=1 bash .../partial_96.sh (see the end).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0
export JAX_COMPILATION_CACHE_DIR=/tmp/gtp_jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:-/tmp/partial_96}
BUDGET=${BUDGET:-590}
PARTS=${PARTS:-"partial full"}
[ "${SCANNED:-0}" = 1 ] && PARTS=""
mkdir -p "$OUT"
M="--preset llama3-8b --layers 96 --seq 4096 --batch 2 --remat full --gtp 2 --dp 1 --no-unroll-layers --steps 4"
t0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - t0))); }
show() { grep -v "^W1\|^I1\|^E1" | tee "$1" | grep -E "plan auto chose|optimizer state in|loss: first|step time|memory per device|rror|SIGTERM|exit"; }
for part in $PARTS; do
  if [ "$part" = partial ]; then
    echo "== t=$(( $(date +%s) - t0 ))s partial: train $M --plan auto --offload-optimizer"
    timeout "$(left)" python3 -m gtp_jax train $M --plan auto --offload-optimizer 2>&1 | show "$OUT/partial.log"
  else
    loop=""; grep -q "plan auto chose.* prefetch" "$OUT/partial.log" 2>/dev/null && loop="--prefetch"
    echo "== t=$(( $(date +%s) - t0 ))s full: train $M $loop --offload-optimizer"
    timeout "$(left)" python3 -m gtp_jax train $M $loop --offload-optimizer 2>&1 | show "$OUT/full.log"
  fi
done
echo "== t=$(( $(date +%s) - t0 ))s done"
# Second call (SCANNED=1): the same two runs on the plain scanned loop (no prefetch), the
# partial one keeping the moments the first call's plan chose.
if [ "${SCANNED:-0}" = 1 ]; then
  KEEP="'^blocks/attn_norm/scale$' '^blocks/mlp/down/kernel$' '^blocks/mlp_norm/scale$' '^embed/embedding$' '^final_norm/scale$' '^lm_head/kernel$'"
  t0=$(date +%s)
  for part in full partial; do
    extra=""; [ "$part" = partial ] && extra="--offload-exclude $KEEP"
    echo "== t=$(( $(date +%s) - t0 ))s $part, scanned: train $M --offload-optimizer $extra"
    eval timeout "$(left)" python3 -m gtp_jax train $M --offload-optimizer $extra 2>&1 | show "$OUT/scanned_$part.log"
  done
  echo "== t=$(( $(date +%s) - t0 ))s done"
fi
