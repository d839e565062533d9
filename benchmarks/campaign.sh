#!/usr/bin/env bash
# The campaign runner: PARTS="part part ..." bash benchmarks/campaign.sh, on a GPU host, from
# the repository root. Every part writes a log and a JSON file under $OUT (default
# runs/campaign); SCALE=cpu runs each part scaled down on simulated CPU devices (no PyTorch
# peer), to check the script without GPUs.
#
# Parts:
#   breakdown  where one step's time and memory go, gtp_jax beside compiled FSDP2
#              (python -m gtp_jax.bench breakdown), for each of SHAPES ("SEQxSEQS_PER_GPU",
#              default "2048x1 8192x1") on PRESET (default llama3-8b) and every GPU;
#              EXTRA: options for gtp_jax's side (bench overlap), TORCH_ENV: for the peer's.
#   step       gtp_jax's step beside compiled FSDP2 for each of SHAPES on each of GPU_SETS
#              (CUDA_VISIBLE_DEVICES lists, default "all"); gtp_jax's options in JAX_OPTS
#              (default: remat dots, the library's loop), the peer's environment in TORCH_ENV
#              (e.g. "AC=full REDUCE=bfloat16"); one JSON per row and a table.
# Environment: OUT, PARTS, SHAPES, PRESET, STEPS (timed steps, default 8), LIMIT (seconds per
# side, default 400).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-runs/campaign}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/gtp_campaign}; mkdir -p "$WORK"
PARTS=${PARTS:-breakdown}
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
if [ "${SCALE:-gpu}" = cpu ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
  PRESET=${PRESET:-tiny}; SHAPES=${SHAPES:-"64x2"}; STEPS=${STEPS:-2}; NOTORCH="--no-torch"
else
  PRESET=${PRESET:-llama3-8b}; SHAPES=${SHAPES:-"2048x1 8192x1"}; STEPS=${STEPS:-8}; NOTORCH=""
fi
LIMIT=${LIMIT:-400}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

part_breakdown() {
  for shape in $SHAPES; do
    seq=${shape%x*}; mb=${shape#*x}; dir="$WORK/breakdown_${PRESET}_${seq}x${mb}"
    log "breakdown $PRESET seq $seq x $mb per GPU"
    rm -rf "$dir"
    python3 -m gtp_jax.bench breakdown --preset "$PRESET" --seq "$seq" --per-device-batch "$mb" \
      --steps "$STEPS" --timeout "$LIMIT" --out "$dir" $NOTORCH \
      ${TORCH_ENV:+--torch-env "$TORCH_ENV"} ${EXTRA:+-- $EXTRA} \
      > "$OUT/breakdown_${seq}x${mb}.log" 2>&1
    grep -v -i "deprecat\|warn" "$OUT/breakdown_${seq}x${mb}.log" | tail -60
    cp "$dir/breakdown.json" "$OUT/breakdown_${seq}x${mb}.json" 2>/dev/null
  done
}

part_step() {
  for gpus in ${GPU_SETS:-all}; do
    n=$(python3 -c "import jax; print(jax.device_count())")
    [ "$gpus" != all ] && n=$(echo "$gpus" | tr ',' '\n' | wc -l)
    vis=(); [ "$gpus" != all ] && vis=(env CUDA_VISIBLE_DEVICES="$gpus")
    for shape in $SHAPES; do
      seq=${shape%x*}; mb=${shape#*x}; tag="step_${n}gpu_${seq}x${mb}"
      log "$tag: gtp_jax"
      "${vis[@]}" python3 -m gtp_jax.bench overlap --preset "$PRESET" --seq "$seq" \
        --per-device-batch "$mb" --steps "$STEPS" --warmup 2 --timeout "$LIMIT" \
        --variants gtp_dots ${JAX_OPTS:-} --json "$OUT/${tag}_gtp_jax.json" 2>&1 \
        | grep -E "^\[|^\| gtp"
      [ -n "$NOTORCH" ] && continue
      log "$tag: FSDP2 compiled ${TORCH_ENV:-}"
      "${vis[@]}" env PRESET="$PRESET" SEQ="$seq" MB="$mb" STEPS="$STEPS" COMPILE=1 \
        ${TORCH_ENV:-} timeout "$LIMIT" torchrun --nproc_per_node="$n" benchmarks/torch_fsdp2.py \
        2>&1 | sed -n 's/^RESULT //p' > "$OUT/${tag}_torch.json"
    done
  done
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "step_*.json"))):
    try:
        r = json.loads(open(f).read() or "null")
    except ValueError:
        continue
    r = r[0] if isinstance(r, list) and r else r
    if r:
        rows[os.path.basename(f)[:-5]] = r
print("| row | step ms | MFU | peak GiB | first step s | ratio to FSDP2 |")
print("|---|---|---|---|---|---|")
for name, r in rows.items():
    peer = rows.get(name.replace("_gtp_jax", "_torch"))
    ratio = f"{r['step_ms'] / peer['step_ms']:.3f}x" if peer and name.endswith("gtp_jax") else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    print(f"| {name} | {r['step_ms']:.1f} | {mfu} | {r['peak_mem_gib']:.2f} | "
          f"{r.get('first_step_s') or 0:.0f} | {ratio} |")
PY
}

for part in $PARTS; do
  if ! declare -F "part_$part" >/dev/null; then
    echo "unknown part '$part'; parts: $(declare -F | sed -n 's/.*part_//p' | tr '\n' ' ')"
    exit 2
  fi
  "part_$part"
done
log done
