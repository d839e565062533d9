#!/usr/bin/env bash
# llama3-8b side by side with compiled FSDP2 on 4 and 2 GPUs (remat dots for gtp_jax, no AC
# for the peer): the scanned loop with prefetch, float32 and bfloat16 reduce-scatters, the
# peer with its bfloat16 reduce-scatter too, and the unrolled default on 2 GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:-runs/final}; mkdir -p "$OUT"
T0=$(date +%s)
jx() {  # name, gpus, seq, bench options
  echo "== t=$(( $(date +%s) - T0 ))s $1"
  CUDA_VISIBLE_DEVICES=$2 timeout 200 python3 -m gtp_jax.bench overlap --preset llama3-8b --seq $3 \
    --per-device-batch 1 --steps 6 --warmup 2 --timeout 180 --compiled-memory $4 \
    --json $OUT/$1.json 2>&1 | grep -E "^\[|^\| gtp"
}
pt() {  # name, gpus, n, seq, env
  echo "== t=$(( $(date +%s) - T0 ))s $1"
  env CUDA_VISIBLE_DEVICES=$2 PRESET=llama3-8b SEQ=$4 MB=1 STEPS=6 COMPILE=1 $5 timeout 200 \
    torchrun --nproc_per_node=$3 benchmarks/torch_fsdp2.py 2>&1 | grep RESULT | sed 's/^RESULT //' > $OUT/$1.json
  cat $OUT/$1.json | cut -c1-300
}
jx g4_8192_scan_prefetch 0,1,2,3 8192 "--variants gtp_prefetch_dots --no-unroll-layers"
jx g4_8192_scan_prefetch_rsbf16 0,1,2,3 8192 "--variants gtp_prefetch_dots --no-unroll-layers --reduce-dtype bfloat16"
jx g4_2048_scan_prefetch_rsbf16 0,1,2,3 2048 "--variants gtp_prefetch_dots --no-unroll-layers --reduce-dtype bfloat16"
pt g4_2048_torch_rsbf16 0,1,2,3 4 2048 "REDUCE=bfloat16"
jx g2_2048_unrolled 0,1 2048 "--variants gtp_dots"
jx g2_2048_scan_prefetch 0,1 2048 "--variants gtp_prefetch_dots --no-unroll-layers"
pt g2_2048_torch 0,1 2 2048 ""
echo "== t=$(( $(date +%s) - T0 ))s done"
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    try:
        rows = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "no result", e); continue
    for r in rows if isinstance(rows, list) else [rows]:
        print(f"{os.path.basename(f):34s} {r['devices']} GPUs step {r['step_ms']:.1f} ms  MFU {100*r['mfu']:.1f}%  "
              f"peak {r['peak_mem_gib']:.2f} GiB  compiled {r.get('compiled_peak_gib') or 0:.2f}  "
              f"first step {r.get('first_step_s', 0):.0f} s")
PY
