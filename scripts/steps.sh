# shellcheck shell=bash
# Sourced by scripts/setup.sh and localswarm/install-engine.sh. A first setup takes a minute
# or two, so each step says when it starts and how long it took; the tools' own output stays
# in a file that is shown only when they fail, because then the error is in it.
# The sourcing script sets STEP_PREFIX (the word each line starts with) and STEP_COUNT.
STEP_NUMBER=0 STEP_TITLE="" STEP_T0=0

say() { printf '%s: %s\n' "$STEP_PREFIX" "$*"; }

now_us() { echo "${EPOCHREALTIME/[.,]/}"; }  # the separator follows the locale

step_seconds() {  # since step_begin, as 12.3
  local us=$(($(now_us) - STEP_T0))
  printf '%d.%d' $((us / 1000000)) $((us % 1000000 / 100000))
}

step_begin() {  # step_begin TITLE
  STEP_NUMBER=$((STEP_NUMBER + 1))
  STEP_TITLE="[$STEP_NUMBER/$STEP_COUNT] $1"
  STEP_T0=$(now_us)
  say "$STEP_TITLE ..."
}

step_done() { say "$STEP_TITLE: done in $(step_seconds) s"; }

step_skipped() {  # step_skipped WHY: the work was already done
  say "$STEP_TITLE: skipped in $(step_seconds) s ($1)"
}

# quietly [--show REGEX] [--log FILE] COMMAND...: runs an external COMMAND with its output in
# FILE (kept for the caller) or a temp file, passing on as it comes only the lines that match
# REGEX. When COMMAND fails, prints all of its output on stderr and returns its status.
quietly() {
  local show="" log="" rc=0
  while [ "${1:-}" = --show ] || [ "${1:-}" = --log ]; do
    if [ "$1" = --show ]; then show=$2; else log=$2; fi
    shift 2
  done
  local out=${log:-$(mktemp)}
  if "$@" 2>&1 | tee "$out" | show_lines "$show"; then
    :
  else
    rc=${PIPESTATUS[0]}
    say "$STEP_TITLE: failed in $(step_seconds) s: '$*' exited with $rc; its output:" >&2
    sed 's/^/    /' "$out" >&2
  fi
  if [ -z "$log" ]; then rm -f "$out"; fi
  return "$rc"
}

show_lines() {  # show_lines REGEX: stdin's lines that match, indented under the step's line
  if [ -z "$1" ]; then cat >/dev/null; return; fi
  { grep -E --line-buffered "$1" || true; } | sed -u "s/^ */$STEP_PREFIX:   /"
}

mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }  # mb BYTES
