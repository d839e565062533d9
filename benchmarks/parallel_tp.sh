#!/usr/bin/env bash
# Tensor + sequence parallelism on the GPUs of the host (written for 2; any even count works),
# in one invocation:
#  (1) collective matmul alone (`bench parallel --micro`) at the 1B preset's sizes: local GEMM
#      budget vs all-gather+GEMM and GEMM+reduce-scatter, plain / ppermute ring / XLA windowed
#      einsum, forward and forward+backward, with a profiler trace of each read per stream;
#      the ring traces' kernel sequence is printed: $OUT/parallel_micro_1b.json
#      (SKIP_MICRO=1 skips it);
#  (2) training steps (1B preset, 8 layers) no TP / TP+SP / TP+SP with ring collective
#      matmuls (MODEL_VARIANTS, e.g. add no_tp_moe,tp_overlap_moe for the MoE rows), traces of
#      TP and TP+overlap: $OUT/parallel_1b.json and $OUT/trace_parallel_1b_<variant>.json.gz;
#      REPEAT_VARIANTS=a,b runs those rows once more: $OUT/parallel_1b_repeat.json;
#  (3) a multi-process GPU run: one process per GPU, started as `mpirun` would start it
#      (Open MPI's variables) with `--distributed-auto`, against one process on all GPUs:
#      $OUT/multiprocess_2x1gpu.json and $OUT/multiprocess_reference_1x2gpu.json
#      (SKIP_MP=1 skips it);
#  (4) with TUNING=1: the ring and plain variants again under NCCL_PROTO=Simple, and
#      TP+overlap with XLA's dynamic-slice fusion.
# Default OUT=runs.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs}; mkdir -p "$OUT"
PROF=/tmp/gtp_prof; DUMP=/tmp/gtp_hlo; rm -rf "$PROF" "$DUMP"
MODEL_VARIANTS=${MODEL_VARIANTS:-no_tp,tp,tp_overlap}
MICRO_VARIANTS=${MICRO_VARIANTS:-gemm_only,ag_gemm,ag_gemm_ring,ag_gemm_xla,gemm_rs,gemm_rs_ring,gemm_rs_xla}
NGPU=$(nvidia-smi -L | wc -l)
TPFLAG=${TP:+--tp $TP}  # default: bench parallel's choice (n / 2 for n >= 4, else n)
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }

if [ "${SKIP_MICRO:-0}" != 1 ]; then
log "micro"
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$DUMP --xla_dump_hlo_as_text" \
timeout 190 python3 -m gtp_jax.bench parallel --micro $TPFLAG --preset 1b --seq 2048 --batch 4 \
  --steps 30 --warmup 3 --timeout 60 --variants "$MICRO_VARIANTS" \
  --profile-dir "$PROF" --profile-variants ag_gemm,ag_gemm_ring,ag_gemm_xla,gemm_rs,gemm_rs_ring,gemm_rs_xla \
  --json "$OUT/parallel_micro_1b.json" 2>&1 | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -14
tar czf "$OUT/hlo_micro.tgz" -C "$DUMP" . 2>/dev/null
python3 - "$PROF" <<'PY'
# Device 0's kernels of the last traced forward+backward: name, stream, start, duration (us).
import sys
from pathlib import Path
from gtp_jax.bench.trace import COMM_PATTERN, device_kernels, find_trace, load_events
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    try:
        ks = sorted(device_kernels(load_events(find_trace(d)))["/device:GPU:0"], key=lambda e: e["ts"])
    except (ValueError, KeyError) as e:
        print(d.name, "no trace", e); continue
    # the last iteration: after the last gap > 200 us between kernels
    cut = 0
    for i in range(1, len(ks)):
        if ks[i]["ts"] - (ks[i - 1]["ts"] + ks[i - 1]["dur"]) > 200:
            cut = i
    it = ks[cut:]
    t0 = it[0]["ts"]
    print(f"\n## {d.name}: {len(it)} kernels, {it[-1]['ts'] + it[-1]['dur'] - t0:.0f} us")
    for e in it[:60]:
        tag = "C" if COMM_PATTERN.search(e["name"]) else " "
        print(f"{tag} s{e['tid']} {e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e['name'][:70]}")
PY

fi

log "model"
rm -rf "$PROF"
timeout 240 python3 -m gtp_jax.bench parallel $TPFLAG --preset 1b --layers 8 --seq 2048 \
  --attention xla --remat dots --steps 10 --warmup 3 --timeout 90 --variants "$MODEL_VARIANTS" \
  --profile-dir "$PROF" --profile-variants tp,tp_overlap,tp_gtp,tp_gtp_overlap \
  --json "$OUT/parallel_1b.json" 2>&1 | grep -v -i deprecat | grep -E "^\[|^\||^device" | tail -14
mkdir -p "$PROF.excerpts"
python3 -m gtp_jax.bench.trace "$PROF" --each --steps 3 --excerpt-dir "$PROF.excerpts" --excerpt-ms 60
for v in tp tp_overlap tp_gtp tp_gtp_overlap; do
  [ -f "$PROF.excerpts/trace_${v}_excerpt.json.gz" ] && cp "$PROF.excerpts/trace_${v}_excerpt.json.gz" "$OUT/trace_parallel_1b_$v.json.gz"
done

if [ -n "${REPEAT_VARIANTS:-}" ]; then  # the same rows again, for the run-to-run spread
  log "repeat"
  timeout 150 python3 -m gtp_jax.bench parallel $TPFLAG --preset 1b --layers 8 --seq 2048 \
    --attention xla --remat dots --steps 10 --warmup 3 --timeout 70 --variants "$REPEAT_VARIANTS" \
    --json "$OUT/parallel_1b_repeat.json" 2>&1 | grep -E "^\|"
fi

if [ "${TUNING:-0}" = 1 ]; then
  log "tuning: NCCL_PROTO=Simple"
  NCCL_PROTO=Simple timeout 100 python3 -m gtp_jax.bench parallel --micro $TPFLAG --preset 1b \
    --seq 2048 --batch 4 --steps 30 --warmup 3 --timeout 50 \
    --variants gemm_only,ag_gemm,ag_gemm_ring,gemm_rs,gemm_rs_ring \
    --json "$OUT/parallel_micro_1b_nccl_proto_simple.json" 2>&1 | grep -E "^\|"
  NCCL_PROTO=Simple timeout 90 python3 -m gtp_jax.bench parallel $TPFLAG --preset 1b --layers 8 \
    --seq 2048 --attention xla --remat dots --steps 10 --warmup 3 --timeout 60 \
    --variants tp,tp_overlap --json "$OUT/parallel_1b_nccl_proto_simple.json" 2>&1 | grep -E "^\|"
  log "tuning: dynamic-slice fusion"
  XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=true" timeout 60 python3 -m gtp_jax.bench \
    parallel $TPFLAG --preset 1b --layers 8 --seq 2048 --attention xla --remat dots --steps 10 \
    --warmup 3 --timeout 55 --variants tp_overlap 2>&1 | grep -E "^\| tp|failed|rror" | head -5
fi

[ "${SKIP_MP:-0}" = 1 ] && { log "done"; ls -la "$OUT"; exit 0; }
log "multi-process"
PORT=62011
for i in $(seq 0 $((NGPU - 1))); do
  OMPI_MCA_orte_hnp_uri="$(( (PORT - 61440) * 4096 )).0;tcp://127.0.0.1:1" \
  OMPI_COMM_WORLD_SIZE=$NGPU OMPI_COMM_WORLD_RANK=$i OMPI_COMM_WORLD_LOCAL_RANK=$i \
  timeout 80 python3 -m gtp_jax train --preset small --steps 30 --distributed-auto \
    --metrics-json "$OUT/multiprocess_2x1gpu.json" > "/tmp/mp_$i.log" 2>&1 &
done
wait
grep -h -E "gtp_jax train|summary|error|Error" /tmp/mp_*.log | head -8
timeout 60 python3 -m gtp_jax train --preset small --steps 30 \
  --metrics-json "$OUT/multiprocess_reference_1x2gpu.json" 2>&1 | grep -E "gtp_jax train|summary"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    a = json.loads((out / "multiprocess_2x1gpu.json").read_text())
    b = json.loads((out / "multiprocess_reference_1x2gpu.json").read_text())
except FileNotFoundError as e:
    print("multi-process comparison missing:", e); raise SystemExit
la, lb = [s["loss"] for s in a["steps"]], [s["loss"] for s in b["steps"]]
diff = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
print(f"processes {a['summary']['process_count']} vs {b['summary']['process_count']}: "
      f"{len(la)} steps, loss {la[0]:.5f} -> {la[-1]:.5f}, max rel diff {diff:.2e}")
PY
log "done"; ls -la "$OUT"
