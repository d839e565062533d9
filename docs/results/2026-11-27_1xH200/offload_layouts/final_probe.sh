export NCCL_NVLS_ENABLE=0
T0=$(date +%s)
one() {  # name, limit ('' = default), code path, flags...
  local name=$1 lim=$2 path=$3; shift 3
  local xf=""; [ -n "$lim" ] && xf="--xla_gpu_experimental_parallel_async_compute_limit=$lim"
  echo "== t=$(( $(date +%s) - T0 ))s $name limit=${lim:-default} code=$path"
  XLA_FLAGS="$xf" PYTHONPATH=$path timeout 200 python3 -m gtp_jax train --gtp 1 --dp 1 "$@" --offload-optimizer > $OUT/$name.log 2>&1
  grep -E "step time|memory per device:|rror" $OUT/$name.log | head -3
}
one small_lim16 16 $PWD --preset 1b --seq 2048 --batch 4 --steps 8
one eight_lim8 8 $PWD --preset llama3-8b --layers 8 --seq 4096 --batch 1 --steps 8 --remat full
one big_stacked "" $PWD/.carry/base --preset llama3-8b --seq 4096 --batch 1 --steps 5 --remat full --no-unroll-layers
one big_grouped_lim8 8 $PWD --preset llama3-8b --seq 4096 --batch 1 --steps 5 --remat full --no-unroll-layers
