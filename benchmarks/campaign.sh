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
#              tp2 x gtp2, gtp4 and tp4, each plain and with ring collective matmuls, the
#              ring variants traced on GPUs (their communication's hidden share); and the ring
#              collective matmul alone against its GEMM-only budget (--micro). TP_MESHES
#              ("TP:GTP:VARIANTS ...") picks the rows, TP_MICRO=0 leaves out the --micro one.
#   plan_rank  the planner's ranking of gtp4, tp2 x gtp2 and tp4 at tp_gtp's shape (4
#              sequences of SEQ_TP; python -m gtp_jax plan on this host, and --on-paper with
#              CALIBRATION) beside the steps the tp_gtp and breakdown parts measured in $OUT.
#   moe        a mixture of experts (8 experts, top-2): the command line's losses on ep1 (the
#              reference), ep2 x gtp2 and ep4, with the share of routing dropped (in float32
#              on GPUs, JAX_DEFAULT_MATMUL_PRECISION=highest, or MOE_PRECISION); step times
#              (MOE_STEP=0 leaves them out).
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
#   fp8_full   FP8 compute (FP8_RECIPES, default delayed) fed by FP8 gathers on the whole
#              llama3-8b at FP8_SHAPE (default 8192x1) on every GPU, beside FSDP2 + torchao
#              float8 all-gather (FP8_PEERS, default "float8"; "bf16 float8" adds bf16
#              FSDP2); step, peak and first-step time of each (torchao's wheel in .carry/whl).
#   eight      llama3-8b at EIGHT_SHAPES (default 8192x1) on every GPU (written for 8):
#              gtp = all and dp2 x gtp4, bf16 (traced) and FP8 compute, against FSDP2 and
#              HSDP (2 replicas) compiled and FSDP2 + torchao float8 (EIGHT_ROWS picks and
#              orders them); tokens/s per GPU beside torchtitan's published 8x H100 figures
#              and the planner's on-paper step.
#   scaling    the llama3-8b step at SEQ_8B x 1 on each of SCALING_GPUS (default "1 2 4 8")
#              GPUs, the first SCALING_GPUS of the host (1 GPU: --layers SCALING_LAYERS_1,
#              default 16, as the whole model does not fit one): tokens/s and MFU per GPU,
#              and the communication exposed in the trace.
#   layers_70b  llama3-70b-shaped layers on every GPU (written for 8), 8192 tokens per GPU,
#              remat dots: gtp = all and tp2 x gtp(n/2) (bench parallel), each with the first
#              of LAYERS_70B (default "28 24": the planner's estimate of 28 is 92 GiB, of 32
#              104 GiB, against the 105 GiB JAX's allocator takes of an H200) that runs,
#              beside the planner's on-paper step and peak for the same layout.
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
# (without its kill -9). BUDGET=seconds: a part starts only while the budget lasts (a
# PARTS entry PART:SECONDS: while SECONDS are left), the per-question scripts are stopped
# when it runs out, and a row of breakdown, step, tp_gtp, fp8_full, eight, scaling or
# layers_70b starts only while its time is left. SCALE=cpu simulates CPU_DEVICES (default
# 4) devices. CALIBRATION: the rates the on-paper planner predicts with (default: the 2x
# H200 calibration in docs/results). REQUIRE_GPU=H200: run nothing (status 3) unless every
# GPU's name contains it.
# ARCHIVE=1: everything written, again as $OUT/campaign.tgz.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-runs/campaign}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/gtp_campaign}; mkdir -p "$WORK"
PARTS=${PARTS:-breakdown}
T0=$(date +%s); log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
if [ "${SCALE:-gpu}" = cpu ]; then
  CPU_DEVICES=${CPU_DEVICES:-4}
  export XLA_FLAGS="--xla_force_host_platform_device_count=$CPU_DEVICES" JAX_PLATFORMS=cpu
  PRESET=${PRESET:-tiny}; SHAPES=${SHAPES:-"64x2"}; STEPS=${STEPS:-2}; NOTORCH="--no-torch"
  PRESET_TP=${PRESET_TP:-tiny}; SEQ_TP=${SEQ_TP:-64}; PRESET_SMALL=tiny; SEQ_SMALL=64
  CP_SEQS=${CP_SEQS:-128,256}; SEQ_CP8B=${SEQ_CP8B:-256}; PRESET_CP8B=tiny; TRAIN_STEPS=6
  SIGTERM_AFTER=${SIGTERM_AFTER:-20}; CHECK_DTYPE=""
  # the whole-model rows (fp8_full, eight, scaling, layers_70b) on the tiny preset
  PRESET_8B=tiny; SEQ_8B=${SEQ_8B:-64}; PRESET_70B=tiny; SEQ_70B=64; LAYERS_70B=${LAYERS_70B:-2}
  SCALING_LAYERS_1=${SCALING_LAYERS_1:-2}; FP8_MIN="--fp8-min-features 64"
else
  PRESET=${PRESET:-llama3-8b}; SHAPES=${SHAPES:-"2048x1 8192x1"}; STEPS=${STEPS:-8}; NOTORCH=""
  PRESET_TP=${PRESET_TP:-llama3-8b}; SEQ_TP=${SEQ_TP:-8192}; PRESET_SMALL=1b; SEQ_SMALL=2048
  CP_SEQS=${CP_SEQS:-16384,32768}; SEQ_CP8B=${SEQ_CP8B:-32768}; PRESET_CP8B=llama3-8b
  TRAIN_STEPS=${TRAIN_STEPS:-12}
  PRESET_8B=llama3-8b; SEQ_8B=${SEQ_8B:-8192}; PRESET_70B=llama3-70b; SEQ_70B=8192
  LAYERS_70B=${LAYERS_70B:-28 24}; SCALING_LAYERS_1=${SCALING_LAYERS_1:-16}; FP8_MIN=""
  # Loss comparisons across layouts in float32: bfloat16 rounding differs with the layout,
  # and the first AdamW steps (updates of +-lr wherever a gradient is near zero) amplify it.
  CHECK_DTYPE=${CHECK_DTYPE:---dtype float32}
fi
# Runs whose losses are compared step by step use XLA's deterministic kernels (on GPUs the
# embedding's scatter-add and attention's backward otherwise differ run to run), in float32
# on GPUs (train refuses --deterministic with bfloat16 there).
DET="--deterministic $CHECK_DTYPE"
LIMIT=${LIMIT:-400}
CALIBRATION=${CALIBRATION:-docs/results/2026-11-27_2xH200/plan_top5/calibration.json}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -n "${REQUIRE_GPU:-}" ]; then
  nvidia-smi -L > "$OUT/gpus.txt" 2>&1
  if ! grep -q . "$OUT/gpus.txt" || grep -v -q -- "$REQUIRE_GPU" "$OUT/gpus.txt"; then
    echo "not run: REQUIRE_GPU=$REQUIRE_GPU, and not every GPU above is one"; exit 3
  fi
fi
left() { echo $(( ${BUDGET:-0} - ($(date +%s) - T0) )); }
budgeted() { if [ -n "${BUDGET:-}" ]; then timeout "$(left)" "$@"; else "$@"; fi; }
room() {  # room SECONDS ROW: false (and a line saying so) when BUDGET leaves less for ROW
  [ -z "${BUDGET:-}" ] || [ "$(left)" -ge "$1" ] && return 0
  log "skipped: ${*:2} (the budget leaves $(left) s, the row needs about $1 s)"; return 1
}
ndev() {  # the devices a part runs on: the simulated ones, or the host's GPUs
  if [ "${SCALE:-gpu}" = cpu ]; then echo "$CPU_DEVICES"; else nvidia-smi -L | wc -l; fi
}
torchao_path() {  # PYTHONPATH with torchao (its wheel in .carry/whl), or false and a line
  if ls .carry/whl/torchao-*.whl > /dev/null 2>&1 && [ ! -d /tmp/torchao_site/torchao ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao_site \
      .carry/whl/torchao-*.whl >&2
  fi
  if PYTHONPATH="/tmp/torchao_site:$PYTHONPATH" python3 -c "import torchao" 2>/dev/null; then
    echo "/tmp/torchao_site:$PYTHONPATH"; return 0
  fi
  echo "FSDP2 + torchao float8: not run (no torchao: put its wheel in .carry/whl)" >&2
  return 1
}
# The PyTorch peer, compiled, on the first N GPUs: peer OUT.json N [KEY=VALUE...]; its RESULT
# line as OUT.json (empty when it failed), the rest of its output as OUT.log.
peer() {
  local json=$1 n=$2; shift 2
  env PRESET="$PRESET_8B" SEQ="$SEQ_8B" MB=1 STEPS="$STEPS" "$@" COMPILE=1 timeout "$LIMIT" \
    torchrun --nproc_per_node="$n" benchmarks/torch_fsdp2.py > "${json%.json}.log" 2>&1
  sed -n 's/^RESULT //p' "${json%.json}.log" > "$json"
  local name; name=$(basename "$json" .json)
  if [ -s "$json" ]; then echo "[peer $name] $(python3 benchmarks/campaign_tables.py row "$json")"
  else echo "[peer $name] failed: $(grep -E 'Error|error' "${json%.json}.log" | tail -1)"; fi
}
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
    room 150 "breakdown $shape" || break
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
      room 120 "$tag" || break 2
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
  [ "${SCALE:-gpu}" = cpu ] && base="$base --cpu-devices $CPU_DEVICES"
  local mesh prof rings
  for mesh in ${TP_MESHES:-2:2:tp_gtp,tp_gtp_overlap 1:4:tp_gtp 4:1:tp,tp_overlap}; do
    set -- ${mesh//:/ }
    room 100 "tp_gtp tp$1 x gtp$2" || return 0
    # the ring variants traced on GPUs: how much of their communication the GEMMs hide
    rings=$(echo "$3" | tr ',' '\n' | grep overlap | paste -sd, -); prof=""
    [ "${SCALE:-gpu}" = cpu ] || [ -z "$rings" ] || \
      prof="--profile-dir $WORK/tp_profile --profile-variants $rings"
    log "tp$1 x gtp$2: $3"
    python3 -m gtp_jax.bench parallel $base --tp "$1" --gtp "$2" --variants "$3" $prof \
      --json "$OUT/tp${1}_gtp${2}.json" 2>&1 | grep -E "^\||^\[" | tail -8
  done
  [ "${TP_MICRO:-1}" = 1 ] && room 120 "the ring collective matmul alone" || return 0
  log "ring collective matmul alone against its GEMM budget, tp 4"
  python3 -m gtp_jax.bench parallel $base --tp 4 --micro --json "$OUT/tp4_micro.json" 2>&1 \
    | grep -E "^\||^\[" | tail -12
}

part_plan_rank() {
  local n; n=$(ndev)
  log "the planner on this host: $PRESET_TP, seq $SEQ_TP, batch 4, $n devices"
  python3 -m gtp_jax plan --preset "$PRESET_TP" --seq "$SEQ_TP" --batch 4 --gpus "$n" \
    --top "${PLAN_TOP:-1}" --limit 0 --json "$OUT/plan_rank.json" > "$OUT/plan_rank.log" 2>&1
  grep -E "^planned|^best|^error" "$OUT/plan_rank.log"
  python3 -m gtp_jax plan --on-paper --preset "$PRESET_TP" --seq "$SEQ_TP" --batch 4 \
    --gpus "$n" --memory-gib "${PAPER_GIB:-139}" --calibration "$CALIBRATION" --limit 0 \
    --json "$OUT/plan_rank_paper.json" > "$OUT/plan_rank_paper.log" 2>&1
  python3 benchmarks/campaign_tables.py rank "$OUT"
}

part_moe() {
  local run="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps $TRAIN_STEPS --moe-experts 8 --moe-top-k 2 --log-every 1"
  # Losses compared in float32 with every matmul at full precision: layouts whose GEMMs
  # round differently on GPUs (TF32 or bf16 passes) shift tokens across the capacity line.
  local MOE_PRECISION=${MOE_PRECISION:-highest}
  # ep dp gtp: ep1 (the reference; experts sharded by gtp, as replicated ones need 53 GiB a
  # GPU for the 1b preset's 4.7B parameters and more in float32), ep2 x gtp2, ep4
  for mesh in "1 1 4" "2 1 2" "4 1 1"; do
    set -- $mesh
    log "MoE, 8 experts top-2: ep$1 dp$2 gtp$3 (losses)"
    JAX_DEFAULT_MATMUL_PRECISION=$MOE_PRECISION python3 -m gtp_jax train $run --ep "$1" \
      --dp "$2" --gtp "$3" $DET --metrics-json "$OUT/moe_ep$1.json" > "$OUT/moe_ep$1.log" 2>&1
    grep -E "dropped|loss:" "$OUT/moe_ep$1.log" | tail -2
  done
  compare_losses "$OUT/moe_ep1.json" "$OUT/moe_ep2.json" "$OUT/moe_ep4.json"
  [ "${MOE_STEP:-1}" = 1 ] || return 0
  local base="--preset $PRESET_SMALL --seq $SEQ_SMALL --batch 8 --steps $STEPS --timeout $LIMIT --moe-experts 8 --moe-top-k 2"
  [ "${SCALE:-gpu}" = cpu ] && base="$base --cpu-devices $CPU_DEVICES"
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

# gtp_jax's step on the first N devices: jax_step OUT.json N [bench overlap options...]
# (gtp_dots: remat dots, the library's loop; on CPU N simulated devices, on GPUs the first N).
jax_step() {
  local json=$1 n=$2; shift 2
  local vis=(env XLA_FLAGS="--xla_force_host_platform_device_count=$n")
  [ "${SCALE:-gpu}" = cpu ] || vis=(env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))")
  "${vis[@]}" python3 -m gtp_jax.bench overlap --steps "$STEPS" --warmup 2 --timeout "$LIMIT" \
    --variants gtp_dots "$@" --json "$json" > "${json%.json}.log" 2>&1
  grep -E "^\[|Error" "${json%.json}.log" | tail -2
}
traced() {  # bench overlap's trace options on GPUs (nothing on CPU: no device kernels)
  [ "${SCALE:-gpu}" = cpu ] || echo "--profile-dir $WORK/profile_$1 --profile-variants gtp_dots"
}

part_fp8_full() {
  local n shape=${FP8_SHAPE:-${SEQ_8B}x1} recipe kind path
  n=$(ndev); local seq=${shape%x*} mb=${shape#*x}
  for recipe in ${FP8_RECIPES:-delayed}; do
    room 130 "fp8_full gtp_jax $recipe" || return 0
    log "FP8 compute ($recipe) fed by FP8 gathers, $PRESET_8B, $shape per device, $n devices"
    jax_step "$OUT/fp8full_gtp_$recipe.json" "$n" --preset "$PRESET_8B" --seq "$seq" \
      --per-device-batch "$mb" --fp8-compute "$recipe" --gather-format fp8 $FP8_MIN
  done
  if [ -z "$NOTORCH" ]; then
    for kind in ${FP8_PEERS:-float8}; do
      room 100 "fp8_full FSDP2 $kind" || break
      log "FSDP2 compiled, $kind, $shape per GPU"
      if [ "$kind" = float8 ]; then
        path=$(torchao_path) || continue
        peer "$OUT/fp8full_torch_$kind.json" "$n" SEQ="$seq" MB="$mb" FLOAT8=1 PYTHONPATH="$path"
      else
        peer "$OUT/fp8full_torch_$kind.json" "$n" SEQ="$seq" MB="$mb"
      fi
    done
  fi
  python3 benchmarks/campaign_tables.py fp8_full "$OUT"
}

part_eight() {
  local n row kind layout compute label opts shape
  n=$(ndev)
  python3 benchmarks/campaign_tables.py reference
  for shape in ${EIGHT_SHAPES:-${SEQ_8B}x1}; do
    local seq=${shape%x*} mb=${shape#*x}
    python3 -m gtp_jax plan --on-paper --preset "$PRESET_8B" --seq "$seq" --batch $((n * mb)) \
      --gpus "$n" --memory-gib "${PAPER_GIB:-139}" --calibration "$CALIBRATION" --limit 0 \
      --json "$OUT/eight_${shape}_paper.json" > "$OUT/eight_${shape}_paper.log" 2>&1
    # kind:layout:compute; gtp layout 0 = every device, 4 = dp (n/4) x gtp4; torch layout =
    # replicas (1: FSDP2, 2: HSDP), compute bf16 or float8 (torchao)
    local rows="gtp:0:bf16 torch:1:bf16 gtp:4:bf16 torch:2:bf16 gtp:0:fp8 torch:1:float8 gtp:4:fp8"
    for row in ${EIGHT_ROWS:-$rows}; do
      IFS=: read -r kind layout compute <<< "$row"
      label="eight_${shape}_${kind}${layout}_${compute}"
      if [ "$kind" = gtp ]; then
        room "$([ "$compute" = fp8 ] && echo 130 || echo 90)" "$label" || break
        opts=(--gtp "$layout" $(traced "$label"))  # bf16 rows traced: exposed communication
        [ "$compute" = fp8 ] && \
          opts=(--gtp "$layout" --fp8-compute delayed --gather-format fp8 $FP8_MIN)
        log "$label: gtp_jax, $PRESET_8B, $shape per device, gtp ${layout/#0/all} ($compute)"
        jax_step "$OUT/$label.json" "$n" --preset "$PRESET_8B" --seq "$seq" \
          --per-device-batch "$mb" "${opts[@]}"
      elif [ -z "$NOTORCH" ]; then
        room 100 "$label" || break
        log "$label: $([ "$layout" = 1 ] && echo FSDP2 || echo "HSDP, $layout replicas"), $compute"
        if [ "$compute" = float8 ]; then
          local path; path=$(torchao_path) || continue
          peer "$OUT/$label.json" "$n" SEQ="$seq" MB="$mb" REPLICATE="$layout" FLOAT8=1 \
            PYTHONPATH="$path"
        else
          peer "$OUT/$label.json" "$n" SEQ="$seq" MB="$mb" REPLICATE="$layout"
        fi
      fi
    done
  done
  python3 benchmarks/campaign_tables.py eight "$OUT"
}

part_scaling() {
  local n layers
  for n in ${SCALING_GPUS:-1 2 4 8}; do
    layers=(); [ "$n" = 1 ] && layers=(--layers "$SCALING_LAYERS_1")
    room 100 "scaling on $n devices" || break
    log "scaling: $PRESET_8B, ${SEQ_8B} x 1 per device, $n devices ${layers[*]}"
    jax_step "$OUT/scaling_${n}dev.json" "$n" --preset "$PRESET_8B" "${layers[@]}" \
      --seq "$SEQ_8B" --per-device-batch 1 $(traced "scaling_$n")
  done
  python3 benchmarks/campaign_tables.py scaling "$OUT"
}

part_layers_70b() {
  local n mesh layers base log; n=$(ndev)
  base="--preset $PRESET_70B --seq $SEQ_70B --batch $n --remat dots --steps ${STEPS_70B:-4}"
  base="$base --warmup 2 --timeout $LIMIT"
  [ "${SCALE:-gpu}" = cpu ] && base="$base --cpu-devices $CPU_DEVICES"
  for layers in $LAYERS_70B; do
    python3 -m gtp_jax plan --on-paper --preset "$PRESET_70B" --layers "$layers" \
      --seq "$SEQ_70B" --batch "$n" --gpus "$n" --memory-gib "${PAPER_GIB:-139}" \
      --calibration "$CALIBRATION" --limit 0 --json "$OUT/l70_paper_$layers.json" \
      > "$OUT/l70_paper_$layers.log" 2>&1
  done
  for mesh in 1:$n 2:$((n / 2)); do
    set -- ${mesh//:/ }
    for layers in $LAYERS_70B; do  # the most layers that run, largest first
      room 150 "layers_70b tp$1 x gtp$2, $layers layers" || break 2
      log "$PRESET_70B shape, $layers layers, seq $SEQ_70B, batch $n: tp$1 x gtp$2"
      log="$OUT/l70_tp${1}_gtp${2}.log"
      if python3 -m gtp_jax.bench parallel $base --layers "$layers" --tp "$1" --gtp "$2" \
          --variants tp_gtp --json "$OUT/l70_tp${1}_gtp${2}.json" > "$log" 2>&1; then
        grep -E "^\[" "$log" | tail -1; break
      fi
      echo "did not run with $layers layers: $(grep -E -i 'error|out of memory' "$log" | tail -1)"
      cp "$log" "$OUT/l70_tp${1}_gtp${2}_${layers}_failed.log"
    done
  done
  python3 benchmarks/campaign_tables.py layers_70b "$OUT"
}

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

for entry in $PARTS; do  # PART, or PART:SECONDS (started only while that much budget is left)
  part=${entry%%:*}; need=${entry#"$part"}; need=${need#:}
  if ! declare -F "part_$part" >/dev/null; then
    echo "unknown part '$part'; parts: $(declare -F | sed -n 's/.*part_//p' | tr '\n' ' ')"
    exit 2
  fi
  if [ -n "${BUDGET:-}" ] && [ "$(left)" -lt "${need:-30}" ]; then
    log "skip $part: the budget leaves $(left) s, it needs about ${need:-30} s"; continue
  fi
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
