#!/usr/bin/env bash
# XLA's fusion autotuner on against off (--xla_gpu_experimental_enable_fusion_autotuner):
# compile time and step time on one GPU, and the compile of the 2-GPU llama3-8b step on
# compile-only devices. Writes runs/. Usage (repository root, one GPU):
#   bash docs/results/2026-12-07_1xH100_compile/run.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
out=${OUT:-docs/results/2026-12-07_1xH100_compile/runs}
mkdir -p "$out"
ON="--xla_gpu_experimental_enable_fusion_autotuner=true"
OFF="--xla_gpu_experimental_enable_fusion_autotuner=false"
trn() { local name=$1 flags=$2; shift 2
  XLA_FLAGS="$flags" python -m gtp_jax train --compile-cache off "$@" > "$out/$name.txt" 2>&1
  echo "$name: $(grep -hE 'step time|first step' "$out/$name.txt" | tr -s ' ' | tr '\n' ';')"; }
cmp() { local name=$1 flags=$2; shift 2
  XLA_FLAGS="$flags" python benchmarks/gpu_schedule.py --gpus 2 --seq 2048 "$@" > "$out/$name.txt" 2>&1
  echo "$name: $(grep -hE 'compiled in' "$out/$name.txt")"; }
for r in 1 2; do
  trn l8_on_$r "$ON" --preset llama3-8b --layers 8 --seq 2048 --batch 2 --steps 12
  trn l8_off_$r "$OFF" --preset llama3-8b --layers 8 --seq 2048 --batch 2 --steps 12
done
trn l16_on "$ON" --preset llama3-8b --layers 16 --seq 2048 --batch 2 --steps 12
trn l16_off "$OFF" --preset llama3-8b --layers 16 --seq 2048 --batch 2 --steps 12
trn fp8_on "$ON" --preset llama3-8b --layers 8 --seq 8192 --batch 1 --steps 8 --fp8-compute delayed
trn fp8_off "$OFF" --preset llama3-8b --layers 8 --seq 8192 --batch 1 --steps 8 --fp8-compute delayed
trn 1b_on "$ON" --preset 1b --seq 2048 --batch 4 --steps 12
trn 1b_off "$OFF" --preset 1b --seq 2048 --batch 4 --steps 12
for r in 1 2; do
  cmp c2_l32_on_$r "$ON" --layers 32
  cmp c2_l32_off_$r "$OFF" --layers 32
done
cmp c2_l32_off_mem "$OFF" --layers 32 --memory
