#!/usr/bin/env bash
# Llama-3-8B on two GPUs in one call: gtp_jax's step beside compiled FSDP2 at 2048 x 1,
# 8192 x 1 and 4096 x 2 tokens per GPU (campaign part `step`), the command line's 50-step run
# with the preset's defaults (its losses, its step beside `bench overlap --vocab 256` at the
# same shape) and its compile report, run twice (a cold and a cached compile).
#   OUT=dir bash benchmarks/llama8b_2gpu.sh        (from the repository root, 2 GPUs)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/llama8b}; mkdir -p "$OUT"
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
log "sanity: the tiny preset trains"
timeout 120 python3 -m gtp_jax train --preset tiny --steps 3 --gtp 2 --dp 1 2>&1 | tail -3
if [ "${ROWS:-1}" = 1 ]; then
  OUT="$OUT" PARTS=step SHAPES="${SHAPES:-2048x1 8192x1 4096x2}" STEPS=${STEPS:-8} LIMIT=${LIMIT:-200} \
    bash benchmarks/campaign.sh 2>&1 | grep -v "^==.*$" | tail -12
fi
log "command line: llama3-8b, seq 8192, batch 2, 50 steps, the preset's defaults"
for run in cold cached; do
  timeout 300 python3 -m gtp_jax train --preset llama3-8b --seq 8192 --batch 2 --steps 50 \
    --log-every 10 --compile-cache "$OUT/cc" --log-dir "$OUT/cli_$run" \
    --metrics-json "$OUT/cli_$run.json" > "$OUT/cli_$run.log" 2>&1
  grep -E "lr |compil|summary|loss:|step time|first step" "$OUT/cli_$run.log" | head -9
  [ "${CACHED:-1}" = 1 ] || break
done
python3 - "$OUT/cli_cold.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["steps"]
losses = [r["loss"] for r in s]
print(f"cli losses: first {losses[0]:.3f}, max {max(losses):.3f}, mean of last 5 "
      f"{sum(losses[-5:]) / 5:.3f} over {len(losses)} steps")
PY
log "bench overlap at the command line's shape (vocab 256)"
timeout 200 python3 -m gtp_jax.bench overlap --preset llama3-8b --seq 8192 --per-device-batch 1 \
  --vocab 256 --optimizer train --steps 8 --warmup 2 --variants gtp_dots \
  --json "$OUT/bench_vocab256.json" 2>&1 | grep -E "^\| gtp"
log done
