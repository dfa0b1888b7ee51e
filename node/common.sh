# shellcheck shell=bash source-path=SCRIPTDIR
# Sourced by bootstrap.sh and each step. Paths default to the node's (tests override them).
set -euo pipefail
: "${GPU_SWARM_LOG:=/var/log/gpu-swarm/bootstrap.log}" "${GPU_SWARM_STATE:=/var/lib/gpu-swarm}"
: "${GPU_SWARM_VERSIONS:=/opt/gpu-swarm/software/versions.env}" "${GPU_SWARM_NODE_ENV:=/etc/gpu-swarm/node.env}"
: "${GPU_SWARM_VENV:=/opt/gpu-swarm/venv}" "${DOCKER_DAEMON_JSON:=/etc/docker/daemon.json}"
: "${GPU_SWARM_UNIT_DIR:=/etc/systemd/system}" "${GPU_SWARM_WHEELHOUSE:=/opt/gpu-swarm/wheels}"
: "${GPU_SWARM_APT_DIR:=/etc/apt}" "${GPU_SWARM_OS_RELEASE:=/etc/os-release}"
export GPU_SWARM_LOG GPU_SWARM_STATE GPU_SWARM_VERSIONS GPU_SWARM_NODE_ENV GPU_SWARM_VENV DOCKER_DAEMON_JSON \
  GPU_SWARM_UNIT_DIR GPU_SWARM_WHEELHOUSE GPU_SWARM_APT_DIR GPU_SWARM_OS_RELEASE
# shellcheck source=versions.env
. "$GPU_SWARM_VERSIONS"
# shellcheck source=/dev/null
if [ -f "$GPU_SWARM_NODE_ENV" ]; then . "$GPU_SWARM_NODE_ENV"; fi
export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1

log() { printf '%s %s\n' "$(date -u +%FT%TZ)" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }
# Ends the step as "skipped": its work was already done.
skip() {
  log "skipped: $*"
  if [ -n "${STEP_STATUS_FILE:-}" ]; then echo skipped >"$STEP_STATUS_FILE"; fi
  exit 0
}
version_ge() { printf '%s\n%s\n' "$2" "$1" | sort -V -C; } # A >= B
retry() {
  local n=1
  until "$@"; do
    ((n++ < 5)) || return 1
    log "retry $n/5: $*" >&2
    sleep $((n * 5))
  done
}
# No conffile prompts (no terminal at boot); wait out apt-daily's lock on first boot.
apt_get() {
  apt-get -qy -o DPkg::Lock::Timeout=300 -o Acquire::Retries=5 \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@"
}
apt_install() { retry apt_get install "$@"; }
# An AMI that already lists the repo keeps its entry: a second one with another
# signed-by keyring makes apt-get update fail.
has_apt_source() { grep -rqsE "^[^#]*${1//./\\.}" "$GPU_SWARM_APT_DIR/sources.list" "$GPU_SWARM_APT_DIR/sources.list.d"; }
fetch_key() { install -d -m 0755 "${2%/*}" && retry curl -fsSL "$1" -o "$2" && chmod 0644 "$2"; }
# shellcheck source=/dev/null
os_release() { (. "$GPU_SWARM_OS_RELEASE" && printf '%s\n' "${!1:-}"); }
docker_version() {
  if command -v dockerd >/dev/null; then dockerd --version | sed -nE '1s/^Docker version ([0-9.]+).*/\1/p'; fi
}
containerd_version() {
  if command -v containerd >/dev/null; then containerd --version | sed -nE '1s/.* v?([0-9]+\.[0-9]+\.[0-9]+).*/\1/p'; fi
}
same_minor() { [ "${1%.*}" = "${2%.*}" ]; } # A B: the same major.minor (containerd 2.1.x and 2.1.y)
# pinned_package PACKAGE VERSION: the apt version of PACKAGE whose upstream version is VERSION (Docker's
# repository names them EPOCH:VERSION-1~ubuntu.24.04~noble, Ubuntu VERSION-0ubuntu0.24.04.2), or nothing.
pinned_package() {
  apt-cache madison "$1" 2>/dev/null | awk -v want="$2" '{ v = $3; sub(/^[0-9]+:/, "", v); sub(/-[^-]*$/, "", v)
    if (v == want) { print $3; exit } }'
}
toolkit_version() {
  if command -v nvidia-ctk >/dev/null; then nvidia-ctk --version | sed -nE '1s/.*version ([0-9.]+).*/\1/p'; fi
}
driver_version() { nvidia-smi --query-gpu=driver_version --format=csv,noheader | sed -n 1p; }
# Packages whose versions must match the loaded kernel module (driver user space, kernel
# modules, fabric manager) and the toolkit: held, so unattended-upgrades cannot swap them
# under a running driver ("Driver/library version mismatch"). Upgrades come by rolling
# new node software (versions.env), which installs with --allow-change-held-packages.
hold_nvidia_packages() {
  local pkgs
  mapfile -t pkgs < <(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' 2>/dev/null |
    awk '$1 ~ /^.i/ && $2 ~ /^(lib)?nvidia-|^linux-(modules|objects|signatures)-nvidia-|^nvlsm$/ { print $2 }')
  if ((${#pkgs[@]})); then
    apt-mark hold "${pkgs[@]}" >/dev/null
    log "held ${#pkgs[@]} NVIDIA packages against unattended upgrades: ${pkgs[*]}"
  fi
}
# The kernel stays the one the driver was set up for (and DKMS modules built for, EFA's among them), on
# every image: a kernel from unattended-upgrades would boot without them. A deliberate roll moves it.
hold_kernel() {
  local pkg kernel
  kernel=$(uname -r)
  for pkg in linux-aws linux-image-aws linux-headers-aws "linux-image-$kernel" "linux-modules-$kernel"; do
    if dpkg -s "$pkg" >/dev/null 2>&1; then apt-mark hold "$pkg" >/dev/null; fi
  done
}
# install_unit FILE: put the unit FILE in the unit folder. systemd loads a unit it does not hold when
# the unit is first asked for (one it found missing before, too: the folder changed), so only a unit
# it holds another copy of (or could not say) needs a reload first. NeedDaemonReload cannot tell:
# once any unit's `enable --no-reload` has changed a .wants folder, systemd 257 says "yes" of every
# unit, so each of a GPU node's five new units reloaded systemd before its start (0.2-0.4 s each on
# the rehearsal's 2 cores). An unchanged file is left alone: systemd read it when it was put there.
install_unit() {
  local name=${1##*/} held
  if cmp -s "$1" "$GPU_SWARM_UNIT_DIR/$name"; then return 0; fi
  held=$(systemctl show -p LoadState --value "$name" 2>/dev/null || :)
  install -m 0644 "$1" "$GPU_SWARM_UNIT_DIR/$name"
  if [ "$held" != not-found ]; then systemctl daemon-reload; fi
}
# run_unit UNIT VERB: VERB (start or restart) an installed unit, then enable it. The enable's links
# need a reload, which bootstrap.sh does once, at its end (reload-pending): a GPU node's boot enables
# five units. Enabled after the start, so that systemctl has no stale unit to warn about.
run_unit() {
  systemctl "$2" "$1" || {
    journalctl -u "$1" -n 30 --no-pager || :
    die "$1 failed to start"
  }
  systemctl enable --no-reload "$1"
  : >"$GPU_SWARM_STATE/reload-pending"
}
# install_service UNIT: install the unit from beside the steps, (re)start it, so that new node
# software runs at once, and enable it; on failure, show its journal and fail the step.
install_service() {
  install_unit "$(dirname "${BASH_SOURCE[0]}")/$1"
  run_unit "$1" restart
}
