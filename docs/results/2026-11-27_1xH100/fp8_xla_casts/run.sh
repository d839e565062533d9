# The FP8 blocks with the FP8 matmul's amax and casts as XLA ops (FP8_XLA=1: the
# sitecustomize.py beside this script) against the Pallas kernels, in one call. Run from
# the repository root: OUT=dir bash docs/results/2026-11-27_1xH100/fp8_xla_casts/run.sh
# (it ran as .carry/fp8xla/run.sh, with the sitecustomize.py in .carry/fp8xla).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$(dirname "$0")" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m gtp_jax.bench fp8 --layers 4 --rows blocks_bf16,blocks_fp8_delayed,blocks_fp8 --json $OUT/pallas.json 2>&1 | grep -v "^W1\|^I1" | tail -8
FP8_XLA=1 python3 -m gtp_jax.bench fp8 --layers 4 --rows blocks_fp8_delayed,blocks_fp8 --json $OUT/xla.json 2>&1 | grep -v "^W1\|^I1" | tail -8
