#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# The offloaded optimizer state's two host layouts side by side, on ONE GPU, in one call:
# the stacked layout (one host buffer per layer-stacked moment, copied by dynamic-slice
# kernels on the compute stream) of an earlier gtp_jax at $BASE, against this tree's
# (one host array per layer group while it trains: DMA transfers on the copy stream).
#   1. python docs/results/2026-11-27_1xH100/host_copies/host_copies.py: the update alone, both layouts (PART copies);
#   2. the 1b preset (seq 2048, 4 sequences, remat dots) on the device and offloaded with
#      each layout (PART small);
#   3. LAYERS8 llama3-8b layers (seq 4096, 1 sequence, remat full), offloaded with each
#      layout, and on the device (PART eight);
#   4. the whole llama3-8b, offloaded, each layout (PART big; about 4 minutes).
# Step times are the medians the trainer prints (steps 2 on). BASE: a copy of an earlier
# gtp_jax package (e.g. `git archive <commit> gtp_jax | tar -x -C dir`); without it the
# stacked-layout rows are skipped.
# Usage: OUT=dir [BASE=dir] [PARTS="copies small eight big"] bash docs/results/2026-11-27_1xH200/offload_layouts/offload_layouts.sh
# On a CPU (checks the script): SMALL=tiny SEQ1=32 EIGHT=tiny SEQ2=64 PARTS="small eight"
#   STEPS=2 bash docs/results/2026-11-27_1xH200/offload_layouts/offload_layouts.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-runs/offload_layouts}; mkdir -p "$OUT"
PARTS=${PARTS:-"copies small eight big"}; BASE=${BASE:-}
SMALL=${SMALL:-1b}; SEQ1=${SEQ1:-2048}; STEPS=${STEPS:-8}
EIGHT=${EIGHT:-llama3-8b}; LAYERS8=${LAYERS8:-8}; SEQ2=${SEQ2:-4096}; BIG_STEPS=${BIG_STEPS:-5}
LIMIT=${LIMIT:-200}
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
report() { grep -E "step time|memory per device|out of memory|RESOURCE_EXHAUSTED|Error" "$1" | head -4; }
codes="grouped"; [ -n "$BASE" ] && codes="stacked grouped"
path_of() { if [ "$1" = stacked ]; then echo "$BASE"; else echo "$PWD"; fi; }
run() {  # name, code, then train flags
  local name=$1 code=$2; shift 2
  log "$name ($code)"
  PYTHONPATH="$(path_of "$code")" timeout "$LIMIT" python3 -m gtp_jax train --gtp 1 --dp 1 "$@" \
    > "$OUT/$name.log" 2>&1
  echo "exit $?"; report "$OUT/$name.log"
}
for part in $PARTS; do
  case $part in
    copies)
      log "host_copies"
      PYTHONPATH="$PWD" python3 docs/results/2026-11-27_1xH100/host_copies/host_copies.py --layers 16 --elements 100000000 \
        --forms stacked,trainer,grouped 2>&1 | grep -v "^W\|^I0" | tee "$OUT/host_copies.log" ;;
    small)
      run small_device grouped --preset "$SMALL" --seq "$SEQ1" --batch 4 --steps "$STEPS" \
        --no-offload-optimizer
      for code in $codes; do
        run "small_offload_$code" "$code" --preset "$SMALL" --seq "$SEQ1" --batch 4 \
          --steps "$STEPS" --offload-optimizer
      done ;;
    eight)
      for code in $codes; do
        run "eight_offload_$code" "$code" --preset "$EIGHT" --layers "$LAYERS8" --seq "$SEQ2" \
          --batch 1 --steps "$STEPS" --remat full --offload-optimizer
      done
      run eight_device grouped --preset "$EIGHT" --layers "$LAYERS8" --seq "$SEQ2" --batch 1 \
        --steps "$STEPS" --remat full --no-offload-optimizer ;;
    big)
      for code in $codes; do
        run "big_offload_$code" "$code" --preset "$EIGHT" --seq "$SEQ2" --batch 1 \
          --steps "$BIG_STEPS" --remat full --no-unroll-layers --offload-optimizer
      done ;;
    *) echo "unknown part $part (copies small eight big)" >&2; exit 2 ;;
  esac
done
log done
