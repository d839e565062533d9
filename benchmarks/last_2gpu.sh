#!/usr/bin/env bash
# The remaining 2-GPU rows in one call, each within what is left of BUDGET seconds: the
# command line's 50-step llama3-8b run with the preset's defaults (its losses), FP8 compute
# fed by FP8 gathers on the full llama3-8b at 8192 tokens per GPU (step, first step), a
# user's decoder on gtp_jax.Stack beside the bundled 1b decoder (like for like: XLA
# attention, no remat), and a cluster-started run whose process 1 is killed (campaign part
# `cluster`).   OUT=dir BUDGET=460 bash benchmarks/last_2gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/last}; mkdir -p "$OUT"
DEFAULT_BUDGET=460
. "$(dirname "$0")/budget.sh"
log "command line: llama3-8b, seq 8192, batch 2, 50 steps, the preset's defaults"
within 150 python3 -m gtp_jax train --preset llama3-8b --seq 8192 --batch 2 --steps 50 \
  --log-every 10 --log-dir "$OUT/cli" --metrics-json "$OUT/cli.json" > "$OUT/cli.log" 2>&1
grep -E "lr |compiled|step 50|step time|first step" "$OUT/cli.log" | head -6
python3 -c "
import json; s=json.load(open('$OUT/cli.json'))['steps']; L=[r['loss'] for r in s]
print('cli losses:', ' '.join(f'{x:.2f}' for x in L[:12]), '...', f'max {max(L):.2f} last5 {sum(L[-5:])/5:.3f}')" 2>&1 | tail -1
log "FP8 compute (delayed) with FP8 gathers, llama3-8b, 8192 x 1 per GPU"
within 160 python3 -m gtp_jax.bench overlap --preset llama3-8b --seq 8192 --per-device-batch 1 \
  --fp8-compute delayed --gather-format fp8 --steps 6 --warmup 2 --variants gtp_dots \
  --timeout 150 --json "$OUT/fp8_8b.json" 2>&1 | grep -E "^\[|^\| gtp"
log "a user's decoder on the stack beside the bundled 1b (XLA attention, no remat), 4 x 2048"
within 150 python3 -m gtp_jax.bench overlap --preset 1b --seq 2048 --per-device-batch 4 \
  --steps 10 --warmup 3 --attention xla --user-remat none --timeout 140 \
  --variants gtp,user_gtp,user_gtp_prefetch --json "$OUT/user_model.json" 2>&1 \
  | grep -E "^\[|^\| (gtp|user)"
log "cluster: one process per GPU started by hand, process 1 killed"
OUT="$OUT" PARTS=cluster VICTIMS=1 within 120 bash benchmarks/campaign.sh 2>&1 | tail -6
log done
