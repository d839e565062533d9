#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# The 1b training step on ONE GPU, side by side in one call (seq 2048, 4 sequences, bf16):
#   part "model": `bench overlap` compute-only and gtp_jax at gtp=1 (remat dots and none:
#                 the wrapper's own cost where it has nothing to communicate, and whether
#                 cuDNN attention compiles under each remat policy), then the PyTorch peer
#                 compiled and eager; kernel breakdowns (`python -m gtp_jax.bench.kernels`,
#                 kernels_*.md) of the JAX steps, each from a short traced run with its
#                 optimized HLO (so fusions are named with shape and source), and of the
#                 compiled PyTorch step.
#   part "user":  a user's own decoder (python loop of blocks, nnx.remat per block; see
#                 gtp_jax/bench/user_model.py) unwrapped and under gtp_jax.shard, with and
#                 without the user's remat.
# Usage: OUT=dir PART=model|user|all bash docs/results/2026-11-23_1xH200/step_1gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/step_1gpu}; PART=${PART:-all}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof; rm -rf "$PROF"; mkdir -p "$PROF"
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
COMMON="--preset 1b --seq 2048 --per-device-batch 4 --steps 20 --warmup 3 --timeout 240"
filter() { grep -v -i deprecat | grep -E "^\[|^\||^device|error|Error" | tail -20; }

if [ "$PART" = model ] || [ "$PART" = all ]; then
  log "bench overlap (JAX)"
  python3 -m gtp_jax.bench overlap $COMMON \
    --variants compute_only_dots,gtp_dots,gtp --json "$OUT/overlap_1b.json" 2>&1 | filter
  for c in 1 0; do
    log "torch FSDP2 COMPILE=$c"
    trace=""; [ "$c" = 1 ] && trace="$PROF/torch_compiled.json"
    COMPILE=$c PROFILE=$trace PRESET=1b SEQ=2048 MB=4 STEPS=20 timeout 300 \
      torchrun --nproc_per_node=1 benchmarks/torch_fsdp2.py 2>&1 | grep -E "^RESULT|Error" \
      | tee -a "$OUT/torch_1b.jsonl"
  done
  GEMM_TFLOP=$(python3 -c "
from gtp_jax.models import preset
c = preset('1b'); L, d, f, v = c.n_layers, c.d_model, c.d_ff, c.vocab_size
print(6 * (L * (4 * d * d + 3 * d * f) + v * d) * 4 * 2048 / 1e12)")
  for name in compute_only_dots gtp_dots; do
    # a short traced run with the optimized HLO dumped, so each kernel is named with its
    # shape and the JAX operation it came from
    log "kernels $name"
    dump="$PROF/hlo_$name"; mkdir -p "$dump"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
      python3 -m gtp_jax.bench overlap $COMMON --steps 5 --variants "$name" \
      --profile-dir "$PROF" --profile-variants "$name" 2>&1 | filter
    python3 -m gtp_jax.bench.kernels "$PROF/$name" --steps 3 --gemm-tflop "$GEMM_TFLOP" \
      --top 40 --hlo "$dump" --json "$OUT/kernels_${name}.json" > "$OUT/kernels_${name}.md"
    head -24 "$OUT/kernels_${name}.md"
  done
  if [ -f "$PROF/torch_compiled.json" ]; then
    log "kernels torch compiled"
    python3 -m gtp_jax.bench.kernels "$PROF/torch_compiled.json" --steps 3 \
      --gemm-tflop "$GEMM_TFLOP" --top 40 --json "$OUT/kernels_torch_compiled.json" \
      > "$OUT/kernels_torch_compiled.md"
    head -24 "$OUT/kernels_torch_compiled.md"
  fi
fi

if [ "$PART" = user ] || [ "$PART" = all ]; then
  log "user model, with its remat"
  python3 -m gtp_jax.bench overlap $COMMON --variants user_unwrapped,user_gtp \
    --json "$OUT/user_remat.json" 2>&1 | filter
  log "user model, without remat"
  python3 -m gtp_jax.bench overlap $COMMON --variants user_unwrapped,user_gtp --no-user-remat \
    --json "$OUT/user_noremat.json" 2>&1 | filter
fi
log done
