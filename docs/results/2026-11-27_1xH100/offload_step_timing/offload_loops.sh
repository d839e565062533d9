#!/usr/bin/env bash
# The offloaded step's host copies under the unrolled and the scanned layer loop, one machine:
# the 1b preset (seq 2048, 4 sequences, remat dots) on the device and offloaded, both loops,
# the offloaded runs traced (kernel time by kernel), then 8 llama3-8b layers at seq 4096,
# remat full, offloaded, both loops.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/offload_loops}; mkdir -p "$OUT"
nvidia-smi -L > "$OUT/gpus.txt"
run() {  # name, then train flags
  local name=$1; shift
  echo "== $name: $*"
  timeout 150 python3 -m gtp_jax train --steps 10 --gtp 1 --dp 1 "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "step time|memory per device|Error|out of memory" "$OUT/$name.log" | head -4
}
for loop in unroll-layers no-unroll-layers; do
  run "1b_device_$loop" --preset 1b --seq 2048 --batch 4 --$loop --no-offload-optimizer
  run "1b_offload_$loop" --preset 1b --seq 2048 --batch 4 --$loop --offload-optimizer \
    --profile-dir "$OUT/trace_$loop" --profile-steps 6:8
  python3 -m gtp_jax.bench.kernels "$OUT/trace_$loop" --steps 3 --top 30 \
    > "$OUT/kernels_1b_offload_$loop.log" 2>&1
  head -40 "$OUT/kernels_1b_offload_$loop.log"
  rm -rf "$OUT/trace_$loop"
done
for loop in no-unroll-layers unroll-layers; do
  run "8b8_offload_$loop" --preset llama3-8b --layers 8 --seq 4096 --batch 1 --remat full \
    --$loop --offload-optimizer
  run "8b8_device_$loop" --preset llama3-8b --layers 8 --seq 4096 --batch 1 --remat full \
    --$loop --no-offload-optimizer
done
cd "$OUT" && tar czf all.tgz *.log gpus.txt
