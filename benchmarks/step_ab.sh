#!/usr/bin/env bash
# The 1b step on the GPUs found, as it is and under each named setting in SETS (extra XLA
# flags and/or extra `bench overlap` options), alternating in one call (compute-only and
# gtp_jax at gtp = all GPUs, remat dots, seq 2048, 4 sequences per GPU); then a kernel
# breakdown of the gtp_jax step under each setting (kernels_<name>.md: fusions named by HLO
# shape and JAX source). TORCH=1 adds the compiled PyTorch FSDP2 peer to every round.
# Usage: OUT=dir SETS="name|XLA flags|bench options|ENV=value ...;name2|...|...|..." \
#        ROUNDS=2 TORCH=0|1 BASE_OPTS="bench options for every set" \
#        PROFILE_SETS="name ..."|none PROFILE_VARIANTS="gtp_dots ..." bash benchmarks/step_ab.sh
# e.g.   SETS="scanned||--no-unroll-layers;dsf|--xla_gpu_enable_dynamic_slice_fusion=true|"
#        SETS="nch4|||NCCL_MAX_NCHANNELS=4" PROFILE_SETS=none
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/step_ab}; ROUNDS=${ROUNDS:-2}; mkdir -p "$OUT"
SETS=${SETS:-"scanned||--no-unroll-layers"}
VARIANTS=${VARIANTS:-compute_only_dots,gtp_dots}
PROFILE_VARIANTS=${PROFILE_VARIANTS:-gtp_dots}
ARGS="--preset 1b --seq 2048 --per-device-batch 4 --steps 30 --warmup 3 --timeout 300"
BASE_FLAGS=${XLA_FLAGS:-}
T0=$(date +%s)
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
IFS=';' read -r -a ALL <<< "default||;$SETS"
if [ -z "${PROFILE_SETS:-}" ]; then  # default: every set but "default"
  PROFILE_SETS=""; for s in "${ALL[@]:1}"; do PROFILE_SETS="$PROFILE_SETS ${s%%|*}"; done
fi
run() {  # run NAME FLAGS OPTIONS ENVS JSON [extra bench args...]
  local name=$1 flags=$2 opts=$3 envs=$4 json=$5; shift 5
  env $envs XLA_FLAGS="$BASE_FLAGS $flags" python3 -m gtp_jax.bench overlap $ARGS \
    ${BASE_OPTS:-} $opts "$@" --json "$json" 2>&1 | grep -E "^\[|Error"
}
for round in $(seq 1 "$ROUNDS"); do
  for s in "${ALL[@]}"; do
    IFS='|' read -r name flags opts envs <<< "$s"
    log "$name round $round: flags [$flags] options [$opts] env [$envs]"
    run "$name" "$flags" "$opts" "$envs" "$OUT/step_${name}_${round}.json" \
      --variants "$VARIANTS"
  done
  if [ "${TORCH:-0}" = 1 ]; then
    log "torch FSDP2 compiled round $round"
    COMPILE=1 PRESET=1b SEQ=2048 MB=4 STEPS=30 timeout 300 \
      torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" benchmarks/torch_fsdp2.py 2>&1 \
      | grep -E "^RESULT|Error" | tee -a "$OUT/torch_1b.jsonl"
  fi
done
GEMM_TFLOP=$(python3 -c "
from gtp_jax.models import preset
c = preset('1b'); L, d, f, v = c.n_layers, c.d_model, c.d_ff, c.vocab_size
print(6 * (L * (4 * d * d + 3 * d * f) + v * d) * 4 * 2048 / 1e12)")
for s in "${ALL[@]}"; do
  IFS='|' read -r name flags opts envs <<< "$s"
  case " $PROFILE_SETS " in *" $name "*) ;; *) continue ;; esac
  for variant in $PROFILE_VARIANTS; do
    prof=/tmp/gtp_prof_ab/$name; rm -rf "$prof"; dump="$prof/hlo"; mkdir -p "$dump"
    log "kernels $variant under $name"
    run "$name" "$flags --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
      "$opts" "$envs" "$prof/step.json" --steps 5 --variants "$variant" \
      --profile-dir "$prof" --profile-variants "$variant"
    python3 -m gtp_jax.bench.kernels "$prof/$variant" --steps 3 \
      --gemm-tflop "$GEMM_TFLOP" --top 40 --hlo "$dump" \
      --json "$OUT/kernels_${name}_${variant}.json" > "$OUT/kernels_${name}_${variant}.md"
    head -12 "$OUT/kernels_${name}_${variant}.md"
  done
done
log done
