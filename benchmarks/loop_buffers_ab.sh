#!/usr/bin/env bash
# The unrolled and scanned layer loops' buffers on one GPU, before / after in one call: the
# compiled memory of 8 llama3-8b layers (gtp 1: weights replicated) at 2048 and 8192 tokens,
# and the step and peak of the 1b-shaped user decoder on gtp_jax.Stack (4 x 2048 tokens,
# remat dots) and of the bundled 1b preset, unwrapped. OLD_LOOP: a copy of an earlier
# gtp_jax/sharding/loop.py, run as "old"; EXTRA_ENV: an environment assignment run as a third
# variant of this checkout's loop ("new_env").
# MEM=0: the steps alone; OLD_FIRST=1: the old loop's rows first.
#   OUT=dir BUDGET=480 [OLD_LOOP=file] [EXTRA_ENV=NAME=1] bash benchmarks/loop_buffers_ab.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-runs/loop_buffers}; mkdir -p "$OUT"
DEFAULT_BUDGET=480
. "$(dirname "$0")/budget.sh"
COMMON="--preset 1b --seq 2048 --per-device-batch 4 --steps 10 --warmup 3 --compiled-memory
  --timeout 100"
rows() {  # label [env assignment]
  local label=$1; shift
  [ "${MEM:-1}" = 1 ] && for shape in "2048 --unroll-layers" "8192 --unroll-layers" \
      "8192 --no-unroll-layers"; do
    read -r seq loop <<< "$shape"
    name="mem8b_${seq}${loop/--/_}_$label"
    # shellcheck disable=SC2086
    within 90 env "${ENVS[@]}" python3 -m gtp_jax.bench memory --preset llama3-8b --layers 8 \
      --seq "$seq" --gtp 1 $loop --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    grep -E "^peak" "$OUT/$name.log"
  done
  # shellcheck disable=SC2086
  within 110 env "${ENVS[@]}" python3 -m gtp_jax.bench overlap $COMMON --user-remat dots \
    --user-loop stack --variants user_unwrapped --json "$OUT/stack_$label.json" \
    > "$OUT/stack_$label.log" 2>&1
  # shellcheck disable=SC2086
  within 110 env "${ENVS[@]}" python3 -m gtp_jax.bench overlap $COMMON \
    --variants compute_only_dots --json "$OUT/bundled_$label.json" > "$OUT/bundled_$label.log" 2>&1
}
log "python loop"
# shellcheck disable=SC2086
within 110 python3 -m gtp_jax.bench overlap $COMMON --user-remat dots --user-loop python \
  --variants user_unwrapped --json "$OUT/python.json" > "$OUT/python.log" 2>&1
old_rows() {  # label
  if [ -n "${OLD_LOOP:-}" ]; then
    cp gtp_jax/sharding/loop.py "$OUT/loop_new.py"; cp "$OLD_LOOP" gtp_jax/sharding/loop.py
    ENVS=(GTP_NONE=1); log "$1"; rows "$1"
    cp "$OUT/loop_new.py" gtp_jax/sharding/loop.py
  fi
}
[ "${OLD_FIRST:-0}" = 1 ] && old_rows old
ENVS=(GTP_NONE=1); log new; rows new
if [ -n "${EXTRA_ENV:-}" ]; then ENVS=("$EXTRA_ENV"); log "new $EXTRA_ENV"; rows new_env; fi
[ "${OLD_FIRST:-0}" = 1 ] && old_rows old2 || old_rows old
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| run | step ms | peak GiB | compiled peak GiB |")
print("|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    name = os.path.basename(path)[:-5]
    if name.startswith("mem8b"):
        r = json.load(open(path))
        print(f"| {name} | - | - | {r['peak_bytes'] / 2**30:.2f} ({r['phase']}) |")
        continue
    for r in json.load(open(path)):
        print(f"| {name} | {r['step_ms']:.1f} | {r['peak_mem_gib']:.2f} "
              f"| {r.get('compiled_peak_gib') or 0:.2f} |")
PY
log done
