export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for att in xla cudnn; do
 for v in gtp gtp_prefetch; do
  echo "== $v $att"; timeout 100 python3 -X faulthandler -m gtp_jax.bench overlap --worker $v --preset 1b --layers 2 --steps 3 --warmup 1 --attention $att 2>&1 | grep -v -i deprecat | grep -E "RESULT|File|Fatal|Error|error|Segmentation" | head -30
 done
done
echo "== gtp tiny"; timeout 60 python3 -X faulthandler -m gtp_jax.bench overlap --worker gtp --preset tiny --seq 128 --steps 3 --warmup 1 --attention xla 2>&1 | grep -E "RESULT|File|Fatal|Error" | head -30
