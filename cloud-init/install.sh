#!/usr/bin/env bash
# gpu-swarm-install: make this node run the release that release.env names.
# cloud-init runs it at first boot (runcmd); `pulumi up` runs it again, as the transient
# unit gpu-swarm-install, when the release changes (to_node/commands.py upgrade()). One path for
# both: download the node software bundle, check it against the sha256 the program pinned,
# install it under /opt/gpu-swarm/software, run its bootstrap steps (each skips what the
# image already has), and record the release. Exit 0: applied; 1: failed, with the failed
# step's name in bootstrap-failed and the reason in the log.
set -euo pipefail
# Paths as node/common.sh has them; the tests point them into a scratch folder.
: "${GPU_SWARM_RELEASE_ENV:=/etc/gpu-swarm/release.env}" "${GPU_SWARM_SOFTWARE:=/opt/gpu-swarm/software}"
: "${GPU_SWARM_STATE:=/var/lib/gpu-swarm}" "${GPU_SWARM_LOG:=/var/log/gpu-swarm/bootstrap.log}"
export GPU_SWARM_STATE GPU_SWARM_LOG
state=$GPU_SWARM_STATE software=$GPU_SWARM_SOFTWARE
mkdir -p "$state" "$(dirname "$GPU_SWARM_LOG")" "$(dirname "$software")"
say() { printf '%s gpu-swarm-install: %s\n' "$(date -u +%FT%TZ)" "$*" | tee -a "$GPU_SWARM_LOG" >&2; }
fail() { # STEP MESSAGE
  say "ERROR: $2"
  rm -f "$state/bootstrap-done"
  echo "$1" >"$state/bootstrap-failed"
  exit 1
}
# shellcheck source=/dev/null
. "$GPU_SWARM_RELEASE_ENV" || fail release-env "cannot read $GPU_SWARM_RELEASE_ENV"
url=${GPU_SWARM_BUNDLE_URL:?} sha=${GPU_SWARM_BUNDLE_SHA256:?} steps=${GPU_SWARM_STEPS:?} release=${GPU_SWARM_RELEASE:?}
rm -f "$state/bootstrap-done" "$state/bootstrap-failed"
now_us() { echo "${EPOCHREALTIME/[.,]/}"; }
t0=$(now_us)
status="done"
if [ "$(cat "$software/.bundle" 2>/dev/null || true)" = "$sha" ]; then
  say "bundle ${sha:0:12} is installed"
  status=skipped
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  say "downloading $url"
  # A new subnet's route to the S3 endpoint can take a little while: keep trying, bounded.
  curl -fsS --retry 12 --retry-delay 5 --retry-all-errors --connect-timeout 10 --max-time 120 \
    -o "$tmp/bundle.tar" "$url" 2>>"$GPU_SWARM_LOG" || fail fetch-bundle "cannot download the node software from $url"
  got=$(sha256sum "$tmp/bundle.tar" | cut -d' ' -f1)
  # Nothing of it runs before this check: the program pinned the sha256 in the user data.
  [ "$got" = "$sha" ] || fail fetch-bundle "the bundle from $url has sha256 $got, expected $sha"
  rm -rf "$software.new" "$software.old"
  mkdir -p "$software.new"
  tar -C "$software.new" --no-same-owner -xf "$tmp/bundle.tar"
  echo "$sha" >"$software.new/.bundle"
  if [ -e "$software" ]; then mv "$software" "$software.old"; fi
  mv "$software.new" "$software"
  rm -rf "$software.old"
  say "installed bundle ${sha:0:12}"
fi
us=$(($(now_us) - t0))
printf '{"fetch-bundle": {"seconds": %d.%03d, "status": "%s"}}\n' $((us / 1000000)) $((us % 1000000 / 1000)) \
  "$status" >"$state/install-timings.json"
# sshd reads its settings (sshd.conf, written with this file) at start: at first boot it starts after them,
# after an upgrade it is told to read them again (the sessions it holds stay open).
if systemctl is-active -q ssh 2>/dev/null; then systemctl reload ssh || :; fi
# shellcheck disable=SC2086 # the steps are words
bash "$software/bootstrap.sh" $steps || exit 1 # bootstrap.sh names the failed step
echo "$release" >"$state/applied"
say "release ${release:0:12} applied"
