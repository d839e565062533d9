#!/usr/bin/env bash
# Issue 3 campaign, one call: the 1B step side by side (JAX variants + PyTorch FSDP2), with a
# profiler trace of each sharded variant read per stream (hidden vs exposed communication),
# and a trimmed trace excerpt kept for docs/ and notebooks/02_overlap.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof; rm -rf "$PROF"
timeout 540 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 \
  --per-device-batch 4 --timeout 110 --attention cudnn --no-remat-gathered --torch \
  --variants compute_only_dots,replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --profile-dir "$PROF" --profile-variants replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --json "$OUT/overlap.json" 2>&1 | tee "$OUT/model.log" | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -20
python3 -m gtp_jax.bench.trace "$PROF" --each --steps 3 --excerpt-dir "$OUT" --excerpt-ms 160
# Two single-variant experiments: bf16 gradient reduce-scatter, and fewer NCCL channels (SMs
# taken from the overlapped GEMMs).
COMMON="--preset 1b --steps 20 --warmup 2 --per-device-batch 4 --timeout 110 --attention cudnn --no-remat-gathered"
timeout 120 python3 -m gtp_jax.bench overlap $COMMON --variants gtp_prefetch_dots --reduce-dtype bfloat16 \
  --json "$OUT/overlap_reduce_bf16.json" 2>&1 | grep -E "^\| gtp" | sed 's/^/reduce bf16: /'
NCCL_MAX_NCHANNELS=8 timeout 120 python3 -m gtp_jax.bench overlap $COMMON --variants gtp_prefetch_dots \
  --json "$OUT/overlap_nccl8.json" 2>&1 | grep -E "^\| gtp" | sed 's/^/nccl 8 channels: /'
ls -la "$OUT"
