#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# The headline figures on all GPUs of the host, side by side in one call (1b preset, seq 2048,
# 4 sequences per GPU, gtp = number of GPUs, the defaults otherwise):
#   1. two rounds alternating gtp_jax's default step (`bench overlap --variants gtp_dots`) with
#      the torch.compile'd PyTorch FSDP2 peer (benchmarks/torch_fsdp2.py, COMPILE=1), then the
#      one-GPU compute-only step; round 1 traces gtp_jax, and the trace gives the share of
#      all-gather + reduce-scatter time hidden behind compute on each GPU and the longest
#      exposed stretches (`python -m gtp_jax.bench.trace --exposed`);
#   2. ring attention, cp = number of GPUs at 16k tokens (`python -m gtp_jax.bench.context`,
#      remat full, traced: the ring's hidden share).
# Writes $OUT/round{1,2}.json, torch_round{1,2}.jsonl, compute_only.json, trace_gtp.log,
# context_16k.json, headline.log.
# Usage: OUT=dir [ROUNDS=2] [SKIP_CONTEXT=1] bash docs/results/2026-11-24_1xH200/headline/headline.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/headline}; mkdir -p "$OUT"
PROF=/tmp/gtp_headline_prof; rm -rf "$PROF"
A="--preset 1b --seq 2048 --per-device-batch 4 --steps 20 --warmup 3 --timeout 150"
NGPU=$(nvidia-smi -L | wc -l)
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
{
nvidia-smi -L
for round in $(seq 1 "${ROUNDS:-2}"); do
  log "gtp_jax default step, round $round"
  prof=""; [ "$round" = 1 ] && prof="--profile-dir $PROF --profile-variants gtp_dots"
  python3 -m gtp_jax.bench overlap $A --variants gtp_dots $prof \
    --json "$OUT/round$round.json" 2>&1 | grep -E '^\[|Error'
  log "torch FSDP2 compiled, round $round"
  COMPILE=1 PRESET=1b SEQ=2048 MB=4 STEPS=20 timeout 150 \
    torchrun --nproc_per_node="$NGPU" benchmarks/torch_fsdp2.py 2>&1 \
    | grep -E '^RESULT|Error' | tee "$OUT/torch_round$round.jsonl"
done
log "compute only (1 GPU)"
python3 -m gtp_jax.bench overlap $A --variants compute_only_dots \
  --json "$OUT/compute_only.json" 2>&1 | grep -E '^\[|Error'
log "trace of the default step"
python3 -m gtp_jax.bench.trace "$PROF/gtp_dots" --steps 3 --exposed 12 2>&1 | tee "$OUT/trace_gtp.log"
if [ "${SKIP_CONTEXT:-0}" != 1 ]; then
  log "ring attention, cp=$NGPU, 16k"
  python3 -m gtp_jax.bench.context --preset 1b --remat full --mesh "cp=$NGPU" --seqs 16384 \
    --steps 5 --warmup 2 --timeout 200 --profile-dir "$PROF/context" \
    --json "$OUT/context_16k.json" 2>&1 | grep -v -i deprecat | grep -E '^\||^\[|Error'
fi
log done
} 2>&1 | tee "$OUT/headline.log"
