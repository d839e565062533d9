#!/usr/bin/env bash
# The unrolled layer loop's weight slices on one GPU: a user's decoder unwrapped (weights
# replicated, the 1b shape, 4 x 2048 tokens, remat dots) on gtp_jax.Stack against the same
# blocks as a Python loop, and the bundled 1b preset unwrapped (compute_only); with this
# checkout's loop and, where OLD_LOOP names a copy of gtp_jax/sharding/loop.py, with that one.
#   OUT=dir BUDGET=400 [OLD_LOOP=file] bash benchmarks/stack_slices.sh     (repository root)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/stack_slices}; mkdir -p "$OUT"
DEFAULT_BUDGET=400
. "$(dirname "$0")/budget.sh"
COMMON="--preset 1b --seq 2048 --per-device-batch 4 --steps 10 --warmup 3 --compiled-memory
  --timeout 110"
rows() {  # label
  for loop in stack python; do
    log "$1: user decoder, $loop"
    # shellcheck disable=SC2086
    within 120 python3 -m gtp_jax.bench overlap $COMMON --user-remat dots --user-loop "$loop" \
      --variants user_unwrapped --json "$OUT/$1_user_$loop.json" > "$OUT/$1_user_$loop.log" 2>&1
    grep -E "^\[|Error|error:" "$OUT/$1_user_$loop.log" | head -2
  done
  log "$1: bundled 1b, unwrapped"
  # shellcheck disable=SC2086
  within 120 python3 -m gtp_jax.bench overlap $COMMON --variants compute_only_dots \
    --json "$OUT/$1_bundled.json" > "$OUT/$1_bundled.log" 2>&1
  grep -E "^\[|Error|error:" "$OUT/$1_bundled.log" | head -2
}
rows new
if [ -n "${OLD_LOOP:-}" ]; then
  cp gtp_jax/sharding/loop.py "$OUT/loop_new.py"
  cp "$OLD_LOOP" gtp_jax/sharding/loop.py
  rows old
  cp "$OUT/loop_new.py" gtp_jax/sharding/loop.py
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| run | step ms | peak GiB | compiled peak GiB |")
print("|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    for r in json.load(open(path)):
        print(f"| {os.path.basename(path)[:-5]} | {r['step_ms']:.1f} | {r['peak_mem_gib']:.2f} "
              f"| {r.get('compiled_peak_gib') or 0:.2f} |")
PY
log done
