#!/usr/bin/env bash
# Installs everything the tests and the local rehearsal need, on Debian or Ubuntu, as root.
# Safe to run again: each step skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "setup: run as root (sudo $0)" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
packages=(
  python3 python3-venv            # the Pulumi program, the agent, the rehearsal and tests
  iproute2 iptables util-linux    # namespaces, veths, bridge, nsenter/unshare
  runc tini                       # the engine's runtime and docker-init (trixie's need glibc 2.38)
  docker-registry busybox-static  # the rehearsal's local registry and its stand-in image
  cloud-init shellcheck           # real validators for the user data and every shell script
  ca-certificates
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt

bash localswarm/install-engine.sh
echo "setup: done"
