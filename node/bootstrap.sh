#!/usr/bin/env bash
# Usage: bootstrap.sh STEP... Runs STEP.sh (beside this file) in order, logging to
# $GPU_SWARM_LOG and recording each step's seconds and status (done|skipped|failed) in
# bootstrap-timings.json. Stops at the first failure, naming it in bootstrap-failed;
# writes bootstrap-done when all succeed.
#
# A STEP written NAME& is a head start: it runs in the background, and the next step starts at
# once. It is for work that needs nothing the steps before it make, and that a later step does
# again in the foreground, waiting for it (install-agent-venv: the agent's wheels, downloaded and
# installed, which install-gpu-agent needs). So its failure is recorded and fails nothing by itself. Bootstrap waits
# for it before it ends, either way.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
steps_dir=${GPU_SWARM_STEPS:-$(dirname "${BASH_SOURCE[0]}")}
state=$GPU_SWARM_STATE
records=$state/steps  # one record a step, written when it ends: a background step ends in its own time
background=()         # PIDs of the background steps

now_us() { echo "${EPOCHREALTIME/[.,]/}"; }

# The records of the steps that have ended, in the order of the command line.
write_timings() {
  local step name entries=() tmp
  for step in "$@"; do
    name=${step%&}
    if [ -f "$records/$name" ]; then entries+=("$(<"$records/$name")"); fi
  done
  tmp=$(mktemp "$state/timings.XXXXXX")
  (IFS=,; printf '{%s}\n' "${entries[*]}") >"$tmp"
  chmod 0644 "$tmp"
  mv "$tmp" "$state/bootstrap-timings.json"
}

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
  printf '"%s": {"seconds": %d.%03d, "status": "%s"}' "$1" $((us / 1000000)) $((us % 1000000 / 1000)) "$status" \
    >"$records/$1"
  log "== $1: $status in $((us / 1000))ms (exit $rc)" | tee -a "$GPU_SWARM_LOG"
  return "$rc"
}

# One systemd reload for every unit that a step enabled (run_unit in common.sh).
reload_once() {
  if [ -e "$state/reload-pending" ]; then
    systemctl daemon-reload
    rm -f "$state/reload-pending"
  fi
}

# Waits for the background steps, whose failures the steps after them made good (see above).
wait_background() {
  local pid
  for pid in "${background[@]}"; do wait "$pid" || :; done
}

mkdir -p "$(dirname "$GPU_SWARM_LOG")" "$state"
exec 9>"$state/bootstrap.lock"
flock -n 9 || die "another bootstrap holds $state/bootstrap.lock"
for step in "$@"; do
  [ -f "$steps_dir/${step%&}.sh" ] || die "unknown step '${step%&}': no $steps_dir/${step%&}.sh"
done
rm -f "$state/bootstrap-done" "$state/bootstrap-failed"
rm -rf "$records"
mkdir -p "$records"
for step in "$@"; do
  name=${step%&}
  if [ "$name" != "$step" ]; then
    run_step "$name" "$steps_dir/$name.sh" &
    background+=("$!")
    continue
  fi
  if ! run_step "$name" "$steps_dir/$name.sh"; then
    wait_background
    reload_once || :
    write_timings "$@"
    echo "$name" >"$state/bootstrap-failed"
    echo "bootstrap step $name failed; end of $GPU_SWARM_LOG:" >&2
    tail -n 30 "$GPU_SWARM_LOG" >&2
    exit 1
  fi
  write_timings "$@"
done
wait_background
reload_once
write_timings "$@"
log "bootstrap done: $*" | tee -a "$GPU_SWARM_LOG" >"$state/bootstrap-done"
