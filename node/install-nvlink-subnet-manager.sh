#!/usr/bin/env bash
# Fifth-generation NVLink (p6-b200, p6-b300: HGX B200/B300): nvidia-fabricmanager 570+ starts
# only once the NVLink Subnet Manager (nvlsm) can reach the NVSwitches, which it does through
# InfiniBand management datagrams (/dev/infiniband/umad*, kernel module ib_umad). Without both,
# the fabric manager's precheck fails and CUDA fails with error 802. Runs before the fabric
# manager step. Not yet run on real p6 hardware: no such instance was reachable.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
conf=/etc/modules-load.d/gpu-swarm-nvlsm.conf
have_module() { [ -e "$conf" ] && lsmod | grep -q '^ib_umad '; }
if have_module && command -v nvlsm >/dev/null; then
  hold_nvidia_packages
  skip "nvlsm installed, ib_umad loaded"
fi
echo ib_umad >"$conf"
modprobe ib_umad || die "cannot load ib_umad on kernel $(uname -r): install linux-modules-extra-$(uname -r)"
if ! command -v nvlsm >/dev/null; then
  retry apt_get update
  apt-cache show nvlsm >/dev/null 2>&1 ||
    die "no nvlsm package in this node's apt sources: use the Deep Learning Base GPU AMI (image: deep-learning), or an image with NVIDIA's CUDA repository"
  apt_install --allow-change-held-packages nvlsm
fi
hold_nvidia_packages
command -v nvlsm >/dev/null || die "nvlsm is not on PATH after its install"
