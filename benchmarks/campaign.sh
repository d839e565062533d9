#!/usr/bin/env bash
# The campaign runner: PARTS="part part ..." bash benchmarks/campaign.sh, on a GPU host, from
# the repository root. Every part writes its logs and JSON files under $OUT (default
# runs/campaign); SCALE=cpu runs each part scaled down on simulated CPU devices (no PyTorch
# peer), to check the script without GPUs (parts that need GPUs say so and are skipped).
#
# Parts run here:
#   breakdown  where one step's time and memory go, gtp_jax beside compiled FSDP2
#              (python -m gtp_jax.bench breakdown), for each of SHAPES ("SEQxSEQS_PER_GPU",
#              default "2048x1 8192x1") on PRESET (default llama3-8b) and every GPU;
#              EXTRA: options for gtp_jax's side (bench overlap), TORCH_ENV: for the peer's.
#   step       gtp_jax's step beside compiled FSDP2 for each of SHAPES on each of GPU_SETS
#              (CUDA_VISIBLE_DEVICES lists, default "all"); gtp_jax's options in JAX_OPTS
#              (default: remat dots, the library's loop), the peer's environment in TORCH_ENV
#              (e.g. "AC=full REDUCE=bfloat16"); one JSON per row and a table.
#   ntp        nonuniform TP live: dp2 x tp2 with a simulated failure at step 4 (the survivors
#              continue at a reduced tp), beside a uniform run of the reduced layout; loss
#              curves, step times before and after, the re-layout time.
#   tp_gtp     2-D TP x GTP on PRESET_TP (default llama3-8b) at SEQ_TP (default 8192):
#              tp2 x gtp2, gtp4 and tp4, each plain and with ring collective matmuls; and
#              the ring collective matmul alone against its GEMM-only budget (--micro).
#   moe        a mixture of experts (8 experts, top-2): the command line's losses on ep1 (the
#              reference), ep2 x gtp2 and ep4, with the share of routing dropped; step times.
#   context    ring attention: cp4 at 16k and 32k (traced: the ring's hidden share), and
#              cp2 x gtp2 on llama3-8b at 32k.
#   processes  the command line's own multi-process launch (--processes): 4 x 1 and 2 x 2
#              GPUs beside 1 x 4, a SIGTERM to one process then --resume auto, a kill -9.
#   cluster    processes started one by one as a cluster scheduler does (--coordinator,
#              --num-processes 2, --process-id; one per GPU, no --processes launcher): kill
#              -9 of process 1, then of process 0 (the coordinator); how long the survivor
#              took to exit, its status and its error lines ($OUT/cluster.log, and each
#              process's output as $OUT/cluster_<victim>_p<i>.{out,err}).
#   fp8_loss   1000 steps of the 1b preset on real text (DATA, default .carry/text: a folder
#              of .txt files; TOKENIZER, default .carry/tok: a tokenizer.json folder), seq
#              512 x 4, for each of RECIPES (default "bf16 fp8"; fp8 = --fp8-compute
#              tensorwise, delayed = --fp8-compute delayed), the held-out loss every 250
#              steps ($OUT/loss_<recipe>.json; plot with benchmarks/plot_loss.py).
# Parts that run a per-question script, each in its own folder under $OUT:
#   matrix     every path a user takes (benchmarks/matrix.sh; CELLS, PROFILE_CELLS).
#   fp8        FP8 compute on one GPU: Llama-3-8B-shaped blocks and the GEMM sweep, beside
#              torchao float8 (benchmarks/fp8.sh; ROWS, PROFILE, LAYERS; $OUT/fp8_blocks).
#   fp8_1b, fp8_8b
#              FP8 compute fed by FP8 gathers against gtp_jax's bf16 step and FSDP2 +
#              torch.compile + torchao float8 all-gather on every GPU, the 1b preset and 8
#              llama3-8b layers (benchmarks/fp8_2gpu.sh; FP8_VARIANTS, default
#              none:none,fp8:delayed,fp8:tensorwise; REMAT_8B; $OUT/fp8); a table at the end.
#   plan_1b, plan_8b
#              the planner's predictions against runs of its TOP (default 5) layouts
#              (benchmarks/plan_accuracy.sh; $OUT/plan): 1b at seq 2048 and 4096, 8
#              sequences; llama3-8b (32 layers) at SEQS_8B (default 4096), 2 sequences; a
#              table at the end.
#   offload    optimizer state in host memory against on the device, sharded over every GPU
#              (benchmarks/offload.sh; $OUT/offload): the 1b step's cost, and the largest
#              llama3-8b shape that trains at seq 4096 (OFFLOAD_BIG, default 96, 80, 64, 56,
#              48, 40, then 32 layers, largest first; MODES="device offload master").
#   preempt    seconds from SIGTERM to exit, and the requeue (benchmarks/preempt.sh).
#   kernels    the quantize kernels (python -m gtp_jax.bench quant --check), the SwiGLU
#              backward kernel (benchmarks/swiglu_bwd.py) and ring attention's block
#              kernels (benchmarks/flash_block.py), each against XLA.
#   tp         TP + SP with ring collective matmuls against plain TP + SP, the collective
#              matmul alone, and a two-process run (benchmarks/parallel_tp.sh; $OUT/tp).
# Environment: OUT, PARTS, SHAPES, PRESET, STEPS (timed steps, default 8), LIMIT (seconds per
# side, default 400), LONG_STEPS (the processes part's interrupted run, default 20 x
# TRAIN_STEPS), SIGTERM_AFTER (seconds into it, default 40), PROC_PLAIN=0 (the processes part
# without its plain timing runs), PROC_COUNTS (its process counts, default "4 2"), KILL=0
# (without its kill -9). BUDGET=seconds: a part
# starts only while the budget lasts, and the per-question scripts are stopped when it runs
# out. REQUIRE_GPU=H200: run nothing (status 3) unless every GPU's name contains it.
# ARCHIVE=1: everything written, again as $OUT/campaign.tgz.
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
  PRESET_TP=${PRESET_TP:-tiny}; SEQ_TP=${SEQ_TP:-64}; PRESET_SMALL=tiny; SEQ_SMALL=64
  CP_SEQS=${CP_SEQS:-128,256}; SEQ_CP8B=${SEQ_CP8B:-256}; PRESET_CP8B=tiny; TRAIN_STEPS=6
  SIGTERM_AFTER=${SIGTERM_AFTER:-20}; CHECK_DTYPE=""
else
  PRESET=${PRESET:-llama3-8b}; SHAPES=${SHAPES:-"2048x1 8192x1"}; STEPS=${STEPS:-8}; NOTORCH=""
  PRESET_TP=${PRESET_TP:-llama3-8b}; SEQ_TP=${SEQ_TP:-8192}; PRESET_SMALL=1b; SEQ_SMALL=2048
  CP_SEQS=${CP_SEQS:-16384,32768}; SEQ_CP8B=${SEQ_CP8B:-32768}; PRESET_CP8B=llama3-8b
  TRAIN_STEPS=${TRAIN_STEPS:-12}
  # Loss comparisons across layouts in float32: bfloat16 rounding differs with the layout,
  # and the first AdamW steps (updates of +-lr wherever a gradient is near zero) amplify it.
  CHECK_DTYPE=${CHECK_DTYPE:---dtype float32}
fi
# Runs whose losses are compared step by step use XLA's deterministic kernels (on GPUs the
# embedding's scatter-add and attention's backward otherwise differ run to run), in float32
# on GPUs (train refuses --deterministic with bfloat16 there).
DET="--deterministic $CHECK_DTYPE"
LIMIT=${LIMIT:-400}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -n "${REQUIRE_GPU:-}" ]; then
  nvidia-smi -L > "$OUT/gpus.txt" 2>&1
  if ! grep -q . "$OUT/gpus.txt" || grep -v -q -- "$REQUIRE_GPU" "$OUT/gpus.txt"; then
    echo "not run: REQUIRE_GPU=$REQUIRE_GPU, and not every GPU above is one"; exit 3
  fi
fi
left() { echo $(( ${BUDGET:-0} - ($(date +%s) - T0) )); }
budgeted() { if [ -n "${BUDGET:-}" ]; then timeout "$(left)" "$@"; else "$@"; fi; }
gpu_only() {  # a part that needs GPUs: skipped under SCALE=cpu
  [ "${SCALE:-gpu}" = cpu ] && { log "$1: skipped under SCALE=cpu (needs GPUs)"; return 0; }
  return 1
}

# Losses of the command line's metrics JSON files compared step by step with a reference's:
# compare_losses REF.json OTHER.json... [-- FROM_STEP]
compare_losses() {
  python3 - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
first = int(args[args.index("--") + 1]) if "--" in args else 1
files = args[:args.index("--")] if "--" in args else args
def losses(path):
    return {s["step"]: s["loss"] for s in json.load(open(path))["steps"]}
ref = losses(files[0])
for path in files[1:]:
    got = losses(path)
    steps = sorted(k for k in got if k in ref and k >= first)
    rel = [abs(got[k] - ref[k]) / abs(ref[k]) for k in steps]
    equal = sum(got[k] == ref[k] for k in steps)
    print(f"{path.rsplit('/', 1)[-1]} against {files[0].rsplit('/', 1)[-1]}: steps "
          f"{steps[0]}..{steps[-1]}, {equal} of {len(steps)} bit-equal, max relative "
          f"difference {max(rel):.2e}")
PY
}

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

part_ntp() {
  log "nonuniform TP: dp2 x tp2, device 3 fails after step 4"
  local run="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 4 --steps $TRAIN_STEPS --dp 2 --tp 2 --gtp 1"
  python3 -m gtp_jax train $run --simulate-failure step=4,device=3 \
    --metrics-json "$OUT/ntp_failure.json" > "$OUT/ntp_failure.log" 2>&1
  grep -v "^\[#" "$OUT/ntp_failure.log" | grep -v "IOTA device assignment" | tail -14
  log "the same, $DET, beside the run without the failure (the losses to keep)"
  python3 -m gtp_jax train $run --simulate-failure step=4,device=3 $DET \
    --metrics-json "$OUT/ntp_failure_check.json" > "$OUT/ntp_failure_check.log" 2>&1
  python3 -m gtp_jax train $run $DET --metrics-json "$OUT/ntp_uniform.json" \
    > "$OUT/ntp_uniform.log" 2>&1
  tail -3 "$OUT/ntp_uniform.log"
  compare_losses "$OUT/ntp_uniform.json" "$OUT/ntp_failure_check.json"
  compare_losses "$OUT/ntp_uniform.json" "$OUT/ntp_failure_check.json" -- 5
}

part_tp_gtp() {
  local base="--preset $PRESET_TP --seq $SEQ_TP --batch 4 --remat dots --steps $STEPS --timeout $LIMIT"
  [ "${SCALE:-gpu}" = cpu ] && base="$base --cpu-devices 4"
  for mesh in "2 2 tp_gtp,tp_gtp_overlap" "1 4 tp_gtp" "4 1 tp,tp_overlap"; do
    set -- $mesh
    log "tp$1 x gtp$2: $3"
    python3 -m gtp_jax.bench parallel $base --tp "$1" --gtp "$2" --variants "$3" \
      --json "$OUT/tp${1}_gtp${2}.json" 2>&1 | grep -E "^\||^\[" | tail -6
  done
  log "ring collective matmul alone against its GEMM budget, tp 4"
  python3 -m gtp_jax.bench parallel $base --tp 4 --micro --json "$OUT/tp4_micro.json" 2>&1 \
    | grep -E "^\||^\[" | tail -12
}

part_moe() {
  local run="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps $TRAIN_STEPS --moe-experts 8 --moe-top-k 2 --log-every 1"
  # ep dp gtp: ep1 (the reference; experts sharded by gtp, as replicated ones need 53 GiB a
  # GPU for the 1b preset's 4.7B parameters and more in float32), ep2 x gtp2, ep4
  for mesh in "1 1 4" "2 1 2" "4 1 1"; do
    set -- $mesh
    log "MoE, 8 experts top-2: ep$1 dp$2 gtp$3 (losses)"
    python3 -m gtp_jax train $run --ep "$1" --dp "$2" --gtp "$3" $DET \
      --metrics-json "$OUT/moe_ep$1.json" > "$OUT/moe_ep$1.log" 2>&1
    grep -E "dropped|loss:" "$OUT/moe_ep$1.log" | tail -2
  done
  compare_losses "$OUT/moe_ep1.json" "$OUT/moe_ep2.json" "$OUT/moe_ep4.json"
  local base="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps $STEPS --timeout $LIMIT --moe-experts 8 --moe-top-k 2"
  [ "${SCALE:-gpu}" = cpu ] && base="$base --cpu-devices 4"
  [ "${SCALE:-gpu}" = cpu ] || base="$base --profile-dir $WORK/moe_profile --profile-variants no_tp_moe,tp_gtp_overlap_moe"
  log "MoE step time: ep4 (no_tp_moe), ep2 x gtp2 (tp_gtp_overlap_moe with tp 1: no ring)"
  python3 -m gtp_jax.bench parallel $base --tp 1 --gtp 2 --variants no_tp_moe,tp_gtp_overlap_moe \
    --json "$OUT/moe_step.json" 2>&1 | grep -E "^\||^\[" | tail -6
}

part_context() {
  local prof=""; [ "${SCALE:-gpu}" = cpu ] || prof="--profile-dir $WORK/context_profile"
  log "ring attention, cp4, $PRESET_SMALL at $CP_SEQS"
  python3 -m gtp_jax.bench context --preset "$PRESET_SMALL" --remat full --mesh cp=4 \
    --seqs "$CP_SEQS" --steps 3 --warmup 1 --timeout "$LIMIT" $prof \
    --json "$OUT/context_cp4.json" 2>&1 | grep -E "^\||^\[" | tail -8
  log "cp2 x gtp2, $PRESET_CP8B at $SEQ_CP8B"
  python3 -m gtp_jax.bench context --preset "$PRESET_CP8B" --remat full --mesh cp=2,gtp=2 \
    --seqs "$SEQ_CP8B" --steps 3 --warmup 1 --timeout "$LIMIT" \
    --json "$OUT/context_cp2_gtp2.json" 2>&1 | grep -E "^\||^\[" | tail -6
}

part_processes() {
  local run="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps $TRAIN_STEPS --dp 1 --gtp 4 --seed 1"
  local modes=("" "$DET"); [ "${PROC_PLAIN:-1}" = 1 ] || modes=("$DET")
  for det in "${modes[@]}"; do  # step times as users run; then losses compared, deterministic
    log "1 process x 4 devices $det"
    python3 -m gtp_jax train $run $det --metrics-json "$OUT/proc_1x4${det:+_det}.json" \
      > "$OUT/proc_1x4${det:+_det}.log" 2>&1
    grep "step time" "$OUT/proc_1x4${det:+_det}.log"
    for n in ${PROC_COUNTS:-4 2}; do
      log "$n processes (--processes $n) $det"
      python3 -m gtp_jax train $run $det --processes "$n" \
        --metrics-json "$OUT/proc_${n}${det:+_det}.json" > "$OUT/proc_${n}${det:+_det}.log" 2>&1
      grep "step time" "$OUT/proc_${n}${det:+_det}.log"
    done
  done
  compare_losses "$OUT/proc_1x4_det.json" $(ls "$OUT"/proc_[0-9]_det.json)
  local long=${LONG_STEPS:-$((TRAIN_STEPS * 20))}
  log "2 processes, $long steps uninterrupted (the reference)"
  python3 -m gtp_jax train $run $DET --steps "$long" --processes 2 \
    --metrics-json "$OUT/proc_reference.json" > "$OUT/proc_reference.log" 2>&1
  log "the same, SIGTERM to process 1 after ${SIGTERM_AFTER:-40} s, then --resume auto"
  rm -rf "$WORK/proc_ck"
  python3 -m gtp_jax train $run $DET --steps "$long" --processes 2 \
    --checkpoint-dir "$WORK/proc_ck" --metrics-json "$OUT/proc_stopped.json" \
    > "$OUT/proc_sigterm.log" 2>&1 &
  local launcher=$!
  sleep "${SIGTERM_AFTER:-40}"; pkill -TERM -f -- "--process-id 1" || true
  wait $launcher; echo "launcher exit $? (75: stopped, resumable)"
  grep -E "^error|stopped by" "$OUT/proc_sigterm.log" | head -3
  python3 -m gtp_jax train $run $DET --steps "$long" --processes 2 \
    --checkpoint-dir "$WORK/proc_ck" --resume auto --metrics-json "$OUT/proc_resumed.json" \
    > "$OUT/proc_resumed.log" 2>&1
  echo "resumed run: exit $?"
  grep -h "resumed from" "$OUT/proc_resumed.log" | head -1
  compare_losses "$OUT/proc_reference.json" "$OUT/proc_stopped.json" "$OUT/proc_resumed.json"
  [ "${KILL:-1}" = 1 ] || return 0
  log "kill -9 of process 1"
  python3 -m gtp_jax train $run --steps 1000 --processes 2 > "$OUT/proc_kill.log" 2>&1 &
  launcher=$!
  sleep "${SIGTERM_AFTER:-40}"; local t=$(date +%s); pkill -KILL -f -- "--process-id 1" || true
  wait $launcher; echo "launcher exit $? after $(( $(date +%s) - t )) s"
  grep -E "^error" "$OUT/proc_kill.log" | head -3
}

part_cluster() {
  # On GPUs one process per GPU (GPUs 0 and 1); on CPU (SCALE=cpu) 2 x 1 simulated devices.
  local run="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps 1000 --dp 1 --gtp 2"
  local devices=(--local-device-ids 0 --local-device-ids 1) flags=${XLA_FLAGS:-}
  [ "${SCALE:-gpu}" = cpu ] && { devices=("" "" "" ""); flags=""; }
  for victim in ${VICTIMS:-1 0}; do
    local port=$((20000 + RANDOM % 20000)) pids=() i
    log "cluster: 2 processes started by hand, kill -9 of process $victim"
    for i in 0 1; do
      XLA_FLAGS="$flags" python3 -m gtp_jax train $run --log-every 1 \
        --coordinator "localhost:$port" --num-processes 2 --process-id "$i" \
        ${devices[$((2 * i))]} ${devices[$((2 * i + 1))]} \
        > "$OUT/cluster_${victim}_p$i.out" 2> "$OUT/cluster_${victim}_p$i.err" &
      pids+=($!)
    done
    local waited=0
    until grep -q " step 3/" "$OUT/cluster_${victim}_p0.err" 2>/dev/null; do
      sleep 1; waited=$((waited + 1))
      if [ $waited -gt 900 ] || ! kill -0 "${pids[0]}" 2>/dev/null; then
        echo "cluster: no step 3 (see $OUT/cluster_${victim}_p0.err)"; kill -9 "${pids[@]}"; break
      fi
    done
    local survivor=$((1 - victim)) t0
    t0=$(date +%s.%N); kill -9 "${pids[$victim]}"
    wait "${pids[$survivor]}"; local code=$?
    local took; took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
    sleep 2  # the survivor's last line is written as it ends
    local err="$OUT/cluster_${victim}_p$survivor.err" out="$OUT/cluster_${victim}_p$survivor.out"
    {
      echo "kill -9 of process $victim: process $survivor exited after $took s, status $code"
      echo "its error lines: $(grep -c '^error' "$err")"; grep '^error' "$err"
      echo "abort stack, traceback, runtime log or gloo lines:" \
        "$(cat "$err" "$out" | grep -c -E 'Check failure|Traceback|^[IWEF][0-9]{4} |\[Gloo\]')"
    } | tee -a "$OUT/cluster.log"
    wait "${pids[$victim]}" 2>/dev/null
  done
}

part_fp8_loss() {
  gpu_only fp8_loss && return
  for recipe in ${RECIPES:-bf16 fp8}; do
    local extra=()
    [ "$recipe" = fp8 ] && extra=(--fp8-compute tensorwise --fp8-min-features 2048)
    [ "$recipe" = delayed ] && extra=(--fp8-compute delayed --fp8-min-features 2048)
    log "1b on ${DATA:-.carry/text}, 1000 steps, $recipe"
    timeout 300 python3 -m gtp_jax train --preset 1b --seq 512 --batch 4 --steps 1000 \
      --gtp 1 --dp 1 --data "${DATA:-.carry/text}" --tokenizer "${TOKENIZER:-.carry/tok}" \
      --eval-every 250 --eval-batches 16 \
      "${extra[@]}" --metrics-json "$OUT/loss_$recipe.json" 2>&1 | grep -v -i deprecat \
      | grep -E "loss|step time|memory|eval|held|rror" | tail -12
  done
}

part_matrix() {
  gpu_only matrix && return
  OUT="$OUT/matrix" budgeted bash benchmarks/matrix.sh
}

part_fp8() {
  gpu_only fp8 && return
  OUT="$OUT/fp8_blocks" budgeted bash benchmarks/fp8.sh
}

fp8_step() {  # fp8_1b / fp8_8b
  gpu_only "fp8_$1" && return
  OUT="$OUT/fp8" MODELS=$1 \
    VARIANTS="${FP8_VARIANTS:-none:none,fp8:delayed,fp8:tensorwise}" \
    budgeted bash benchmarks/fp8_2gpu.sh
}
part_fp8_1b() { fp8_step 1b; }
part_fp8_8b() { fp8_step 8b; }

plan_case() {  # preset, seqs, batch, steps, timeout
  if [ "${SCALE:-gpu}" = cpu ]; then
    OUT="$OUT/plan" PRESETS=tiny SEQS=64 BATCH=8 TOP=${TOP:-2} STEPS=3 TIMEOUT=300 \
      bash benchmarks/plan_accuracy.sh
    return
  fi
  OUT="$OUT/plan" PRESETS=$1 SEQS="$2" BATCH=$3 TOP=${TOP:-5} STEPS=$4 TIMEOUT=$5 \
    budgeted bash benchmarks/plan_accuracy.sh
}
part_plan_1b() { plan_case 1b "2048 4096" 8 8 300; }
part_plan_8b() { plan_case llama3-8b "${SEQS_8B:-4096}" 2 6 420; }

part_offload() {
  local n
  if [ "${SCALE:-gpu}" = cpu ]; then
    n=$(python3 -c "import jax; print(jax.device_count())")
    OUT="$OUT/offload" GTP=$n SMALL=tiny SEQ1=32 BIG=tiny SEQ2=64 STEPS=2 BIG_STEPS=2 \
      bash benchmarks/offload.sh
    return
  fi
  n=$(nvidia-smi -L | wc -l)
  OUT="$OUT/offload" GTP=$n BIG_STEPS=3 LIMIT=300 \
    BIG="${OFFLOAD_BIG:-llama3-8b:96 llama3-8b:80 llama3-8b:64 llama3-8b:56 llama3-8b:48 llama3-8b:40 llama3-8b}" \
    budgeted bash benchmarks/offload.sh
}

part_preempt() {
  gpu_only preempt && return
  OUT="$OUT/preempt" budgeted bash benchmarks/preempt.sh
}

part_kernels() {
  gpu_only kernels && return
  log "quantize kernels"
  python3 -m gtp_jax.bench quant --check --json "$OUT/quant_kernels.json" 2>&1 \
    | tee "$OUT/quant_kernels.log" | grep -E "^\|"
  log "SwiGLU backward kernel"
  python3 benchmarks/swiglu_bwd.py --json "$OUT/swiglu_bwd.json" 2>&1 | grep -v -i deprecat
  log "ring attention's block kernels"
  python3 benchmarks/flash_block.py --lengths 4096,8192 --json "$OUT/flash_block.json" 2>&1 \
    | tee "$OUT/flash_block.log" | grep -v -i deprecat
}

part_tp() {
  gpu_only tp && return
  OUT="$OUT/tp" budgeted bash benchmarks/parallel_tp.sh
}

for part in $PARTS; do
  if ! declare -F "part_$part" >/dev/null; then
    echo "unknown part '$part'; parts: $(declare -F | sed -n 's/.*part_//p' | tr '\n' ' ')"
    exit 2
  fi
  if [ -n "${BUDGET:-}" ] && [ "$(left)" -lt 30 ]; then log "skip $part: the budget is spent"; continue; fi
  "part_$part"
done
if [ -d "$OUT/plan/plan_accuracy" ]; then
  log "planner accuracy: every case run so far"
  SUMMARY_ONLY=1 OUT="$OUT/plan" bash benchmarks/plan_accuracy.sh
fi
if [ -d "$OUT/fp8" ]; then
  log "FP8 steps"
  python3 - "$OUT/fp8" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(f"{out}/*_gtp_*.json")):
    for r in json.load(open(path)):
        rows.append((os.path.basename(path)[:-5], r["step_ms"], r["peak_mem_gib"]))
for path in sorted(glob.glob(f"{out}/*_torch.jsonl")):
    for line in open(path):
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            rows.append((f"{r['preset']}_{r['variant']}", r["step_ms"], r["peak_mem_gib"]))
for name, ms, gib in rows:
    print(f"{name:<42} {ms:8.1f} ms {gib:7.2f} GiB")
PY
fi
# One archive of everything written, beside the folders, for tools that copy back only
# a few files or none from deep folders.
[ "${ARCHIVE:-0}" = 1 ] && tar czf "$OUT/campaign.tgz" -C "$OUT" --exclude campaign.tgz . 2>/dev/null
log done
