#!/usr/bin/env bash
# NVIDIA driver, unless one works. A pinned -server branch rather than `ubuntu-drivers
# install --gpgpu`, whose choice varies by release: every node gets one branch, which
# Ubuntu's nvidia-fabricmanager-BRANCH matches version for version. Modules prebuilt for
# the running kernel (no compiler, no reboot); DKMS only when Ubuntu has none.
# NVIDIA_KERNEL_MODULES: open (Turing+, required by Blackwell) or proprietary (Volta-).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if command -v nvidia-smi >/dev/null; then
  # Its version proves that nvidia-smi reaches the driver: one call, where there were three (-L
  # twice, then the version), at every boot and upgrade of every GPU node.
  version=$(driver_version 2>/dev/null) || version=""
  if [ -z "$version" ]; then
    modprobe nvidia || :
    version=$(driver_version 2>/dev/null) || version=""
  fi
  [ -n "$version" ] || die "nvidia-smi cannot reach the driver on kernel $(uname -r)"
  hold_nvidia_packages
  skip "NVIDIA driver $version"
fi
[ "${GPU_SWARM_IMAGE:-}" != deep-learning ] || die "no nvidia-smi on a Deep Learning AMI: check the AMI id"
branch=$NVIDIA_DRIVER_BRANCH-server flavor=$NVIDIA_DRIVER_BRANCH-server
if [ "${NVIDIA_KERNEL_MODULES:-open}" = open ]; then flavor+=-open; fi
kernel=$(uname -r)
retry apt_get update
pkgs=("nvidia-utils-$branch")
if apt-cache show "linux-modules-nvidia-$flavor-$kernel" >/dev/null 2>&1; then
  # the flavour's metapackage (...-aws) follows kernel upgrades
  meta=linux-modules-nvidia-$flavor-${kernel#*-*-}
  pkgs+=("linux-modules-nvidia-$flavor-$kernel" "nvidia-headless-no-dkms-$flavor")
  if apt-cache show "$meta" >/dev/null 2>&1; then pkgs+=("$meta"); fi
  # Prebuilt modules exist per kernel; a new kernel from unattended-upgrades would boot
  # without the held driver's modules, so the kernel waits for a deliberate roll too.
  kernel_holds=(linux-aws linux-image-aws linux-headers-aws)
else
  log "no prebuilt modules for kernel $kernel: using DKMS"
  # linux-headers-aws follows kernel upgrades, so DKMS can build the module for the next kernel.
  pkgs+=("nvidia-headless-$flavor" "linux-headers-$kernel" linux-headers-aws)
  kernel_holds=()
fi
apt_install --allow-change-held-packages "${pkgs[@]}"
hold_nvidia_packages
for pkg in "${kernel_holds[@]}"; do
  if dpkg -s "$pkg" >/dev/null 2>&1; then apt-mark hold "$pkg" >/dev/null; fi
done
modprobe -r nouveau 2>/dev/null || :
modprobe nvidia
nvidia-smi -L || die "nvidia-smi fails after installing driver $flavor"
