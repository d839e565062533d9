#!/usr/bin/env bash
# How long a preempted run takes to stop: the 1b preset trains on one GPU with the
# requeue-safe command; after step STOP_AT (default 20) it gets SIGTERM; the script reports
# the seconds from the signal to the process's exit, its status and the checkpoint it left,
# then runs the same command again (the requeue) for a few steps and reports its first step.
# Usage: OUT=dir [PRESET=1b] [STOP_AT=20] bash benchmarks/preempt.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/preempt}; mkdir -p "$OUT"
PRESET=${PRESET:-1b}; STOP_AT=${STOP_AT:-20}
CK=$(mktemp -d /tmp/gtp_jax_preempt_XXXX)/ck
CMD=(python3 -m gtp_jax train --preset "$PRESET" --seq 2048 --batch 4 --gtp 1 --dp 1
     --steps 1000 --log-every 1 --checkpoint-dir "$CK" --resume auto)
"${CMD[@]}" > "$OUT/first.log" 2>&1 &
pid=$!
until grep -q " step $STOP_AT/" "$OUT/first.log" 2>/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "the run ended before step $STOP_AT"; tail -5 "$OUT/first.log"; exit 1; }
  sleep 0.2
done
t0=$(date +%s.%N); kill -TERM $pid; wait $pid; status=$?; t1=$(date +%s.%N)
echo "SIGTERM after step $STOP_AT: exit status $status after $(python3 -c "print(round($t1 - $t0, 1))") s"
grep -E "stopped by|received" "$OUT/first.log" | tail -2
ls "$CK"
timeout 300 python3 -m gtp_jax train --preset "$PRESET" --seq 2048 --batch 4 --gtp 1 --dp 1 \
  --steps $((STOP_AT + 10)) --log-every 1 --checkpoint-dir "$CK" --resume auto > "$OUT/requeue.log" 2>&1
echo "requeue: exit status $?"; grep -i -m1 "resum" "$OUT/requeue.log"
grep -m1 -E " step [0-9]+/" "$OUT/requeue.log"  # its first step: the one after the checkpoint
