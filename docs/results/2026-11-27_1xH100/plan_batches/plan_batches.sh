# Planning time of --top 1 under a tight budget, the planner before and after batching its
# compiles 3 at a time on a GPU host (same machine, calibration measured first and cached).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
ARGS="--preset 1b --gpus 1 --seq 4096 --batch 4 --memory-gib ${GIB:-20} --top 1 --limit 12"
python3 -m gtp_jax plan $ARGS --calibrate 2>&1 | grep -v "^W1\|^I1" | tail -16
cp gtp_jax/plan/planner.py /tmp/planner_after.py
cp .carry/planner_before.py gtp_jax/plan/planner.py
sed -i 's/from gtp_jax.plan.planner import Candidate, Plan, format_table, plan, plan_fitting/from gtp_jax.plan.planner import Candidate, Plan, format_table, plan\nplan_fitting = plan/' gtp_jax/plan/__init__.py
echo "== before"
python3 -m gtp_jax plan $ARGS --offload off 2>&1 | grep -v "^W1\|^I1" | tail -16
cp /tmp/planner_after.py gtp_jax/plan/planner.py; git checkout gtp_jax/plan/__init__.py
echo "== after"
python3 -m gtp_jax plan $ARGS --offload off 2>&1 | grep -v "^W1\|^I1" | tail -16
