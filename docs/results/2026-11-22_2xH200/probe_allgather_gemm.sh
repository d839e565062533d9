#!/usr/bin/env bash
# Kept beside the results it produced (this folder); run it from the repository root.
# How much of an all-gather XLA hides beside an independent GEMM chain, on all GPUs of the
# host (docs/results/2026-11-22_2xH200/overlap_probe.py), in four launch modes: one process with default XLA
# flags, one process with the latency-hiding scheduler, one process with the flags that
# `import gtp_jax` sets, and one process per GPU. Also prints all-gather and reduce-scatter
# bus bandwidth. Writes $OUT/probe_allgather_gemm.log (default OUT=runs).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-runs}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
NGPU=$(nvidia-smi -L | wc -l)
{
  PROBE_LABEL=single_process timeout 120 python3 docs/results/2026-11-22_2xH200/overlap_probe.py
  PROBE_LABEL=single_process_lhs XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" \
    timeout 120 python3 docs/results/2026-11-22_2xH200/overlap_probe.py
  PROBE_LABEL=single_process_gtp_jax_flags timeout 120 python3 -c \
    "import gtp_jax, runpy; runpy.run_path('docs/results/2026-11-22_2xH200/overlap_probe.py', run_name='__main__')"
  PROBE_LABEL=one_process_per_gpu PROBE_NPROC=$NGPU timeout 150 python3 docs/results/2026-11-22_2xH200/overlap_probe.py
} 2>&1 | tee "$OUT/probe_allgather_gemm.log" | grep -E "^PROBE|Error|error" | cut -c1-400
