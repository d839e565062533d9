#!/usr/bin/env bash
# The trainer's layer loops on simulated CPU devices (8 over the host's cores), with the CPU
# scheduler gtp_jax sets (memory-ordered) and with XLA's own (concurrency-ordered), in
# fresh processes, REPEATS times each; prints the median step time of each cell.
#   OUT=dir bash benchmarks/cpu_loops.sh        (LAYERS="2 6", REPEATS=3, STEPS=30)
set -euo pipefail
OUT=${OUT:-cpu_loops}; LAYERS=${LAYERS:-"2 6"}; REPEATS=${REPEATS:-3}; STEPS=${STEPS:-30}
mkdir -p "$OUT"
: > "$OUT/runs.txt"
for r in $(seq "$REPEATS"); do
  for l in $LAYERS; do
    for loop in "--unroll-layers" "--no-unroll-layers" "--no-unroll-layers --prefetch"; do
      for sched in gtp_jax xla; do
        flags=""; [ "$sched" = xla ] && flags="--xla_cpu_enable_concurrency_optimized_scheduler=true"
        # shellcheck disable=SC2086
        ms=$(XLA_FLAGS="$flags" python -m gtp_jax train --steps "$STEPS" --layers "$l" \
             --compile-cache off $loop 2>&1 | grep -oE "step time: [0-9.]+" | grep -oE "[0-9.]+$")
        echo "$l|$loop|$sched|$ms" >> "$OUT/runs.txt"
      done
    done
  done
done
python - "$OUT/runs.txt" <<'PY' | tee "$OUT/table.md"
import collections, statistics, sys
cells = collections.defaultdict(list)
for line in open(sys.argv[1]):
    layers, loop, sched, ms = line.strip().split("|")
    cells[(int(layers), loop, sched)].append(float(ms))
print("| layers | loop | ms, gtp_jax's CPU scheduler | ms, XLA's | ratio |")
print("| --- | --- | --- | --- | --- |")
for (layers, loop, sched), ms in sorted(cells.items()):
    if sched == "xla":
        continue
    mine, xla = statistics.median(ms), statistics.median(cells[(layers, loop, "xla")])
    print(f"| {layers} | `{loop}` | {mine:.1f} | {xla:.1f} | {mine / xla:.2f}x |")
PY
