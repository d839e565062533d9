#!/usr/bin/env bash
# One device-machine call: overlap probes (launch modes, flags), then the model benchmark
# side by side with the PyTorch FSDP2 peer. Writes logs and JSON under $OUT (or ./runs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-runs}; mkdir -p "$OUT"
STAGES=${STAGES:-probe,model}
nvidia-smi -L; python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
NGPU=$(nvidia-smi -L | wc -l)
if [[ $STAGES == *probe* ]]; then
  for case in default lhs multiproc; do
    case $case in
      default) env PROBE_LABEL=single_process timeout 120 python3 benchmarks/overlap_probe.py ;;
      lhs) env PROBE_LABEL=single_process_lhs XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" timeout 120 python3 benchmarks/overlap_probe.py ;;
      multiproc) env PROBE_LABEL=one_process_per_gpu PROBE_NPROC=$NGPU timeout 150 python3 benchmarks/overlap_probe.py ;;
    esac
  done 2>&1 | tee "$OUT/probe.log" | grep -E "^PROBE|Error|error" | cut -c1-400
fi
if [[ $STAGES == *model* ]]; then
  timeout ${MODEL_TIMEOUT:-420} python3 -m gtp_jax.bench overlap --preset ${PRESET:-1b} \
    --steps ${STEPS:-20} --warmup 2 --per-device-batch ${MB:-4} --timeout ${VARIANT_TIMEOUT:-110} \
    --variants ${VARIANTS:-compute_only,replicated,xla_fsdp,gtp,gtp_prefetch} ${TORCH:---torch} \
    --json "$OUT/overlap.json" ${EXTRA:-} 2>&1 | tee "$OUT/model.log" | grep -v -i deprecat | tail -40
fi
