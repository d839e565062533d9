#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# XLA's scheduler limit on asynchronous transfers in flight
# (--xla_gpu_experimental_parallel_async_compute_limit, set through XLA_FLAGS) on offloaded
# runs, in the four calls steps 4-7 of this folder's README list, one call per CALL:
#   CALL=1  the 1b preset at the default (2), 4 and 8; 8 llama3-8b layers at 4; the
#           schedule probe (sched_probe.py) at 4
#   CALL=2  1b at 16; 8 layers at 8; llama3-8b stacked (the release before, at BASE) and
#           grouped at 8
#   CALL=3  1b at 32 and 64; 8 layers at 16 and 64; llama3-8b at 64
#   CALL=4  llama3-8b at 16
# Each run writes $OUT/<name>.log and prints its step time and peak memory.
# Usage: OUT=dir CALL=1|2|3|4 [BASE=dir] bash docs/results/2026-11-27_1xH200/offload_layouts/limit_sweep.sh
set -u
export NCCL_NVLS_ENABLE=0
HERE=docs/results/2026-11-27_1xH200/offload_layouts
BASE=${BASE:-$PWD/.carry/base}  # the gtp_jax package of commit 5d749de, as a copy
T0=$(date +%s)
one() {  # name, limit ('' = default), code path, then train flags
  local name=$1 lim=$2 path=$3; shift 3
  local xf=""; [ -n "$lim" ] && xf="--xla_gpu_experimental_parallel_async_compute_limit=$lim"
  echo "== t=$(( $(date +%s) - T0 ))s $name limit=${lim:-default} code=$path"
  XLA_FLAGS="$xf" PYTHONPATH=$path timeout "$T" python3 -m gtp_jax train --gtp 1 --dp 1 "$@" \
    --offload-optimizer > "$OUT/$name.log" 2>&1
  grep -E "step time|memory per device:|rror" "$OUT/$name.log" | head -3
}
SMALL="--preset 1b --seq 2048 --batch 4 --steps 8"
EIGHT="--preset llama3-8b --layers 8 --seq 4096 --batch 1 --steps 8 --remat full"
BIG="--preset llama3-8b --seq 4096 --batch 1 --steps 5 --remat full --no-unroll-layers"
case ${CALL:?CALL=1, 2, 3 or 4} in
  1) T=150
     for lim in "" 4 8; do one "small_lim${lim:-d}" "$lim" "$PWD" $SMALL; done
     one eight_lim4 4 "$PWD" $EIGHT
     XLA_FLAGS="--xla_gpu_experimental_parallel_async_compute_limit=4" PYTHONPATH=$PWD \
       python3 "$HERE/sched_probe.py" 1b 2>&1 | grep -v "^W\|^I0" | tail -4 | cut -c1-1500 \
       | tee "$OUT/sched_limit4.log" ;;
  2) T=200
     one small_lim16 16 "$PWD" $SMALL
     one eight_lim8 8 "$PWD" $EIGHT
     one big_stacked "" "$BASE" $BIG
     one big_grouped_lim8 8 "$PWD" $BIG ;;
  3) T=200
     one small_lim32 32 "$PWD" $SMALL
     one small_lim64 64 "$PWD" $SMALL
     one eight_lim16 16 "$PWD" $EIGHT
     one eight_lim64 64 "$PWD" $EIGHT
     one big_grouped_lim64 64 "$PWD" $BIG ;;
  4) T=200
     one big_grouped_lim16 16 "$PWD" $BIG ;;
  *) echo "CALL=1, 2, 3 or 4"; exit 2 ;;
esac
