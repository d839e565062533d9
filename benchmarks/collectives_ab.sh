#!/usr/bin/env bash
# One collective per layer (the default, GTPConfig.coalesce_layer_collectives) against one
# per weight (--no-coalesce-layer-collectives), beside compiled FSDP2, on every GPU of the
# host (written for 2). ROWS picks and orders the rows (default "steps breakdown context 1b";
# also fp8, scanned, user):
#   steps      llama3-8b at SHAPES ("SEQxSEQS_PER_GPU", default "2048x1 8192x1 4096x2"):
#              per layer, per weight, the peer; step, peak, MFU, first step ($OUT/step_*).
#   breakdown  llama3-8b 2048 x 1 traced beside the traced peer (python -m gtp_jax.bench
#              breakdown): kernels by category, exposed collectives ($OUT/breakdown_2048.*).
#   context    ring attention over cp2, the 1b preset at 16k and 32k, traced: the ring's
#              hidden share ($OUT/context_cp2.*).
#   1b         the 1b preset at 4 x 2048 per GPU, per layer and per weight, beside the peer.
#   fp8        FP8 compute (delayed) fed by FP8 gathers, llama3-8b 8192 x 1 (its default
#              scanned loop): per layer and per weight ($OUT/fp8_8b_8192_*).
#   scanned    bf16 llama3-8b 8192 x 1, scanned with prefetch ($OUT/scanned_8b_8192_*).
#   user       a user's decoder on gtp_jax.Stack (remat dots, cuDNN attention), 1b shape,
#              4 x 2048 per GPU ($OUT/user_1b_*).
#   OUT=dir BUDGET=560 bash benchmarks/collectives_ab.sh        (from the repository root)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/collectives_ab}; mkdir -p "$OUT"
DEFAULT_BUDGET=560
. "$(dirname "$0")/budget.sh"
N=$(nvidia-smi -L | tee "$OUT/gpus.txt" | wc -l)
gtp() {  # [VARIANT=v] gtp NAME LIMIT ARGS...: bench overlap per layer and per weight
  local name=$1 lim=$2; shift 2
  for v in per_layer per_weight; do
    opt=""; [ $v = per_weight ] && opt=--no-coalesce-layer-collectives
    log "$name $v"
    within "$lim" python3 -m gtp_jax.bench overlap "$@" --timeout $((lim - 10)) $opt \
      --variants "${VARIANT:-gtp_dots}" --json "$OUT/${name}_$v.json" > "$OUT/${name}_$v.log" 2>&1
    grep -E "^\[|^\| (gtp|user)" "$OUT/${name}_$v.log" | tail -2
  done
}
peer() {  # peer NAME LIMIT KEY=VALUE...: compiled FSDP2
  local name=$1 lim=$2; shift 2
  log "$name FSDP2 compiled"
  within "$lim" env "$@" COMPILE=1 torchrun --nproc_per_node="$N" benchmarks/torch_fsdp2.py \
    > "$OUT/${name}_torch.log" 2>&1
  sed -n 's/^RESULT //p' "$OUT/${name}_torch.log" > "$OUT/${name}_torch.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"[peer] {r['step_ms']:.1f} ms, peak {r['peak_mem_gib']:.2f} GiB\")" \
    "$OUT/${name}_torch.json" 2>/dev/null || echo "[peer] failed"
}
for row in ${ROWS:-steps breakdown context 1b}; do
  case $row in
    steps) for shape in ${SHAPES:-2048x1 8192x1 4096x2}; do
        seq=${shape%x*}; mb=${shape#*x}
        gtp "step_$shape" 150 --preset llama3-8b --seq "$seq" --per-device-batch "$mb" \
          --steps 6 --warmup 2
        peer "step_$shape" 150 PRESET=llama3-8b SEQ="$seq" MB="$mb" STEPS=6
      done ;;
    breakdown)
      log "breakdown llama3-8b 2048 x 1 (per layer) beside FSDP2, traced"
      within 200 python3 -m gtp_jax.bench breakdown --preset llama3-8b --seq 2048 \
        --per-device-batch 1 --steps 6 --timeout 150 --out /tmp/gtp_jax_breakdown \
        > "$OUT/breakdown_2048.log" 2>&1
      grep -A 14 "^| ms per step" "$OUT/breakdown_2048.log"
      cp /tmp/gtp_jax_breakdown/breakdown.json "$OUT/breakdown_2048.json" ;;
    context)
      log "ring attention cp2, 1b at 16k and 32k, traced"
      within 130 python3 -m gtp_jax.bench context --preset 1b --remat full --mesh cp=2 \
        --seqs 16384,32768 --steps 3 --warmup 1 --timeout 110 --profile-dir /tmp/gtp_jax_cp \
        --json "$OUT/context_cp2.json" > "$OUT/context_cp2.log" 2>&1
      grep -E "^\||^\[" "$OUT/context_cp2.log" | tail -4 ;;
    1b)
      gtp step_1b_2048x4 100 --preset 1b --seq 2048 --per-device-batch 4 --steps 10 --warmup 2
      peer step_1b_2048x4 110 PRESET=1b SEQ=2048 MB=4 STEPS=10 ;;
    fp8)
      gtp fp8_8b_8192 150 --preset llama3-8b --seq 8192 --per-device-batch 1 \
        --fp8-compute delayed --gather-format fp8 --steps 6 --warmup 2 ;;
    scanned)
      VARIANT=gtp_prefetch_dots gtp scanned_8b_8192 120 --preset llama3-8b --seq 8192 \
        --per-device-batch 1 --no-unroll-layers --steps 6 --warmup 2 ;;
    user)
      VARIANT=user_gtp gtp user_1b 90 --preset 1b --seq 2048 --per-device-batch 4 --steps 10 \
        --warmup 3 --user-remat dots --attention cudnn ;;
  esac
done
rm -rf /tmp/gtp_jax_breakdown /tmp/gtp_jax_cp
log done
