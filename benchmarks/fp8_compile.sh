#!/usr/bin/env bash
# Where FP8's time to the first step goes, one switch at a time, on one GPU: 8 llama3-8b
# layers at 8192 tokens, bf16 against FP8 delayed compute with FP8 gathers, the unrolled
# loop against the scanned one, and the quantizers as Pallas kernels against XLA's fusions
# of the same arithmetic (--quant-backend reference); then the fastest FP8 variant compiled
# cold and again from the persistent compilation cache. Last, a user's decoder unwrapped
# (weights replicated) on the stack and as a Python loop of blocks.
#   OUT=dir BUDGET=540 bash benchmarks/fp8_compile.sh        (from the repository root)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/fp8_compile}; mkdir -p "$OUT"
DEFAULT_BUDGET=540
. "$(dirname "$0")/budget.sh"
COMMON="--preset ${PRESET:-llama3-8b} --layers ${LAYERS:-8} --seq ${SEQ:-8192} --per-device-batch 1
  --steps 6 --warmup 2 --variants gtp_dots --timeout 140"
FP8="--fp8-compute delayed --gather-format fp8"
row() {  # name, options...
  local name=$1; shift
  log "$name"
  # shellcheck disable=SC2086
  within 150 python3 -m gtp_jax.bench overlap $COMMON "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  grep -E "^\| gtp|first step|Error|error:" "$OUT/$name.log" | head -3
}
row bf16_unrolled
row fp8_unrolled_pallas $FP8
row fp8_unrolled_reference $FP8 --quant-backend reference
row fp8_scanned_pallas $FP8 --no-unroll-layers
for run in cold cached; do
  JAX_COMPILATION_CACHE_DIR="$OUT/cc" row "fp8_reference_cache_$run" $FP8 --quant-backend reference
done
log "a user's decoder, unwrapped: on the stack and as a Python loop (1b shape, 4 x 2048)"
for loop in stack python; do
  within 120 python3 -m gtp_jax.bench overlap --preset 1b --seq 2048 --per-device-batch 4 \
    --steps 10 --warmup 3 --attention xla --user-loop "$loop" --variants user_unwrapped \
    --timeout 110 --json "$OUT/user_unwrapped_$loop.json" > "$OUT/user_unwrapped_$loop.log" 2>&1
  grep -E "^\| user" "$OUT/user_unwrapped_$loop.log" | head -2
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| run | step ms | first step s | compile s | cache | peak GiB |")
print("|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        rows = json.load(open(path))
    except (OSError, ValueError):
        continue
    for r in rows if isinstance(rows, list) else rows.get("rows", [rows]):
        if not isinstance(r, dict) or "step_ms" not in r:
            continue
        name = os.path.basename(path)[:-5]
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"| {name} {r['variant']} | {r['step_ms']:.1f} | {fmt(r.get('first_step_s'), '.1f')} "
              f"| {fmt(r.get('compile_s'), '.1f')} | {r.get('compile_cache') or '-'} "
              f"| {r['peak_mem_gib']:.1f} |")
PY
log done
