#!/usr/bin/env bash
# FP8 compute on one GPU, side by side in one call: gtp_jax's Llama-3-8B-shaped blocks in
# bf16 and with fp8_compute="tensorwise" and "delayed" plus the GEMM size sweep (python -m gtp_jax.bench
# fp8), then the torchao float8 peer on the same blocks (benchmarks/torch_fp8_blocks.py,
# torch.compile; needs torchao: carry its wheel in .carry/whl).
# With PROFILE=1, three steps of each blocks row are traced and their kernel time by
# category (python -m gtp_jax.bench.kernels) goes to $OUT/kernels.log.
# Writes $OUT/fp8.json, $OUT/fp8_min4096.json, $OUT/fp8.log, $OUT/torch_fp8.log.
# Usage: OUT=dir [LAYERS=4] [RECIPES=bf16,tensorwise] [PROFILE=1] [ROWS=...] bash benchmarks/fp8.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-runs/fp8}; mkdir -p "$OUT"
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
TRACES=/tmp/gtp_jax_fp8_traces
python3 -m gtp_jax.bench fp8 --layers "${LAYERS:-4}" --json "$OUT/fp8.json" \
  ${ROWS:+--rows "$ROWS"} ${PROFILE:+--profile-dir "$TRACES"} 2>&1 \
  | grep -v -i deprecat | tee "$OUT/fp8.log"
for row in blocks_bf16 blocks_fp8 blocks_fp8_delayed; do
  [ -d "$TRACES/$row" ] || continue
  echo "== $row"
  python3 -m gtp_jax.bench.kernels "$TRACES/$row" --steps 3 --top 30 \
    --hlo "$TRACES/$row/step.hlo.txt"
done > "$OUT/kernels.log" 2>&1
# the kv projection (4096 -> 2048) in bf16, every other projection in FP8
python3 -m gtp_jax.bench fp8 --layers "${LAYERS:-4}" --rows blocks_fp8 --fp8-min-features 4096 \
  --json "$OUT/fp8_min4096.json" 2>&1 | grep -E '^\|' | tee -a "$OUT/fp8.log"
if ls .carry/whl/torchao-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao_site \
    .carry/whl/torchao-*.whl
fi
LAYERS=${LAYERS:-4} RECIPES=${RECIPES:-bf16,tensorwise} PYTHONPATH="/tmp/torchao_site:$PWD" \
  timeout "${TORCH_TIMEOUT:-300}" python3 benchmarks/torch_fp8_blocks.py 2>&1 \
  | grep -E "^torch|Error" | tee "$OUT/torch_fp8.log"
