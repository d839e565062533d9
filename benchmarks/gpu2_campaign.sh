#!/usr/bin/env bash
# Two-GPU checks in one call, parts in the order given (a part starts only while BUDGET
# seconds have not run out, and is stopped when they do):
#   latency: what a small collective costs inside a program (benchmarks/collective_latency.py;
#     $OUT/collective_latency.log), beside the planner's calibration;
#   fp8_1b / fp8_8b: FP8 compute fed by FP8 gathers against gtp_jax's bf16 step and against
#     PyTorch FSDP2 + torch.compile with torchao float8 and float8 all-gather
#     (benchmarks/fp8_2gpu.sh; torchao's wheel in .carry/whl), the 1b preset and the
#     llama3-8b shape (8 layers);
#   plan_1b / plan_8b: the layout planner's predictions against runs of its top layouts
#     (benchmarks/plan_accuracy.sh): 1b at seq 2048 and 4096 (8 sequences), llama3-8b
#     (32 layers) at seq 4096 (2 sequences; SEQS_8B="2048 4096" adds a second length);
#   offload: optimizer state in host memory against on the device over both GPUs
#     (benchmarks/offload.sh with GTP=2): the 1b step's cost, and the largest model that
#     trains at seq 4096 with and without it (llama3-8b with 96, 80, 64, 56, 48, 40 or its
#     32 layers, tried largest first; OFFLOAD_BIG overrides the list).
# Writes $OUT/fp8/, $OUT/plan/ (tables at the end of the log: plan_accuracy.json) and
# $OUT/offload/, and all of it again as $OUT/campaign.tgz.
# Usage: OUT=dir [BUDGET=seconds] [PARTS="latency fp8_1b plan_1b plan_8b fp8_8b offload"]
#   [FP8_VARIANTS=none:none,fp8:delayed,fp8:tensorwise] [TOP=5] [SEQS_8B="2048 4096"]
#   [REQUIRE_GPU=H200] bash benchmarks/gpu2_campaign.sh
# REQUIRE_GPU: run nothing (status 3) unless every GPU's name contains it, so a campaign
# meant for one GPU model costs seconds, not minutes, on another.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/gpu2}; mkdir -p "$OUT"
BUDGET=${BUDGET:-3600}; TOP=${TOP:-5}  # layouts run per case (run D on 2x H200: 3 took 280 s)
FP8_VARIANTS=${FP8_VARIANTS:-none:none,fp8:delayed,fp8:tensorwise}
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
nvidia-smi -L 2>&1 | tee "$OUT/gpus.txt"
if [ -n "${REQUIRE_GPU:-}" ] && grep -v -q -- "$REQUIRE_GPU" "$OUT/gpus.txt"; then
  echo "not run: REQUIRE_GPU=$REQUIRE_GPU, and not every GPU above is one"; exit 3
fi
for part in ${PARTS:-fp8_1b plan_1b plan_8b fp8_8b offload}; do
  if [ "$(left)" -lt 30 ]; then log "skip $part: the budget is spent"; continue; fi
  log "$part ($(left) s left)"
  case $part in
    latency)
      timeout "$(left)" python3 benchmarks/collective_latency.py 2>&1 \
        | tee "$OUT/collective_latency.log" ;;
    fp8_1b|fp8_8b)
      OUT="$OUT/fp8" MODELS=${part#fp8_} VARIANTS="$FP8_VARIANTS" \
        timeout "$(left)" bash benchmarks/fp8_2gpu.sh ;;
    plan_1b)
      OUT="$OUT/plan" PRESETS=1b SEQS="2048 4096" BATCH=8 TOP=$TOP STEPS=8 TIMEOUT=300 \
        timeout "$(left)" bash benchmarks/plan_accuracy.sh ;;
    plan_8b)
      OUT="$OUT/plan" PRESETS=llama3-8b SEQS="${SEQS_8B:-4096}" BATCH=2 TOP=$TOP STEPS=6 TIMEOUT=420 \
        timeout "$(left)" bash benchmarks/plan_accuracy.sh ;;
    offload)
      OUT="$OUT/offload" GTP=2 BIG_STEPS=3 LIMIT=300 \
        BIG="${OFFLOAD_BIG:-llama3-8b:96 llama3-8b:80 llama3-8b:64 llama3-8b:56 llama3-8b:48 llama3-8b:40 llama3-8b}" \
        timeout "$(left)" bash benchmarks/offload.sh ;;
    *) echo "unknown part $part (latency fp8_1b fp8_8b plan_1b plan_8b offload)"; exit 2 ;;
  esac
done
log "tables"
SUMMARY_ONLY=1 OUT="$OUT/plan" bash benchmarks/plan_accuracy.sh
python3 - "$OUT/fp8" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(f"{out}/*_gtp_*.json")):
    for r in json.load(open(path)):
        rows.append((os.path.basename(path)[:-5], r["step_ms"], r["peak_mem_gib"]))
for path in sorted(glob.glob(f"{out}/*_torch.jsonl")):
    for line in open(path):
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            rows.append((f"{r['preset']}_{r['variant']}", r["step_ms"], r["peak_mem_gib"]))
for name, ms, gib in rows:
    print(f"{name:<42} {ms:8.1f} ms {gib:7.2f} GiB")
PY
# One archive of everything written, beside the folders: a harness that brings back only a
# few files, or none from deep folders, still returns every plan and run.
tar czf "$OUT/campaign.tgz" -C "$OUT" --exclude campaign.tgz . 2>/dev/null
log "done"
