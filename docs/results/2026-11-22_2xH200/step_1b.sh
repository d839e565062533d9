#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# Training step of the 0.95B decoder on all GPUs of the host (gtp = number of GPUs): compute
# only, replicated weights, XLA automatic FSDP, gtp_jax without and with prefetch, and the
# PyTorch FSDP2 peer, in one invocation. A profiler trace of each sharded variant is read per
# stream (hidden vs exposed communication); trimmed excerpts of the gtp_jax traces are kept
# for notebooks/02_overlap.ipynb.
# The first run scans the blocks (--no-unroll-layers: the loop where prefetch is a choice).
# Writes $OUT/step_1b.json, $OUT/trace_step_1b_gtp{,_prefetch}.json.gz (default OUT=runs),
# then compute only and gtp_jax with the blocks unrolled (TransformerConfig.unroll_layers,
# the default; gathers run one layer ahead) in $OUT/step_1b_unrolled.json.
# EXPERIMENTS=1 adds two single-variant runs of gtp_jax + prefetch: the gradient
# reduce-scatter in bf16 ($OUT/step_1b_reduce_bf16.json) and NCCL limited to 8 channels
# ($OUT/step_1b_nccl8.json).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof; rm -rf "$PROF" "$PROF.excerpts"
COMMON="--preset 1b --steps 20 --warmup 2 --per-device-batch 4 --timeout 110 --attention cudnn --no-remat-gathered"
timeout 540 python3 -m gtp_jax.bench overlap $COMMON --no-unroll-layers --torch \
  --variants compute_only_dots,replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --profile-dir "$PROF" --profile-variants replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --json "$OUT/step_1b.json" 2>&1 | tee "$OUT/step_1b.log" | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -20
mkdir -p "$PROF.excerpts"
python3 -m gtp_jax.bench.trace "$PROF" --each --steps 3 --excerpt-dir "$PROF.excerpts" --excerpt-ms 160
cp "$PROF.excerpts/trace_gtp_dots_excerpt.json.gz" "$OUT/trace_step_1b_gtp.json.gz"
cp "$PROF.excerpts/trace_gtp_prefetch_dots_excerpt.json.gz" "$OUT/trace_step_1b_gtp_prefetch.json.gz"
timeout 300 python3 -m gtp_jax.bench overlap $COMMON --unroll-layers \
  --variants compute_only_dots,gtp_dots --json "$OUT/step_1b_unrolled.json" 2>&1 \
  | grep -E "^\[" | sed 's/^/unrolled: /'
if [ "${EXPERIMENTS:-0}" = 1 ]; then
  timeout 120 python3 -m gtp_jax.bench overlap $COMMON --variants gtp_prefetch_dots --reduce-dtype bfloat16 \
    --json "$OUT/step_1b_reduce_bf16.json" 2>&1 | grep -E "^\| gtp" | sed 's/^/reduce bf16: /'
  NCCL_MAX_NCHANNELS=8 timeout 120 python3 -m gtp_jax.bench overlap $COMMON --variants gtp_prefetch_dots \
    --json "$OUT/step_1b_nccl8.json" 2>&1 | grep -E "^\| gtp" | sed 's/^/nccl 8 channels: /'
fi
ls -la "$OUT"
