# Partial optimizer offload on one GPU: plan the 1b preset under two budgets that the
# on-device state does not fit, with the optimizer offloaded (the planner then keeps what
# fits of the moments on the device), and train, for 12 steps each, the planned layout,
# the same layout fully offloaded and the same layout with the state on the device.
# Run from the repository root: bash docs/results/2026-11-27_1xH100/partial_offload/partial_offload.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/partial_offload}
mkdir -p "$OUT"
P="--preset 1b --seq 2048 --batch 4"
quiet() { grep -v "^W1\|^I1\|^E1"; }
for gib in 16 15; do
  cal=""; [ "$gib" = 16 ] && cal="--calibrate"
  echo "== plan under $gib GiB"
  python3 -m gtp_jax plan $P --gpus 1 $cal --offload on --memory-gib $gib --top 1 --limit 4 \
    --json "$OUT/plan_$gib.json" 2>&1 | quiet | tail -9
done
python3 - "$OUT" > "$OUT/commands.txt" <<'PY'
import json, sys
out = sys.argv[1]
base = "python3 -m gtp_jax train --preset 1b --seq 2048 --batch 4 --steps 12"
seen = []
for gib in (16, 15):
    best = json.load(open(f"{out}/plan_{gib}.json"))["candidates"][0]
    flags = best["flags"]
    full = flags.split(" --offload-exclude")[0]
    for f in (flags, full, full.replace(" --offload-optimizer", "")):
        if f not in seen:
            seen.append(f)
for f in seen:
    print(f"{base} {f}")
PY
while read -r cmd; do
  echo "== $cmd"
  eval "$cmd" 2>&1 | quiet | grep -E "optimizer state|loss: first|step time|memory per device|rror" | head -6
done < "$OUT/commands.txt"
