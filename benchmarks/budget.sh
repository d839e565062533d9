# Sourced by the one-call GPU scripts: `log` prints a line with the seconds since the start,
# `within SECONDS cmd...` runs cmd for at most SECONDS and never past the call's budget
# (BUDGET seconds from the start; the caller sets DEFAULT_BUDGET), skipping it when less than
# 20 s are left.
T0=$(date +%s); END=$((T0 + ${BUDGET:-${DEFAULT_BUDGET:-560}}))
log() { echo "== t=$(( $(date +%s) - T0 ))s $*"; }
within() { local left=$((END - $(date +%s))); [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 20 ] && { echo "skipped: budget spent"; return 1; }; timeout "$left" "${@:2}"; }
