#!/usr/bin/env bash
# Usage: bootstrap.sh STEP... Runs STEP.sh (beside this file) in order, logging to
# $GPU_SWARM_LOG and recording each step's seconds and status (done|skipped|failed) in
# bootstrap-timings.json. Stops at the first failure, naming it in bootstrap-failed;
# writes bootstrap-done when all succeed.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
steps_dir=${GPU_SWARM_STEPS:-$(dirname "${BASH_SOURCE[0]}")}
state=$GPU_SWARM_STATE
timings=()

now_us() { echo "${EPOCHREALTIME/[.,]/}"; }

run_step() { # NAME SCRIPT
  local status="done" rc=0 t0 us
  STEP_STATUS_FILE=$(mktemp)
  export STEP_STATUS_FILE
  log "== $1: start" >>"$GPU_SWARM_LOG"
  t0=$(now_us)
  bash "$2" >>"$GPU_SWARM_LOG" 2>&1 || rc=$?
  us=$(($(now_us) - t0))
  if ((rc)); then status=failed; elif [ -s "$STEP_STATUS_FILE" ]; then status=skipped; fi
  rm -f "$STEP_STATUS_FILE"
  timings+=("$(printf '"%s": {"seconds": %d.%03d, "status": "%s"}' "$1" $((us / 1000000)) $((us % 1000000 / 1000)) "$status")")
  (IFS=,; printf '{%s}\n' "${timings[*]}") >"$state/timings.tmp"
  mv "$state/timings.tmp" "$state/bootstrap-timings.json"
  log "== $1: $status in $((us / 1000))ms (exit $rc)" | tee -a "$GPU_SWARM_LOG"
  return "$rc"
}

mkdir -p "$(dirname "$GPU_SWARM_LOG")" "$state"
exec 9>"$state/bootstrap.lock"
flock -n 9 || die "another bootstrap holds $state/bootstrap.lock"
for step in "$@"; do
  [ -f "$steps_dir/$step.sh" ] || die "unknown step '$step': no $steps_dir/$step.sh"
done
rm -f "$state/bootstrap-done" "$state/bootstrap-failed"
for step in "$@"; do
  if ! run_step "$step" "$steps_dir/$step.sh"; then
    echo "$step" >"$state/bootstrap-failed"
    echo "bootstrap step $step failed; end of $GPU_SWARM_LOG:" >&2
    tail -n 30 "$GPU_SWARM_LOG" >&2
    exit 1
  fi
done
log "bootstrap done: $*" | tee -a "$GPU_SWARM_LOG" >"$state/bootstrap-done"
