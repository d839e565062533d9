#!/usr/bin/env bash
# A user's own decoder on the layer loop (gtp_jax/bench/user_model.py: nnx.Linear attention
# and MLP, d 2048, 16 blocks, XLA attention, on gtp_jax.Stack) beside the bundled 1b decoder
# and compiled PyTorch FSDP2, seq 2048, 4 sequences per GPU.
#   PART=gpus  every GPU of the host, in one call: compute only, the bundled model (gtp,
#              gtp + prefetch), the user decoder (unwrapped, gtp, gtp + prefetch, XLA's
#              FSDP), both without remat and with XLA attention (like for like), and the
#              FSDP2 peer compiled and eager; traces of gtp and user_gtp, whose trimmed
#              excerpts notebooks/04_your_model.ipynb draws. Then with the user's remat
#              (recompute each block), on the stack and as the Python loop it was first
#              written as (each block under nnx.remat, weights gathered where they are read).
#   PART=one   one GPU, the user decoder unwrapped: on the stack and as the Python loop,
#              with and without remat (the stack must not slow the unwrapped model down).
# Writes $OUT/*.json, $OUT/*.log, $OUT/trace_{gtp,user_gtp}.json.gz.
# Usage (repository root): OUT=docs/results/<date>_2xH200/user_model [PART=gpus|one|all] \
#   bash benchmarks/user_model.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/user_model}; PART=${PART:-all}; mkdir -p "$OUT"
PROF=/tmp/gtp_jax_user_traces; rm -rf "$PROF" "$PROF.excerpts"; mkdir -p "$PROF.excerpts"
COMMON="--preset 1b --seq 2048 --per-device-batch 4 --steps 20 --warmup 3 --timeout 240"
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
run() {  # run NAME ARGS...: one `bench overlap` call, its table, its JSON and log in $OUT
  local name=$1; shift
  echo "== $name"
  python3 -m gtp_jax.bench overlap $COMMON "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  grep -v -i deprecat "$OUT/$name.log" | grep -E "^\[|^\||^device" | tail -20
}
if [ "$PART" = gpus ] || [ "$PART" = all ]; then
  run user_vs_bundled --attention xla --no-user-remat --torch \
    --variants compute_only,gtp,gtp_prefetch,user_unwrapped,user_gtp,user_gtp_prefetch,user_xla_fsdp \
    --profile-dir "$PROF" --profile-variants gtp,user_gtp
  python3 -m gtp_jax.bench.trace "$PROF" --each --steps 3 --excerpt-dir "$PROF.excerpts" \
    --excerpt-ms 160 > "$OUT/traces.log" 2>&1
  cp "$PROF.excerpts/trace_gtp_excerpt.json.gz" "$OUT/trace_gtp.json.gz"
  cp "$PROF.excerpts/trace_user_gtp_excerpt.json.gz" "$OUT/trace_user_gtp.json.gz"
  run user_remat_stack --variants user_gtp,user_xla_fsdp
  run user_remat_python_loop --user-loop python --variants user_gtp
fi
if [ "$PART" = one ] || [ "$PART" = all ]; then
  export CUDA_VISIBLE_DEVICES=0
  run one_gpu_stack --variants user_unwrapped
  run one_gpu_python_loop --user-loop python --variants user_unwrapped
  run one_gpu_stack_noremat --no-user-remat --variants user_unwrapped
  run one_gpu_python_loop_noremat --user-loop python --no-user-remat --variants user_unwrapped
fi
ls -la "$OUT"
