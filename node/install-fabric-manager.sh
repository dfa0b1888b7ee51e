#!/usr/bin/env bash
# NVSwitch types (p4d, p5, ...): without nvidia-fabricmanager CUDA fails with error 802.
# Its version must equal the loaded driver's.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
driver=$(driver_version)
unit=nvidia-fabricmanager
if systemctl is-enabled -q $unit 2>/dev/null && systemctl is-active -q $unit; then
  hold_nvidia_packages
  skip "$unit running"
fi
if ! command -v nv-fabricmanager >/dev/null; then
  retry apt_get update
  version="" # NVIDIA's own repo drops the branch from the name from 590 on
  for pkg in "$unit-${driver%%.*}" $unit; do
    version=$(apt-cache madison "$pkg" 2>/dev/null | awk -v d="$driver-" 'index($3, d) == 1 { print $3; exit }' || :)
    if [ -n "$version" ]; then break; fi
  done
  [ -n "$version" ] || die "no $unit package for driver $driver in the apt sources"
  apt_install --allow-change-held-packages "$pkg=$version"
fi
hold_nvidia_packages
systemctl enable --now $unit
systemctl is-active -q $unit || die "$unit did not start: journalctl -u $unit"
