#!/usr/bin/env bash
# llama3-8b, 2048 tokens per GPU, 4 GPUs, remat dots: gtp_jax's step with XLA's collective
# combiners allowed to merge one layer's gathers (and gradient reduce-scatters) into one
# collective, with float32 and bfloat16 reduce-scatters; the first run's trace excerpt (one
# step, every device) comes back.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/combine}; mkdir -p "$OUT"; W=/tmp/combine; rm -rf $W; mkdir -p $W/excerpt
BASE="--preset llama3-8b --seq 2048 --per-device-batch 1 --steps 6 --warmup 2 --variants gtp_dots --profile-variants gtp_dots --timeout 200"
COMBINE="--xla_gpu_all_gather_combine_threshold_bytes=1073741824 --xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824"
run() {  # name, extra XLA flags, extra bench options
  echo "== $1"
  XLA_FLAGS="${XLA_FLAGS:-} $2" timeout 260 python3 -m gtp_jax.bench overlap $BASE $3 \
    --profile-dir $W/$1 --json $OUT/$1.json 2>&1 | grep -E "^\[|^\| gtp"
}
run combine "$COMBINE --xla_dump_to=$W/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=.*step.*" ""
python3 -m gtp_jax.bench.trace $W/combine --each --excerpt-dir $W/excerpt --excerpt-ms 320 > $OUT/combine_trace.log 2>&1
cp $W/excerpt/*.json.gz $OUT/combine_excerpt.json.gz
gzip -c $(ls -S $W/dump/*after_optimizations.txt | head -1) > $OUT/combine_hlo.txt.gz
run combine_rs_bf16 "$COMBINE" "--reduce-dtype bfloat16"
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for r in json.load(open(f)):
        t = r.get("trace") or {}
        print(f"{os.path.basename(f):22s} step {r['step_ms']:.1f} ms  first step {r['first_step_s']:.0f} s  "
              f"peak {r['peak_mem_gib']:.2f} GiB  comm {t.get('comm_ms', 0):.1f}  exposed {t.get('exposed_ms', 0):.1f} ms")
PY
