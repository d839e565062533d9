#!/usr/bin/env bash
# Optimizer state in host memory (--offload-optimizer) against on the device, on ONE GPU
# (GTP=2: on two, the weights and state sharded over both), in one call (about 6 to 12
# minutes on an H200):
#   1. the 1b preset at seq 2048 (4 sequences): step time, peak device memory after init and
#      over the run, and the loss of both runs (the same seed);
#   2. the largest preset that trains at seq 4096 (1 sequence per GPU, remat full) with and
#      without offload: the presets are tried largest first, the first that completes its
#      steps wins. BIG lists them; PRESET:LAYERS is the preset with that many layers
#      (train --layers), for a model larger than the largest preset.
# With PROFILE=1, steps 6-8 of the offloaded run of part 1 are traced and its host <-> device
# copies timed (python -m gtp_jax.bench.trace --host: each direction, both at once, hidden
# by compute) into $OUT/host_copies.log.
# MODES picks the runs of both parts: device (--no-offload-optimizer), offload
# (--offload-optimizer) and master (--offload-optimizer --offload-master-weights: the float32
# parameters in host memory too); default "device offload".
# Usage: OUT=dir [PROFILE=1] [BIG=""] [MODES="device offload master"] bash benchmarks/offload.sh
# Reduced run on a CPU (checks the script, no memory figures):
#   SMALL=tiny SEQ1=32 BIG="tiny" SEQ2=64 STEPS=2 bash benchmarks/offload.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/offload}; mkdir -p "$OUT"
GTP=${GTP:-1}  # the GPUs the runs shard over (gtp; dp 1)
SMALL=${SMALL:-1b}; SEQ1=${SEQ1:-2048}; BATCH1=${BATCH1:-$((4 * GTP))}; STEPS=${STEPS:-15}
BIG=${BIG-"llama3-8b llama3.2-3b 1b"}; SEQ2=${SEQ2:-4096}; BIG_STEPS=${BIG_STEPS:-4}
LIMIT=${LIMIT:-240}  # seconds per run (compile and the host-memory state included; an
# offloaded llama3-8b builds 52 GB of moments in host memory; out-of-memory runs end sooner)
MODES=${MODES:-"device offload"}
flags_of() {
  case $1 in
    device) echo --no-offload-optimizer ;;
    offload) echo --offload-optimizer ;;
    master) echo --offload-optimizer --offload-master-weights ;;
    *) echo "unknown mode $1 (device offload master)" >&2; exit 2 ;;
  esac
}
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
# "memory per device after init": the peak before step 1 (model and optimizer built); the
# summary's "memory per device": the peak of the whole run.
report() { grep -E "loss: first|step time|memory per device|out of memory|RESOURCE_EXHAUSTED|Error" \
             "$1" | head -7; }

for mode in $MODES; do
  flags=$(flags_of "$mode") || exit 2
  log "$SMALL seq $SEQ1 batch $BATCH1 $mode: $flags"
  trace=()
  [ -n "${PROFILE:-}" ] && [ "$mode" = offload ] && \
    trace=(--profile-dir "$OUT/trace" --profile-steps 6:8)
  timeout "$LIMIT" python3 -m gtp_jax train --preset "$SMALL" --seq "$SEQ1" \
    --batch "$BATCH1" --steps "$STEPS" --gtp "$GTP" --dp 1 $flags "${trace[@]}" \
    > "$OUT/small_$mode.log" 2>&1
  echo "exit $?"; report "$OUT/small_$mode.log"
done
if [ -n "${PROFILE:-}" ]; then
  python3 -m gtp_jax.bench.trace "$OUT/trace" --steps 3 --host 2>&1 | tee "$OUT/host_copies.log"
  python3 - "$OUT/trace" <<'PY' 2>&1 | tee -a "$OUT/host_copies.log"
import collections, sys
from gtp_jax.bench.trace import find_trace, load_events
totals = collections.Counter()
for e in load_events(find_trace(sys.argv[1])):  # what the copies are called in this trace
    if e.get("ph") == "X" and "emcpy" in e.get("name", ""):
        totals[e["name"][:60]] += float(e.get("dur", 0)) / 3e3
for name, ms in totals.most_common(8):
    print(f"{name}: {ms:.2f} ms/step")
PY
  python3 -m gtp_jax.bench.kernels "$OUT/trace" --steps 3 --top 25 2>&1 \
    | tee "$OUT/kernels.log" | head -45
  rm -rf "$OUT/trace"  # hundreds of MB; the tables above are what is kept
fi
# GPU training is not bitwise reproducible run to run (atomic reductions), so equal losses
# are not expected here; tests/test_offload.py checks bit-identity on the CPU backend (and
# tests/test_master_weights.py master weights against the mixed-precision reference).
for mode in $MODES; do
  echo "loss, $mode: $(grep "loss: first" "$OUT/small_$mode.log")"
done

for mode in $MODES; do
  flags=$(flags_of "$mode") || exit 2
  fits=none
  for p in $BIG; do
    layers=()
    case $p in *:*) layers=(--layers "${p#*:}") ;; esac
    log "$p seq $SEQ2 batch $GTP remat full $mode: $flags"
    timeout "$LIMIT" python3 -m gtp_jax train --preset "${p%%:*}" "${layers[@]}" --seq "$SEQ2" \
      --batch "$GTP" --steps "$BIG_STEPS" --remat full --gtp "$GTP" --dp 1 $flags \
      > "$OUT/big_${p/:/_L}_$mode.log" 2>&1
    rc=$?; echo "exit $rc"; report "$OUT/big_${p/:/_L}_$mode.log"
    if [ "$rc" = 0 ]; then fits=$p; break; fi
  done
  echo "largest preset at seq $SEQ2, $mode: $fits"
done
log done
