export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
for lim in "" 4 8; do
  flags=""; [ -n "$lim" ] && flags="--xla_gpu_experimental_parallel_async_compute_limit=$lim"
  echo "== limit ${lim:-default}"
  XLA_FLAGS="$flags" timeout 150 python3 -m gtp_jax train --preset 1b --seq 2048 --batch 4 --steps 8 --gtp 1 --dp 1 --offload-optimizer > $OUT/small_lim${lim:-d}.log 2>&1
  grep -E "step time|memory per device:|Error|rror" $OUT/small_lim${lim:-d}.log | head -3
done
for lim in 4; do
  echo "== eight, limit $lim"
  XLA_FLAGS="--xla_gpu_experimental_parallel_async_compute_limit=$lim" timeout 150 python3 -m gtp_jax train --gtp 1 --dp 1 --preset llama3-8b --layers 8 --seq 4096 --batch 1 --steps 8 --remat full --offload-optimizer > $OUT/eight_lim$lim.log 2>&1
  grep -E "step time|memory per device:|rror" $OUT/eight_lim$lim.log | head -3
done
XLA_FLAGS="--xla_gpu_experimental_parallel_async_compute_limit=4" python3 .carry/sched_probe.py 1b 2>&1 | grep -v "^W\|^I0" | tail -4 | cut -c1-1500
