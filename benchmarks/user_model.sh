#!/usr/bin/env bash
# A user's own decoder on the layer loop (gtp_jax/bench/user_model.py: nnx.Linear attention
# and MLP, d 2048, 16 blocks, cuDNN attention through jax.nn.dot_product_attention, on
# gtp_jax.Stack) beside the bundled 1b decoder and compiled PyTorch FSDP2 (the same blocks,
# SDPA attention), seq 2048, 4 sequences per GPU.
#   PART=gpus  every GPU of the host, in one call: the bundled model with its defaults
#              (gtp_dots), the user decoder with the bundled remat policy (--user-remat dots:
#              unwrapped, gtp, gtp + prefetch, XLA's automatic FSDP) and the FSDP2 peer
#              compiled and eager, traces of gtp_dots and user_gtp (trimmed excerpts that
#              notebooks/04_your_model.ipynb draws); then with nnx.remat's default (recompute
#              each block: --user-remat full) on the stack and as the Python loop it was first
#              written as (each block under nnx.remat, weights gathered where they are read),
#              and without remat (as the peer runs).
#   PART=one   one GPU, the user decoder unwrapped: on the stack and as the Python loop,
#              remat full and dots (the stack must not slow the unwrapped model down).
# Writes $OUT/*.json, $OUT/*.log, $OUT/trace_{gtp,user_gtp}.json.gz.
# Usage (repository root): OUT=docs/results/<date>_2xH200/user_model [PART=gpus|one|all] \
#   bash benchmarks/user_model.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/user_model}; PART=${PART:-all}; mkdir -p "$OUT"
PROF=/tmp/gtp_jax_user_traces; rm -rf "$PROF" "$PROF.excerpts"; mkdir -p "$PROF.excerpts"
COMMON="--preset 1b --seq 2048 --per-device-batch 4 --steps 10 --warmup 3 --timeout 150"
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
run() {  # run NAME ARGS...: one `bench overlap` call, its table, its JSON and log in $OUT
  local name=$1; shift
  echo "== $name"
  python3 -m gtp_jax.bench overlap $COMMON "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  grep -v -i deprecat "$OUT/$name.log" | grep -E "^\[|^\||^device" | tail -20
}
if [ "$PART" = gpus ] || [ "$PART" = all ]; then
  run user_vs_bundled --user-remat dots --torch \
    --variants gtp_dots,user_unwrapped,user_gtp,user_gtp_prefetch,user_xla_fsdp \
    --profile-dir "$PROF" --profile-variants gtp_dots,user_gtp
  python3 -m gtp_jax.bench.trace "$PROF" --each --steps 3 --excerpt-dir "$PROF.excerpts" \
    --excerpt-ms 160 > "$OUT/traces.log" 2>&1
  cp "$PROF.excerpts/trace_gtp_dots_excerpt.json.gz" "$OUT/trace_gtp.json.gz"
  cp "$PROF.excerpts/trace_user_gtp_excerpt.json.gz" "$OUT/trace_user_gtp.json.gz"
  run user_remat_full_stack --variants user_gtp,user_xla_fsdp
  run user_remat_full_python_loop --user-loop python --variants user_gtp
  run user_no_remat --user-remat none --variants user_gtp
fi
if [ "$PART" = one ] || [ "$PART" = all ]; then
  export CUDA_VISIBLE_DEVICES=0
  run one_gpu_stack --variants user_unwrapped
  run one_gpu_python_loop --user-loop python --variants user_unwrapped
  run one_gpu_stack_dots --user-remat dots --variants user_unwrapped
  run one_gpu_python_loop_dots --user-loop python --user-remat dots --variants user_unwrapped
fi
ls -la "$OUT"
