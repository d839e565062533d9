#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# The 1b step of an older revision of gtp_jax beside this one, alternating, in one call
# (compute-only and gtp_jax at gtp = all GPUs, remat dots, seq 2048, 4 sequences per GPU).
# Usage: OUT=dir bash docs/results/2026-11-23_1xH200/step_before_after.sh OLD_REV   (run in a git checkout;
# on a machine without git, put the old tree in .carry/old and pass no revision)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-runs/before_after}; mkdir -p "$OUT"
OLD=${OLD_TREE:-.carry/old}
if [ $# -ge 1 ]; then rm -rf "$OLD"; mkdir -p "$OLD"; git archive "$1" gtp_jax benchmarks | tar -x -C "$OLD"; fi
ARGS="--preset 1b --seq 2048 --per-device-batch 4 --steps 30 --warmup 3 --timeout 240 --variants compute_only_dots,gtp_dots"
for round in 1 2; do
  for v in old new; do
    d=$PWD; [ "$v" = old ] && d=$(cd "$OLD" && pwd)
    echo "== $v round $round"
    (cd "$d" && PYTHONPATH="$d" python3 -m gtp_jax.bench overlap $ARGS \
      --json "$OUT/step_1b_before_after_${v}_${round}.json" 2>&1 | grep -E "^\[")
  done
done
