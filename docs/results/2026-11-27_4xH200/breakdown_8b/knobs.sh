#!/usr/bin/env bash
# llama3-8b, 2048 tokens per GPU, 4 GPUs, remat dots: gtp_jax's step under settings that
# change how its collectives overlap compute, each traced (exposed collective time in its
# JSON); the first one's trace excerpt (one step, every device) and optimized HLO come back.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/knobs}; mkdir -p "$OUT"; W=/tmp/knobs; rm -rf $W; mkdir -p $W
BASE="--preset llama3-8b --seq 2048 --per-device-batch 1 --steps 6 --warmup 2 --variants gtp_dots --profile-variants gtp_dots --timeout 200"
run() {  # name, extra XLA flags, extra bench options
  echo "== $1"
  XLA_FLAGS="${XLA_FLAGS:-} $2" timeout 260 python3 -m gtp_jax.bench overlap $BASE $3 \
    --profile-dir $W/$1 --json $OUT/$1.json 2>&1 | grep -E "^\[|^\| gtp"
}
run base "--xla_dump_to=$W/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=.*step.*" ""
python3 -m gtp_jax.bench.trace $W/base --each --excerpt-dir $W/excerpt --excerpt-ms 330 > $OUT/base_trace.log 2>&1
cp $W/excerpt/*.json.gz $OUT/base_excerpt.json.gz 2>/dev/null
gzip -c $(ls -S $W/dump/*after_optimizations.txt | head -1) > $OUT/base_hlo.txt.gz
run pcol2 "--xla_gpu_experimental_parallel_collective_overlap_limit=2" ""
run rs_bf16 "" "--reduce-dtype bfloat16"
run no_cmdbuf "--xla_gpu_enable_command_buffer=" ""
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for r in json.load(open(f)):
        t = r.get("trace") or {}
        print(f"{os.path.basename(f):16s} step {r['step_ms']:.1f} ms  first step {r['first_step_s']:.0f} s  "
              f"peak {r['peak_mem_gib']:.2f} GiB  comm {t.get('comm_ms', 0):.1f}  exposed {t.get('exposed_ms', 0):.1f} ms")
PY
