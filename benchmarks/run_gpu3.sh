#!/usr/bin/env bash
# Model benchmark with cuDNN attention (the gtp variants run with remat_gathered=False:
# jax.checkpoint around cuDNN attention inside shard_map crashes XLA's compiler on jax 0.11.2).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
timeout 570 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 --per-device-batch 4 \
  --timeout 110 --attention cudnn --no-remat-gathered \
  --variants ${VARIANTS:-compute_only,replicated,xla_fsdp,gtp,gtp_prefetch,gtp_prefetch_dots} \
  --torch --json "$OUT/overlap.json" 2>&1 | tee "$OUT/model.log" | grep -v -i deprecat | tail -16
