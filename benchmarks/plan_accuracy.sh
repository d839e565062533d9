#!/usr/bin/env bash
# Accuracy of the layout planner on the GPUs of this host, in one call: for the 1b preset
# (and llama3-8b where that preset exists) at two sequence lengths, plan
# (python -m gtp_jax plan --json), train the top 5 layouts that fit for a few steps
# (python -m gtp_jax train <the layout's flags> --metrics-json), and compare predicted with
# measured peak memory per device (peak_bytes_in_use) and step time (median step, the
# compiling first step excluded). Writes $OUT/plan_accuracy.json and prints the table.
# Environment: OUT (default runs), SEQS (default "2048 4096"), BATCH (default 8),
# STEPS (default 10), TOP (default 5), PRESETS (default "1b llama3-8b"), TIMEOUT (seconds
# per plan or run, default 900), SUMMARY_ONLY=1 (print the table of the runs already in $OUT).
# JAX's persistent compilation cache is on (JAX_COMPILATION_CACHE_DIR, default a folder under
# /tmp), so a run reuses the program its plan compiled instead of compiling it again.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gtp_jax_plan_accuracy_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
TIMEOUT=${TIMEOUT:-900}
OUT=${OUT:-runs}; mkdir -p "$OUT/plan_accuracy"
SEQS=${SEQS:-"2048 4096"}; BATCH=${BATCH:-8}; STEPS=${STEPS:-10}; TOP=${TOP:-5}
PRESETS=${PRESETS:-"1b llama3-8b"}
[ "${SUMMARY_ONLY:-0}" = 1 ] && PRESETS=""
for preset in $PRESETS; do
  if ! python3 -c "import sys; from gtp_jax.models import PRESETS; sys.exit('$preset' not in PRESETS)"; then
    echo "skip $preset: no such preset in this version"; continue
  fi
  for seq in $SEQS; do
    tag="${preset}_s${seq}"
    plan_json="$OUT/plan_accuracy/plan_${tag}.json"
    timeout "$TIMEOUT" python3 -m gtp_jax plan --preset "$preset" --seq "$seq" --batch "$BATCH" \
      --steps "$STEPS" --warmup 2 \
      --top "$TOP" --limit 30 --json "$plan_json" 2>&1 | tee "$OUT/plan_accuracy/plan_${tag}.log"
    [ -f "$plan_json" ] || continue
    python3 - "$plan_json" "$TOP" > "$OUT/plan_accuracy/flags_${tag}.txt" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
for c in [c for c in plan["candidates"] if c["status"] == "fits"][:int(sys.argv[2])]:
    print(c["flags"])
PY
    i=0
    while read -r flags; do
      i=$((i + 1))
      timeout "$TIMEOUT" python3 -m gtp_jax train --preset "$preset" --seq "$seq" --batch "$BATCH" \
        --steps "$STEPS" --warmup 2 $flags --metrics-json "$OUT/plan_accuracy/run_${tag}_${i}.json" \
        2>&1 | tail -3 | sed "s/^/[$tag #$i] /"
    done < "$OUT/plan_accuracy/flags_${tag}.txt"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = []
for plan_path in sorted(glob.glob(f"{out}/plan_accuracy/plan_*.json")):
    tag = os.path.basename(plan_path)[5:-5]
    plan = json.load(open(plan_path))
    fits = [c for c in plan["candidates"] if c["status"] == "fits"]
    for i, cand in enumerate(fits, 1):
        path = f"{out}/plan_accuracy/run_{tag}_{i}.json"
        measured = json.load(open(path)) if os.path.exists(path) else None
        peak = step = None
        if measured:
            mem = measured["summary"].get("memory_per_device") or {}
            peak = mem.get("peak_bytes_in_use")
            times = [s["step_time_s"] for s in measured["steps"][1:]]
            step = statistics.median(times) if times else None
        rows.append({"case": tag, "rank": i, "flags": cand["flags"],
                     "predicted_peak_bytes": cand["peak_bytes"], "measured_peak_bytes": peak,
                     "predicted_step_s": cand["step_seconds"], "measured_step_s": step})
def err(p, m):
    return None if p is None or not m else (p - m) / m
for r in rows:
    r["peak_error"] = err(r["predicted_peak_bytes"], r["measured_peak_bytes"])
    r["step_error"] = err(r["predicted_step_s"], r["measured_step_s"])
cases = {}
for r in rows:
    cases.setdefault(r["case"], []).append(r)
summary = {}
for case, rs in cases.items():
    ran = [r for r in rs if r["measured_step_s"]]
    if ran:
        fastest = min(r["measured_step_s"] for r in ran)
        top = next((r for r in ran if r["rank"] == 1), None)
        summary[case] = {"top_vs_fastest": top and top["measured_step_s"] / fastest - 1}
json.dump({"rows": rows, "summary": summary}, open(f"{out}/plan_accuracy.json", "w"), indent=1)
print(f"{'case':<18} {'#':>2} {'pred GiB':>9} {'meas GiB':>9} {'err':>7} {'pred ms':>9} "
      f"{'meas ms':>9} {'err':>7}  flags")
g = lambda b: f"{b / 2**30:9.2f}" if b else f"{'-':>9}"
ms = lambda s: f"{s * 1e3:9.1f}" if s else f"{'-':>9}"
pc = lambda e: f"{e * 100:+6.1f}%" if e is not None else f"{'-':>7}"
for r in rows:
    print(f"{r['case']:<18} {r['rank']:>2} {g(r['predicted_peak_bytes'])} "
          f"{g(r['measured_peak_bytes'])} {pc(r['peak_error'])} {ms(r['predicted_step_s'])} "
          f"{ms(r['measured_step_s'])} {pc(r['step_error'])}  {r['flags']}")
for case, s in summary.items():
    print(f"{case}: top-ranked layout vs fastest measured: {pc(s['top_vs_fastest'])}")
PY
