#!/usr/bin/env bash
# Every 4-GPU row in three calls of under 10 minutes each: benchmarks/campaign.sh's parts, run
# in order while BUDGET seconds last (default 560); a part or row that needs more than what
# is left is skipped with a line saying so.
#   CALL=1  llama3-8b beside compiled FSDP2 at 2048 x 1, 8192 x 1 and 4096 x 2 tokens per GPU
#           (breakdown: step, peak, MFU and exposed collectives of both sides, first step).
#   CALL=2  FP8 compute fed by FP8 gathers on the whole llama3-8b at 8192 x 1 beside FSDP2 +
#           torchao float8 (fp8_full; torchao's wheel in .carry/whl); 4 x 1 and 2 x 2
#           processes, --deterministic in float32, SIGTERM then --resume auto (processes);
#           MoE losses of ep1, ep2 x gtp2 and ep4 in float32 at
#           JAX_DEFAULT_MATMUL_PRECISION=highest (moe).
#   CALL=3  tp2 x gtp2, gtp4 and tp4 on llama3-8b at seq 8192, the ring variants traced
#           (tp_gtp; TP_MICRO=1 adds the ring collective matmul alone if time is left); the
#           planner's ranking of the three (plan_rank); ring attention cp4 at 16k and 32k,
#           traced, and cp2 x gtp2 on llama3-8b at 32k (context).
# Usage, from the repository root on 4 GPUs:  OUT=dir CALL=1 bash benchmarks/four_gpu.sh
# Tables across calls: python benchmarks/campaign_tables.py fp8_full CALL1_DIR CALL2_DIR (the
# bf16 FSDP2 row is call 1's), python benchmarks/campaign_tables.py rank CALL1_DIR CALL3_DIR.
# SCALE=cpu: the same parts on 4 simulated CPU devices with tiny shapes, no PyTorch peer.
set -u
export BUDGET=${BUDGET:-560}
case "${CALL:-1}" in
  1) PARTS="breakdown:150" ;;
  2) PARTS="fp8_full:150 processes:150 moe:100" ;;
  3) PARTS="tp_gtp:200 plan_rank:60 context:100" ;;
  *) echo "CALL=${CALL}: use 1, 2 or 3"; exit 2 ;;
esac
# the processes part: losses compared only (deterministic, float32 on GPUs), no kill -9;
# the moe part: losses only (its step times were measured on 2026-11-28)
export PROC_PLAIN=0 KILL=0 MOE_STEP=0 TP_MICRO=${TP_MICRO:-0}
if [ "${SCALE:-gpu}" = cpu ]; then
  export SHAPES="64x1 64x2" LONG_STEPS=${LONG_STEPS:-60} SIGTERM_AFTER=${SIGTERM_AFTER:-25}
else
  export SHAPES="2048x1 8192x1 4096x2" STEPS=${STEPS:-6} LIMIT=${LIMIT:-200} \
    TRAIN_STEPS=${TRAIN_STEPS:-8} LONG_STEPS=${LONG_STEPS:-120} \
    SIGTERM_AFTER=${SIGTERM_AFTER:-25} FP8_SHAPE=8192x1 FP8_PEERS=${FP8_PEERS:-float8}
fi
PARTS="$PARTS" exec bash "$(dirname "$0")/campaign.sh"
