#!/usr/bin/env bash
# Every run of this directory: 50 steps of 2 x 2048 tokens on one GPU, each preset's default
# warm-up (a flag given: --warmup 20), the peak LR named in the file's name. Writes runs/.
# Usage (from the repository root): bash docs/results/2026-12-07_1xH100_lr/run.sh
set -u
export NCCL_NVLS_ENABLE=0
out=${OUT:-docs/results/2026-12-07_1xH100_lr/runs}
mkdir -p "$out"
trn() { local name=$1; shift
  python -m gtp_jax train --seq 2048 --batch 2 --steps 50 --compile-cache off --log-every 1 \
      "$@" > "$out/$name.txt" 2>&1; }
for lr in 1e-4 7.5e-5 3e-5; do trn llama3-8b_8L_lr$lr --preset llama3-8b --layers 8 --lr $lr; done
trn llama3-8b_8L_lr1.5e-4_warmup20 --preset llama3-8b --layers 8 --lr 1.5e-4 --warmup 20
trn llama3-8b_8L_lr7.5e-5_warmup20 --preset llama3-8b --layers 8 --lr 7.5e-5 --warmup 20
for lr in 1.5e-4 3e-5 2e-5 1.5e-5 1e-5; do
  trn llama3-8b_16L_lr$lr --preset llama3-8b --layers 16 --lr $lr; done
for lr in 1.5e-4 6e-5 3e-5; do trn llama3.2-3b_8L_lr$lr --preset llama3.2-3b --layers 8 --lr $lr; done
for lr in 7.5e-5 3e-5 1.5e-5; do trn llama3-70b_2L_lr$lr --preset llama3-70b --layers 2 --lr $lr; done
for lr in 3e-4 1e-4 6e-5 3e-5; do trn 1b_16L_lr$lr --preset 1b --lr $lr; done
trn llama3.2-1b_16L_lr3e-4 --preset llama3.2-1b --lr 3e-4
for lr in 6e-4 3e-4; do trn 100m_12L_lr$lr --preset 100m --lr $lr; done
trn small_6L_lr1e-3 --preset small --lr 1e-3
python docs/results/2026-12-07_1xH100_lr/table.py
