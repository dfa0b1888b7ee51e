#!/usr/bin/env bash
# CUDA MPS for a pool that shares its GPUs by MPS (node.env GPU_SWARM_SHARING_MODE=mps):
# gpu-swarm-mps.service, enabled and (re)started. On any other GPU node it removes that unit if
# an earlier release installed it, which also puts the GPUs back in compute mode Default.
# Before install-gpu-agent: the agent advertises an MPS pool's slots only for GPUs in the
# Exclusive_Process mode this unit sets.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
unit=gpu-swarm-mps.service
if [ "${GPU_SWARM_SHARING_MODE:-}" != mps ]; then
  if [ -f "$GPU_SWARM_UNIT_DIR/$unit" ]; then
    systemctl disable --now "$unit" || :
    rm -f "$GPU_SWARM_UNIT_DIR/$unit"
    systemctl daemon-reload
    log "removed $unit: this pool no longer shares its GPUs by MPS"
    exit 0
  fi
  skip "this pool does not share its GPUs by MPS"
fi
if ! command -v nvidia-cuda-mps-control >/dev/null; then
  # It ships with the driver's compute utilities; the Deep Learning AMI has them.
  [ "${GPU_SWARM_IMAGE:-}" = ubuntu ] || die "nvidia-cuda-mps-control is missing: install the NVIDIA driver's compute utilities (nvidia-compute-utils-<branch>) in the image"
  retry apt_get update
  apt_install --allow-change-held-packages "nvidia-compute-utils-$NVIDIA_DRIVER_BRANCH-server"
  hold_nvidia_packages
fi
install_service "$unit"
