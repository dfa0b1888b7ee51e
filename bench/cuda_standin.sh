#!/usr/bin/env bash
# A stand-in for the CUDA image the stacks name, for a GPU machine with no registry:
#
#   bash bench/cuda_standin.sh IMAGE [CUDA_PROBE [MPS_PEER]]     # docker as DOCKER_HOST says
#
# It is the post-join check's image (node/build-check-image.sh: static busybox and this
# machine's C library in a merged-/usr layout, so the nvidia-smi the runtime mounts in runs),
# with what nvidia/cuda images set: NVIDIA_VISIBLE_DEVICES=all and
# NVIDIA_DRIVER_CAPABILITIES=compute,utility (compute brings libcuda.so.1). With CUDA_PROBE,
# a built bench/cuda_probe.c goes in as /usr/bin/cuda-probe, for tasks that do real CUDA work; with
# MPS_PEER, a built bench/mps_peer.c as /usr/bin/mps-peer, for the MPS bench's tasks (static: it needs nothing).
# Used by bench/gpu_session.sh and bench/gpu_e2e.py, so both engines get the same image.
set -euo pipefail
image=${1:?usage: cuda_standin.sh IMAGE [CUDA_PROBE [MPS_PEER]]}
probe=${2:-} peer=${3:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
base="gpu-swarm.invalid/standin-base:$$"
if [ -n "$peer" ] && [ ! -x "$peer" ]; then
  echo "cuda_standin: $peer is not an executable mps-peer; build bench/mps_peer.c (bench/build_gpu_kit.sh)" >&2
  exit 2
fi
if [ -n "$probe" ] && [ ! -x "$probe" ]; then
  echo "cuda_standin: $probe is not an executable cuda-probe; build bench/cuda_probe.c (bench/build_gpu_kit.sh)" >&2
  exit 2
fi
# build-check-image.sh is a node step: point its settings at the repository, not at a node.
GPU_SWARM_VERSIONS="$repo/node/versions.env" GPU_SWARM_NODE_ENV=/nonexistent \
  GPU_SWARM_STATE="${TMPDIR:-/tmp}" GPU_SWARM_LOG=/dev/null GPU_SWARM_CHECK_IMAGE="$base" \
  bash "$repo/node/build-check-image.sh" >/dev/null
container=$(docker create "$base" true)
trap 'docker rm "$container" >/dev/null 2>&1 || :; docker rmi "$base" >/dev/null 2>&1 || :' EXIT
if [ -n "$probe" ]; then docker cp "$probe" "$container:/usr/bin/cuda-probe"; fi
if [ -n "$peer" ]; then docker cp "$peer" "$container:/usr/bin/mps-peer"; fi
docker commit --change 'ENV NVIDIA_VISIBLE_DEVICES=all' --change 'ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility' \
  "$container" "$image" >/dev/null
echo "cuda_standin: built $image${probe:+ with cuda-probe}"
