# The planner's offload prediction against measured steps on this host: calibrate (the
# trainer's offloaded update, timed in its program), plan the 1b preset with the optimizer
# offloaded and on the device, then train each plan's best layout for 12 steps.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
P="--preset 1b --seq 2048 --batch 4"
python3 -m gtp_jax plan $P --gpus 1 --calibrate --offload on --top 1 --limit 3 2>&1 | grep -v "^W1\|^I1" | tail -8 | tee /tmp/plan_on.txt
python3 -m gtp_jax plan $P --gpus 1 --offload off --top 1 --limit 3 2>&1 | grep -v "^W1\|^I1" | tail -8 | tee /tmp/plan_off.txt
for f in on off; do
  cmd=$(grep "^best: " /tmp/plan_$f.txt | sed 's/^best: //; s/python -m/python3 -m/')
  echo "== $cmd --steps 12"
  $cmd --steps 12 2>&1 | grep -E "step time|memory per device|Error|error" | head -4
done
