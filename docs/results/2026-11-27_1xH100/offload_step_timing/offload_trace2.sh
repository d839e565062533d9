set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT}; mkdir -p "$OUT"; nvidia-smi -L > "$OUT/gpus.txt"
for c in "1b --seq 2048 --batch 4 --remat dots" "llama3-8b --layers 8 --seq 4096 --batch 1 --remat full"; do
  name=$(echo $c | cut -d' ' -f1)
  timeout 150 python3 -m gtp_jax train --steps 8 --gtp 1 --dp 1 --preset $c --no-unroll-layers \
    --offload-optimizer --profile-dir /tmp/tr_$name --profile-steps 5:7 > "$OUT/train_$name.log" 2>&1
  grep "step time" "$OUT/train_$name.log"
  python3 docs/results/2026-11-27_1xH100/offload_step_timing/kernel_counts.py /tmp/tr_$name 3 2>&1 | tee "$OUT/counts_$name.log"
done
