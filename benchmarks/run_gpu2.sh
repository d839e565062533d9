#!/usr/bin/env bash
# Second campaign: diagnose the cuDNN-attention compile crash under shard_map, then the model
# benchmark with gtp_jax's default flags, picking the attention that compiles for all variants.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
w() { timeout 90 python3 -X faulthandler -m gtp_jax.bench overlap --worker "$@" --preset 1b --layers 2 --steps 3 --warmup 1 2>&1 | grep -E "^RESULT|Fatal" | cut -c1-200; }
echo "== diag: gtp cudnn no-remat-gathered"; w gtp --attention cudnn --no-remat-gathered | tee "$OUT/diag1.txt"
echo "== diag: replicated cudnn remat=full (checkpoint, no shard_map)"; w replicated --attention cudnn --remat full
echo "== diag: gtp_prefetch cudnn no-remat-gathered"; w gtp_prefetch --attention cudnn --no-remat-gathered | tee "$OUT/diag2.txt"
ATT=xla; NRG=""
if grep -q RESULT "$OUT/diag1.txt" && grep -q RESULT "$OUT/diag2.txt"; then ATT=cudnn; NRG=--no-remat-gathered; fi
echo "== model benchmark: attention=$ATT $NRG"
timeout 400 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 --per-device-batch 4 \
  --timeout 100 --attention $ATT $NRG --torch --json "$OUT/overlap.json" 2>&1 | tee "$OUT/model.log" | grep -v -i deprecat | tail -14
