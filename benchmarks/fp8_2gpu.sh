#!/usr/bin/env bash
# FP8 training on all GPUs of one host (written for 2), side by side in one call: gtp_jax's
# step (bench overlap, gtp = number of GPUs, remat dots) in bf16 and with FP8 compute
# (delayed and tensorwise), fed by FP8 weight gathers and by bf16 gathers, against PyTorch FSDP2 + torch.compile in
# bf16 and with torchao float8 training and float8 all-gather (benchmarks/torch_fsdp2.py
# FLOAT8=1; torchao's wheel carried in .carry/whl), for the 1b preset (seq 2048, 4 sequences per
# GPU) and the llama3-8b shape (seq 4096, 1 sequence per GPU, 8 layers, remat REMAT_8B:
# default dots; the torch rows recompute nothing).
# Writes $OUT/<model>_gtp_<gather>_<compute>.json and $OUT/<model>_torch.jsonl; prints the rows as they finish.
# Usage: OUT=dir [MODELS="1b 8b"] [VARIANTS="none:none,fp8:delayed,..."] [PEERS=0: no torch rows]
#   bash benchmarks/fp8_2gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/fp8_2gpu}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
if ls .carry/whl/torchao-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao_site \
    .carry/whl/torchao-*.whl
fi
for model in ${MODELS:-1b 8b}; do
  if [ "$model" = 1b ]; then
    A="--preset 1b --seq 2048 --per-device-batch 4"; V=gtp_dots; T="PRESET=1b SEQ=2048 MB=4"
  else
    A="--preset llama3-8b --layers 8 --seq 4096 --per-device-batch 1 --remat ${REMAT_8B:-dots}"
    V=gtp
    T="PRESET=llama3-8b LAYERS=8 SEQ=4096 MB=1"
  fi
  A="$A --steps 15 --warmup 3 --timeout ${TIMEOUT:-240} --unroll-layers"
  VARIANTS=${VARIANTS:-none:none,none:delayed,fp8:delayed,none:tensorwise,fp8:tensorwise}
  for v in ${VARIANTS//,/ }; do
    set -- ${v//:/ }
    python3 -m gtp_jax.bench overlap $A --variants "$V" --gather-format "$1" \
      --fp8-compute "$2" --json "$OUT/${model}_gtp_$1_$2.json" 2>&1 | grep -E '^\[|Error'
  done
  [ "${PEERS:-1}" = 0 ] && continue
  for f8 in 0 1; do
    env $T COMPILE=1 FLOAT8=$f8 STEPS=15 PYTHONPATH="/tmp/torchao_site:$PWD" timeout 200 \
      torchrun --nproc_per_node="$NGPU" benchmarks/torch_fsdp2.py 2>&1 \
      | grep -E '^RESULT|Error' | tee -a "$OUT/${model}_torch.jsonl"
  done
done
