#!/usr/bin/env bash
# Every 8-GPU row in two calls of under 10 minutes each: benchmarks/campaign.sh's parts, run
# while BUDGET seconds last (default 560); a row that needs more than what is left is
# skipped with a line saying so.
#   CALL=1  llama3-8b at 8192 x 1 tokens per GPU (EIGHT_SHAPES; torchtitan's published
#           figures are at 2 x 8192: EIGHT_SHAPES=8192x2): gtp8 and dp2 x gtp4 against
#           FSDP2 and HSDP (2 x 4) compiled in bf16, and with FP8 compute fed by FP8 gathers
#           against FSDP2 + torchao float8 (torchao's wheel in .carry/whl); tokens/s per GPU
#           beside torchtitan's 8x H100 figures and the planner's on-paper step (eight).
#   CALL=2  the llama3-8b step on 1 (16 layers), 2, 4 and 8 GPUs, traced: tokens/s, MFU and
#           exposed communication per GPU (scaling); llama3-70b-shaped layers (LAYERS_70B,
#           default "28 24") at gtp8 and tp2 x gtp4 beside the planner's on-paper step and peak
#           (layers_70b).
# Usage, from the repository root on 8 GPUs:  OUT=dir CALL=1 bash benchmarks/eight_gpu.sh
# SCALE=cpu: the same parts on 8 simulated CPU devices with tiny shapes, no PyTorch peer.
set -u
export BUDGET=${BUDGET:-560} CPU_DEVICES=${CPU_DEVICES:-8}
case "${CALL:-1}" in
  1) PARTS="eight:120" ;;
  2) PARTS="scaling:100 layers_70b:180" ;;
  *) echo "CALL=${CALL}: use 1 or 2"; exit 2 ;;
esac
[ "${SCALE:-gpu}" = cpu ] || export STEPS=${STEPS:-6} LIMIT=${LIMIT:-240}
PARTS="$PARTS" exec bash "$(dirname "$0")/campaign.sh"
