#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# One-GPU checks of this release, in one call (each part under its own timeout):
#   1. the FP8 GEMM size sweep (python -m gtp_jax.bench fp8 --rows gemm);
#   2. the main job on the 1b preset (seq 2048, 4 sequences), bf16 and with --fp8-compute;
#   3. the main job on the llama3.2-1b preset (grouped-query attention);
#   4. the layout planner's predictions against runs of its top layouts
#      (benchmarks/plan_accuracy.sh, 1b preset, seq 2048);
#   5. fp8loss (now `PARTS=fp8_loss bash benchmarks/campaign.sh`): 1000 steps of the 1b preset on real text (DATA, default .carry/text: carry
#      a folder of .txt files; TOKENIZER, default .carry/tok: a tokenizer.json folder), seq
#      512 x 4, bf16 and --fp8-compute tensorwise (RECIPES="bf16 fp8"; "delayed" for
#      --fp8-compute delayed), the held-out loss every 250 steps;
#   6. offload: the 1b preset with and without --offload-optimizer (benchmarks/offload.sh,
#      its first part: step time, peak memory, equal losses; PROFILE=1 also times its host
#      copies);
#   7. fp8gathers: the 1b preset's step in bf16 and with FP8 compute fed by bf16 and by FP8
#      gathers (benchmarks/fp8_2gpu.sh without the torch rows; VARIANTS as there).
# Writes $OUT/gemm.json, $OUT/cli_*.json (--metrics-json), $OUT/campaign.log and
# $OUT/plan_accuracy/.
# Usage: OUT=dir [STEPS=15] [PARTS="gemm cli llama plan fp8loss offload fp8gathers"] [RECIPES=...] [DATA=dir]
#   [TOKENIZER=dir] bash docs/results/2026-11-25_1xH200/gpu1_campaign.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/gpu1}; mkdir -p "$OUT"
STEPS=${STEPS:-15}
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
cli() {  # name, extra flags
  local name=$1; shift
  log "python -m gtp_jax train $*"
  timeout 240 python3 -m gtp_jax train --seq 2048 --batch 4 --steps "$STEPS" --gtp 1 --dp 1 \
    "$@" --metrics-json "$OUT/cli_$name.json" 2>&1 | grep -v -i deprecat | tail -8
}
{
nvidia-smi -L
for part in ${PARTS:-gemm cli llama plan fp8loss offload}; do
  case $part in
    gemm) log "FP8 GEMM sweep"
          timeout 200 python3 -m gtp_jax.bench fp8 --rows gemm --json "$OUT/gemm.json" 2>&1 \
            | grep -E '^\|' ;;
    cli) cli 1b_bf16 --preset 1b
         cli 1b_fp8 --preset 1b --fp8-compute tensorwise ;;
    llama) cli llama32_1b --preset llama3.2-1b ;;
    fp8loss)
      for recipe in ${RECIPES:-bf16 fp8}; do
        extra=()
        [ "$recipe" = fp8 ] && extra=(--fp8-compute tensorwise --fp8-min-features 2048)
        [ "$recipe" = delayed ] && extra=(--fp8-compute delayed --fp8-min-features 2048)
        log "1b on ${DATA:-.carry/text}, 1000 steps, $recipe"
        timeout 300 python3 -m gtp_jax train --preset 1b --seq 512 --batch 4 --steps 1000 \
          --gtp 1 --dp 1 --data "${DATA:-.carry/text}" --tokenizer "${TOKENIZER:-.carry/tok}" \
          --eval-every 250 --eval-batches 16 \
          "${extra[@]}" --metrics-json "$OUT/loss_$recipe.json" 2>&1 | grep -v -i deprecat \
          | grep -E "loss|step time|memory|eval|held|rror" | tail -12
      done ;;
    fp8gathers) log "FP8 gathers, 1b"
                OUT="$OUT/fp8_gathers" MODELS=1b PEERS=0 timeout 480 \
                  bash benchmarks/fp8_2gpu.sh 2>&1 | tail -8 ;;
    offload) log "optimizer offload, 1b seq 2048"
             OUT="$OUT/offload" BIG="" timeout 200 bash benchmarks/offload.sh 2>&1 | tail -12 ;;
    plan) log "planner accuracy"
          OUT="$OUT" SEQS=2048 PRESETS=1b TOP=${TOP:-3} BATCH=4 STEPS=10 \
            timeout 420 bash benchmarks/plan_accuracy.sh 2>&1 | tail -25 ;;
  esac
done
log done
} 2>&1 | tee "$OUT/campaign.log"
