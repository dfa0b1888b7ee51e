#!/usr/bin/env bash
# NVIDIA driver, unless one works. A pinned -server branch rather than `ubuntu-drivers
# install --gpgpu`, whose choice varies by release: every node gets one branch, which
# Ubuntu's nvidia-fabricmanager-BRANCH matches version for version. Modules prebuilt for
# the running kernel (no compiler, no reboot), with user space of the module's own version; DKMS
# only when Ubuntu has none. The kernel is held: it is the one the modules are for.
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
  [ -n "$version" ] || die "nvidia-smi cannot reach the driver on kernel $(uname -r) (kernel module" \
    "$(modinfo -F version nvidia 2>/dev/null || echo missing), nvidia-smi of" \
    "$(dpkg-query -W -f='${Version}' "nvidia-utils-$NVIDIA_DRIVER_BRANCH-server" 2>/dev/null || echo 'another package'))"
  hold_nvidia_packages
  hold_kernel
  skip "NVIDIA driver $version"
fi
[ "${GPU_SWARM_IMAGE:-}" != deep-learning ] || die "no nvidia-smi on a Deep Learning AMI: check the AMI id"
branch=$NVIDIA_DRIVER_BRANCH-server flavor=$NVIDIA_DRIVER_BRANCH-server
if [ "${NVIDIA_KERNEL_MODULES:-open}" = open ]; then flavor+=-open; fi
kernel=$(uname -r)
retry apt_get update
modules=linux-modules-nvidia-$flavor-$kernel
if apt-cache show "$modules" >/dev/null 2>&1; then
  # Ubuntu's module prebuilt for this very kernel, then the user space of the module's own driver version:
  # the branch's newest tools can be newer than the module Ubuntu built for a kernel that is not the newest,
  # and that pair fails as "Driver/library version mismatch". Not the flavour's -aws metapackage: it
  # follows kernel upgrades, and so would stage a newer kernel, booted at the next start without this module.
  apt_install --allow-change-held-packages "$modules"
  module=$(modinfo -k "$kernel" -F version nvidia 2>/dev/null || :)
  [ -n "$module" ] || die "$modules is installed but holds no nvidia module for kernel $kernel"
  tools=$(pinned_package "nvidia-utils-$branch" "$module") headless=$(pinned_package "nvidia-headless-no-dkms-$flavor" "$module")
  if [ -z "$tools" ] || [ -z "$headless" ]; then
    die "Ubuntu's module for kernel $kernel is driver $module, and the archive has no nvidia-utils-$branch or" \
      "nvidia-headless-no-dkms-$flavor of that version; use an image on a current kernel"
  fi
  pkgs=("nvidia-utils-$branch=$tools" "nvidia-headless-no-dkms-$flavor=$headless")
else
  log "no prebuilt modules for kernel $kernel: using DKMS"
  # DKMS builds the module of the user space's own version, for the running kernel: its headers only.
  pkgs=("nvidia-headless-$flavor" "linux-headers-$kernel")
fi
apt_install --allow-change-held-packages "${pkgs[@]}"
hold_nvidia_packages
hold_kernel
# Before the module loads: a module and tools of two versions fail every CUDA call, so refuse them here.
module=$(modinfo -k "$kernel" -F version nvidia 2>/dev/null || :)
tools=$(dpkg-query -W -f='${Version}' "nvidia-utils-$branch" 2>/dev/null || :)
tools=${tools#*:} tools=${tools%-*}
if [ -z "$module" ] || [ "$module" != "$tools" ]; then
  die "the NVIDIA kernel module for kernel $kernel is ${module:-missing} and the user-space tools" \
    "(nvidia-utils-$branch) are ${tools:-missing}: they must be the same version"
fi
modprobe -r nouveau 2>/dev/null || :
modprobe nvidia
nvidia-smi -L || die "nvidia-smi fails after installing driver $module ($flavor)"
