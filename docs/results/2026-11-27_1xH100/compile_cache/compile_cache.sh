# The compile cache across processes on one GPU: plan the 1b preset with the optimizer
# offloaded under a 16 GiB budget (the planner keeps what fits of the moments on the
# device), then run the printed train command three times in new processes: twice with the
# plan's compile cache, once with --compile-cache off (a compile of its own). Prints the
# planned peak, each run's measured peak and each run's wall time (process start to end).
# Run from the repository root: OUT=dir bash docs/results/2026-11-27_1xH100/compile_cache/compile_cache.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/compile_cache}; mkdir -p "$OUT"
CACHE=/tmp/gtp_jax_compile_cache_check; rm -rf "$CACHE"
P="--preset 1b --seq 2048 --batch 4 --steps 8 --warmup 2"
quiet() { grep -v "^W1\|^I1\|^E1"; }
t0=$(date +%s.%N)
python3 -m gtp_jax plan $P --gpus 1 --offload on --memory-gib 16 --top 1 --limit 3 \
  --compile-cache "$CACHE" --json "$OUT/plan.json" 2>&1 | quiet | tail -6
echo "plan wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
flags=$(python3 -c "import json; print(json.load(open('$OUT/plan.json'))['candidates'][0]['flags'])")
echo "layout: $flags"
i=0
for cache in "$CACHE" "$CACHE" off; do
  i=$((i + 1))
  t0=$(date +%s.%N)
  eval "python3 -m gtp_jax train $P $flags --compile-cache $cache --metrics-json $OUT/train_$i.json" \
    2>&1 | quiet | grep -E "step time|memory per device: peak|rror" | sed "s|^|[run $i, cache $cache] |"
  echo "[run $i, cache $cache] wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
done
ls "$CACHE" | grep -c -- "-cache$" | sed 's/^/cache entries: /'
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
best = json.load(open(f"{out}/plan.json"))["candidates"][0]
print(f"planned peak {best['peak_bytes'] / 2**30:.3f} GiB")
for i in (1, 2, 3):
    mem = json.load(open(f"{out}/train_{i}.json"))["summary"].get("memory_per_device") or {}
    print(f"run {i}: measured peak {mem.get('peak_bytes_in_use', 0) / 2**30:.3f} GiB")
PY
