#!/usr/bin/env bash
# Where the bf16 and FP8 steps' compile time goes on one GPU, and which XLA settings shorten
# it without slowing the step: llama3-8b layers at 8192 tokens (the unrolled layer loop, remat
# dots, `bench overlap`'s gtp_dots variant), each row a fresh process with no compilation
# cache; the last row traces its compile (compile_events in the JSON).
#   OUT=dir BUDGET=540 bash benchmarks/compile_flags.sh        (from the repository root)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/compile_flags}; mkdir -p "$OUT"
DEFAULT_BUDGET=540
. "$(dirname "$0")/budget.sh"
unset JAX_COMPILATION_CACHE_DIR
COMMON="--preset ${PRESET:-llama3-8b} --seq ${SEQ:-8192} --per-device-batch 1
  --steps 6 --warmup 2 --variants gtp_dots --timeout 150"
FP8="--fp8-compute delayed --gather-format fp8"
row() {  # name, extra XLA flags ("" for none), options...
  local name=$1 flags=$2; shift 2
  log "$name ($flags)"
  # shellcheck disable=SC2086
  XLA_FLAGS="${XLA_FLAGS:-} $flags" within 160 python3 -m gtp_jax.bench overlap $COMMON "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  grep -E "^\| gtp|first step|Error|error:" "$OUT/$name.log" | head -3
}
PROF="--compile-profile-dir $OUT/prof"
# Each setting beside the default, in turn (no row is traced but the last).
for layers in 8 16; do
  row "bf16_l${layers}" "" --layers $layers
  row "bf16_l${layers}_autotune2" "--xla_gpu_autotune_level=2" --layers $layers
  row "fp8_l${layers}" "" --layers $layers $FP8
  row "fp8_l${layers}_autotune2" "--xla_gpu_autotune_level=2" --layers $layers $FP8
done
row bf16_l8_again "" --layers 8
row fp8_l8_traced "" --layers 8 $FP8 $PROF
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| run | step ms | first step s | compile s | peak GiB |")
print("|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        rows = json.load(open(path))
    except (OSError, ValueError):
        continue
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {os.path.basename(path)[:-5]} | {r['step_ms']:.1f} | {fmt(r.get('first_step_s'))} "
              f"| {fmt(r.get('compile_s'))} | {r['peak_mem_gib']:.1f} |")
        native = [e for e in r.get("compile_events") or [] if not e["name"].startswith("$")]
        for e in native[:25]:
            print(f"    {e['seconds']:8.2f} s  x{e['count']:<5d} {e['name'][:90]}")
PY
log done
