#!/usr/bin/env bash
# All variants with remat="dots" (the setting gtp_jax's cuDNN runs need on jax 0.11.2), plus
# all-gather / reduce-scatter bandwidth from the probe.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
PROBE_LABEL=single_process_default_flags timeout 100 python3 -c "import gtp_jax, runpy; runpy.run_path('benchmarks/overlap_probe.py', run_name='__main__')" 2>&1 | grep PROBE | tee "$OUT/probe.log"
timeout 480 python3 -m gtp_jax.bench overlap --preset 1b --steps 20 --warmup 2 --per-device-batch 4 \
  --timeout 100 --attention cudnn --no-remat-gathered \
  --variants compute_only_dots,replicated_dots,xla_fsdp_dots,gtp_dots,gtp_prefetch_dots \
  --json "$OUT/overlap_dots.json" 2>&1 | tee "$OUT/model.log" | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -16
