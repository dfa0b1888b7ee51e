#!/usr/bin/env bash
# Installs everything the tests and the local rehearsal need, on Debian or Ubuntu, as root.
# Safe to run again: each step skips what is already there. Each step prints when it starts
# and ends, and how much it downloads; a failing command's output is shown in full.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "setup: run as root (sudo $0)" >&2; exit 1; }
# shellcheck source=steps.sh
. scripts/steps.sh
# shellcheck source=../node/versions.env
. node/versions.env
STEP_PREFIX=setup STEP_COUNT=6
setup_t0=$(now_us)

export DEBIAN_FRONTEND=noninteractive
packages=(
  python3 python3-venv            # the Pulumi program, the agent, the rehearsal and tests
  iproute2 iptables util-linux    # namespaces, veths, bridge, nsenter/unshare
  runc tini                       # the engine's runtime and docker-init (forky's need glibc 2.38)
  docker-registry busybox-static  # the rehearsal's local registry and its stand-in image
  cloud-init shellcheck           # real validators for the user data and every shell script
  ca-certificates
  mmdebstrap debian-archive-keyring systemd-container  # the rehearsal machines: root filesystem, nspawn
  openssl openssh-client          # the rehearsal CA (S3 stand-in); SSH into the machines
)
step_begin "Debian packages"
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  say "  installing ${missing[*]}"
  quietly apt-get update
  # apt's summary says how much it downloads; its per-package lines stay in the log.
  quietly --show '^(Need to get|After this operation)' \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  step_done
else
  step_skipped "all ${#packages[@]} installed"
fi

step_begin "Python packages (requirements.txt) into .venv"
if [ ! -x .venv/bin/python ]; then
  quietly python3 -m venv .venv
  say "  created .venv"
fi
pip_log=$(mktemp)
trap 'rm -f "$pip_log"' EXIT
quietly --log "$pip_log" .venv/bin/pip install --disable-pip-version-check --progress-bar off -r requirements.txt
# pip names each file it fetches with its size: "Downloading NAME (11.3 MB)", or "Using cached".
read -r got got_mb cached cached_mb < <(awk '
  /^ *(Downloading|Using cached) .*\([0-9.]+ (bytes|kB|MB|GB)\)$/ {
    size = $(NF - 1); sub(/\(/, "", size); unit = $NF
    mb = size / (unit ~ /^bytes/ ? 1e6 : unit ~ /^kB/ ? 1e3 : unit ~ /^GB/ ? 1e-3 : 1)
    if ($1 == "Downloading") { got++; got_mb += mb } else { cached++; cached_mb += mb }
  }
  END { printf "%d %.1f %d %.1f\n", got, got_mb, cached, cached_mb }' "$pip_log")
if grep -q '^Successfully installed' "$pip_log"; then
  say "  downloaded $got files, $got_mb MB (and $cached files, $cached_mb MB, from pip's cache)"
  say "  .venv takes $(du -sh .venv | cut -f1)"
  step_done
else
  step_skipped "every requirement already satisfied"
fi

step_begin "Docker Engine $DOCKER_VERSION"
if engine=$(bash localswarm/install-engine.sh --check); then
  step_skipped "$engine"
else
  bash localswarm/install-engine.sh
  step_done
fi
step_begin "rehearsal node image (Debian trixie, mmdebstrap)"
if image=$(.venv/bin/python -m localswarm.node_image --check); then
  step_skipped "${image:-built}"
else
  # It says how long each layer took and how big it is; mmdebstrap's own log stays in the cache.
  quietly --show '^(base|node layer|node image)' .venv/bin/python -m localswarm.node_image
  step_done
fi
pulumi_version=$(cat tools/pulumi/VERSION)
step_begin "Pulumi CLI $pulumi_version (its Go module, tools/pulumi/go.mod) into .tools/bin"
if on_path=$(command -v pulumi) && [ "$("$on_path" version 2>/dev/null)" = "v$pulumi_version" ]; then
  step_skipped "$on_path is $pulumi_version"
elif [ -x .tools/bin/pulumi ] && [ "$(.tools/bin/pulumi version 2>/dev/null)" = "v$pulumi_version" ]; then
  step_skipped ".tools/bin/pulumi is $pulumi_version"
else
  # The CLI's module has replace lines, so `go install pkg@version` is refused; the tools module
  # requires it at one version (go.sum pins every dependency) and `go build` makes the binary.
  say "  building github.com/pulumi/pulumi/pkg/v3/cmd/pulumi: a cold build downloads its modules and takes minutes"
  go=$(command -v go || echo /usr/local/go/bin/go)  # sudo's PATH may leave out Go's folder
  [ -x "$go" ] || { say "no Go toolchain: install Go 1.26 or newer (https://go.dev/doc/install), then run this again" >&2; exit 1; }
  mkdir -p .tools/bin
  (cd tools/pulumi && quietly "$go" build -trimpath -ldflags "-X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=v$pulumi_version" \
    -o ../../.tools/bin/pulumi github.com/pulumi/pulumi/pkg/v3/cmd/pulumi)
  say "  .tools/bin/pulumi: $(.tools/bin/pulumi version), $(du -h .tools/bin/pulumi | cut -f1)"
  step_done
fi

step_begin "kernel limits for the rehearsal's machines (fs.inotify)"
# Each machine's systemd, journald, containerd and dockerd take inotify instances, all as root, and Linux
# allows 128 per user by default: a machine that boots beside a dozen others finds none left, its PID 1
# exits at once ("Failed to allocate manager object: Too many open files"), and its port 22 never answers.
# The values are those kind's known issues give; a limit already higher is left as it is.
sysctl_dir=${GPU_SWARM_SYSCTL_DIR:-/etc/sysctl.d}
low=()
for limit in fs.inotify.max_user_instances=1024 fs.inotify.max_user_watches=524288; do
  [ "$(sysctl -n "${limit%%=*}")" -ge "${limit#*=}" ] || low+=("$limit")
done
if [ "${#low[@]}" -gt 0 ]; then
  say "  raising ${low[*]} (kept across reboots in $sysctl_dir/90-gpu-swarm-rehearsal.conf)"
  mkdir -p "$sysctl_dir"
  { echo "# scripts/setup.sh of gpu-swarm: the rehearsal's machines (remove this file to undo at the next boot)"
    printf '%s\n' "${low[@]}"; } > "$sysctl_dir/90-gpu-swarm-rehearsal.conf"
  quietly sysctl -w "${low[@]}"
  step_done
else
  step_skipped "fs.inotify.max_user_instances $(sysctl -n fs.inotify.max_user_instances), max_user_watches $(sysctl -n fs.inotify.max_user_watches)"
fi
STEP_T0=$setup_t0
say "done in $(step_seconds) s"
