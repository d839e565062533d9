#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# The 1b step on all GPUs of the host (gtp = number of GPUs, remat dots, seq 2048, 4 sequences
# per GPU), short and in one call: gtp_jax with scanned layers (without and with prefetch),
# with unrolled layers (TransformerConfig.unroll_layers), and the torch.compile'd PyTorch
# FSDP2 peer; then the unrolled step with the embedding and head re-gathered in the backward
# pass (GTPConfig.remat_gathered, the default) and the one-GPU compute-only unrolled step.
# Writes $OUT/step_2gpu_scanned.json, step_2gpu_unrolled.json, torch_2gpu.jsonl,
# step_2gpu_unrolled_remat_gathered.json (named for the 2-GPU host it was written for).
# Usage: OUT=dir bash docs/results/2026-11-23_2xH200/step_scanned_unrolled_torch.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/step_scanned_unrolled_torch}; mkdir -p "$OUT"
A="--preset 1b --seq 2048 --per-device-batch 4 --steps 20 --warmup 2 --timeout 110"
NGPU=$(nvidia-smi -L | wc -l)
python3 -m gtp_jax.bench overlap $A --no-remat-gathered --no-unroll-layers \
  --variants gtp_dots,gtp_prefetch_dots \
  --json "$OUT/step_2gpu_scanned.json" 2>&1 | grep -E '^\[|Error'
python3 -m gtp_jax.bench overlap $A --no-remat-gathered --unroll-layers --variants gtp_dots \
  --json "$OUT/step_2gpu_unrolled.json" 2>&1 | grep -E '^\[|Error'
COMPILE=1 PRESET=1b SEQ=2048 MB=4 STEPS=20 timeout 100 \
  torchrun --nproc_per_node="$NGPU" benchmarks/torch_fsdp2.py 2>&1 \
  | grep -E '^RESULT|Error' | tee "$OUT/torch_2gpu.jsonl"
python3 -m gtp_jax.bench overlap $A --unroll-layers --variants gtp_dots,compute_only_dots \
  --json "$OUT/step_2gpu_unrolled_remat_gathered.json" 2>&1 | grep -E '^\[|Error'
