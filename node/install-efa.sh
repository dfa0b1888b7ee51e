#!/usr/bin/env bash
# EFA pools (p4d, p5, ...): the EFA kernel driver, rdma-core and libfabric, from
# aws-efa-installer pinned by version and sha256 (versions.env), held like the driver so that
# unattended-upgrades (Ubuntu ships its own rdma-core) cannot swap them under a loaded module.
# Containers bring their own libfabric and aws-ofi-nccl; the host needs the driver, and fi_info
# to check it. Runs after the NVIDIA driver: EFA's GPUDirect RDMA (dmabuf) needs it loaded.
# GPU_SWARM_EFA_INTERFACES: the EFA interfaces the instance type has; the node must show them all.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
want=${GPU_SWARM_EFA_INTERFACES:?GPU_SWARM_EFA_INTERFACES is not set: this step is for EFA pools only}
: "${EFA_INSTALLER_DIR:=/opt/amazon/efa}" "${EFA_SYSFS:=/sys/class/infiniband}"
fi_info=$EFA_INSTALLER_DIR/bin/fi_info

efa_count() { python3 "$(dirname "${BASH_SOURCE[0]}")/efa_detect.py" "$EFA_SYSFS"; }
# What the installer installs on Ubuntu: held, as hold_nvidia_packages holds the driver's.
hold_efa_packages() {
  local pkgs
  mapfile -t pkgs < <(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' 2>/dev/null |
    awk '$1 ~ /^.i/ && $2 ~ /^(efa|efa-config|efa-profile|libfabric-aws.*|openmpi[0-9]+-aws|rdma-core|ibacm|ibverbs-.*|libibverbs.*|librdmacm.*|rdmacm-utils|infiniband-diags|libibumad.*|libibmad.*|libibnetdisc.*)$/ { print $2 }')
  if ((${#pkgs[@]})); then
    apt-mark hold "${pkgs[@]}" >/dev/null
    log "held ${#pkgs[@]} EFA packages against unattended upgrades: ${pkgs[*]}"
  fi
}
check_devices() {
  local have
  have=$(efa_count)
  [ "$have" -eq "$want" ] || die "the kernel shows $have EFA device(s) in $EFA_SYSFS; this instance type has $want" \
    "(the pool's launch template attaches one per network card): check ip link and dmesg | grep -i efa"
  "$fi_info" -p efa -t FI_EP_RDM >/dev/null || die "$fi_info finds no EFA provider: libfabric cannot use EFA here"
  log "EFA: $have device(s), libfabric's efa provider answers"
}

# A node whose EFA works keeps it, whatever installed it (the Deep Learning AMI ships one).
if [ -x "$fi_info" ] && "$fi_info" -p efa -t FI_EP_RDM >/dev/null 2>&1; then
  hold_efa_packages
  check_devices
  skip "EFA $(sed -n 's/^# EFA installer version: //p' "$EFA_INSTALLER_DIR/../efa_installed_packages" 2>/dev/null)"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
url=https://efa-installer.amazonaws.com/aws-efa-installer-$EFA_INSTALLER_VERSION.tar.gz
retry curl -fsSL -o "$tmp/efa.tar.gz" "$url"
echo "$EFA_INSTALLER_SHA256  $tmp/efa.tar.gz" | sha256sum -c --quiet - ||
  die "$url does not have the sha256 pinned in versions.env ($EFA_INSTALLER_SHA256)"
tar -C "$tmp" -xzf "$tmp/efa.tar.gz"
retry apt_get update
# -y: no questions. The kernel module is built for the running kernel (DKMS), which the NVIDIA
# step holds with its metapackages: the module is there again after a reboot.
(cd "$tmp/aws-efa-installer" && ./efa_installer.sh -y) || die "aws-efa-installer $EFA_INSTALLER_VERSION failed"
hold_efa_packages
modprobe efa || die "the efa kernel module does not load on kernel $(uname -r)"
check_devices
