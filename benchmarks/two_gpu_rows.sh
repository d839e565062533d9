#!/usr/bin/env bash
# Two-GPU rows in one call, each within what is left of BUDGET seconds: the 1b preset at
# 4 x 2048 tokens per GPU beside compiled FSDP2 (campaign part `step`); a user's decoder on
# gtp_jax.Stack with its defaults beside XLA's automatic FSDP of it and its blocks in PyTorch
# under FSDP2 (benchmarks/torch_fsdp2.py MODEL=user); FP8 compute fed by FP8
# gathers on the whole llama3-8b at 8192 x 1, compiled cold and again from the persistent
# compilation cache; ring attention over cp2 on the 1b preset at 16k and 32k (traced: the
# ring's hidden share); the ring collective matmul alone at tp2 against its GEMM budget.
#   OUT=dir BUDGET=560 bash benchmarks/two_gpu_rows.sh        (from the repository root)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/two_gpu_rows}; mkdir -p "$OUT"
DEFAULT_BUDGET=560
. "$(dirname "$0")/budget.sh"
if [[ " ${ROWS:-1b user fp8 cp tp} " == *" 1b "* ]]; then
  log "1b, 4 x 2048 per GPU: gtp_jax's defaults beside FSDP2 compiled"
  OUT="$OUT" PARTS=step PRESET=1b SHAPES=2048x4 STEPS=10 LIMIT=110 \
    within 230 bash benchmarks/campaign.sh 2>&1 | grep -E "^\||^\[" | tail -4
fi
if [[ " ${ROWS:-1b user fp8 cp tp} " == *" user "* ]]; then
  log "a user's decoder on the stack (its defaults) beside XLA's automatic FSDP of it and"
  log "the same blocks in PyTorch under FSDP2 (compiled and eager)"
  within 260 python3 -m gtp_jax.bench overlap --preset 1b --seq 2048 --per-device-batch 4 \
    --steps 10 --warmup 3 --variants user_gtp,user_xla_fsdp --torch --timeout 70 \
    --json "$OUT/user_model.json" 2>&1 | grep -E "^\[|^\| user"
fi
if [[ " ${ROWS:-1b user fp8 cp tp} " == *" fp8 "* ]]; then
  for run in cold cached; do
    log "FP8 delayed + FP8 gathers, llama3-8b, 8192 x 1 per GPU, compile $run"
    JAX_COMPILATION_CACHE_DIR="$OUT/cc" within 150 python3 -m gtp_jax.bench overlap \
      --preset llama3-8b --seq 8192 --per-device-batch 1 --fp8-compute delayed \
      --gather-format fp8 --steps 6 --warmup 2 --variants gtp_dots --timeout 140 \
      --json "$OUT/fp8_8b_$run.json" 2>&1 | grep -E "^\[|^\| gtp"
  done
fi
if [[ " ${ROWS:-1b user fp8 cp tp} " == *" cp "* ]]; then
  log "ring attention, cp2, 1b at 16k and 32k, traced"
  within 120 python3 -m gtp_jax.bench context --preset 1b --remat full --mesh cp=2 \
    --seqs 16384,32768 --steps 3 --warmup 1 --timeout 110 --profile-dir "$OUT/cp_profile" \
    --json "$OUT/context_cp2.json" 2>&1 | grep -E "^\||^\[" | tail -8
fi
if [[ " ${ROWS:-1b user fp8 cp tp} " == *" tp "* ]]; then
  log "the ring collective matmul alone against its GEMM budget, tp2 (llama3-8b, 4 x 8192)"
  within 100 python3 -m gtp_jax.bench parallel --preset llama3-8b --seq 8192 --batch 4 \
    --remat dots --steps 8 --timeout 90 --tp 2 --micro --json "$OUT/tp2_micro.json" 2>&1 \
    | grep -E "^\||^\[" | tail -12
fi
rm -rf "$OUT/cc" "$OUT/cp_profile"
log done
