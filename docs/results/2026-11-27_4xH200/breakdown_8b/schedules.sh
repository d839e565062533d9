#!/usr/bin/env bash
# llama3-8b, 2048 tokens per GPU, 4 GPUs, remat dots: gtp_jax's step under collective
# schedules: one combined collective per layer with two collectives in flight (float32 and
# bfloat16 reduce-scatters), and the scanned loop with double-buffered prefetch.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/schedules}; mkdir -p "$OUT"; W=/tmp/schedules; rm -rf $W; mkdir -p $W
BASE="--preset llama3-8b --seq 2048 --per-device-batch 1 --steps 6 --warmup 2 --profile-variants gtp_dots,gtp_prefetch_dots --timeout 200"
COMBINE="--xla_gpu_all_gather_combine_threshold_bytes=1073741824 --xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824"
run() {  # name, extra XLA flags, bench options
  echo "== $1"
  XLA_FLAGS="${XLA_FLAGS:-} $2" timeout 240 python3 -m gtp_jax.bench overlap $BASE $3 \
    --profile-dir $W/$1 --json $OUT/$1.json 2>&1 | grep -E "^\[|^\| gtp"
}
run combine_pcol2 "$COMBINE --xla_gpu_experimental_parallel_collective_overlap_limit=2" "--variants gtp_dots"
run combine_pcol2_rs_bf16 "$COMBINE --xla_gpu_experimental_parallel_collective_overlap_limit=2" "--variants gtp_dots --reduce-dtype bfloat16"
run scanned_prefetch "" "--variants gtp_prefetch_dots --no-unroll-layers"
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for r in json.load(open(f)):
        t = r.get("trace") or {}
        print(f"{os.path.basename(f):26s} step {r['step_ms']:.1f} ms  first step {r['first_step_s']:.0f} s  "
              f"peak {r['peak_mem_gib']:.2f} GiB  comm {t.get('comm_ms', 0):.1f}  exposed {t.get('exposed_ms', 0):.1f} ms")
PY
