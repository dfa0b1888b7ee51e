#!/usr/bin/env bash
# Run on a GPU machine from the repository root; see README.md here (the figures, and where old-install-nvidia-driver.sh comes from).
# On a GPU machine: the driver step's skip, before (3 nvidia-smi calls) and after (1), alternating.
set -u
out=${OUT:-/tmp}/driver-probe.log
exec > >(tee "$out") 2>&1
date -u; hostname; nvidia-smi --query-gpu=index,name,driver_version,persistence_mode --format=csv
mkdir -p /tmp/probe/bin /tmp/probe/state
printf '#!/bin/sh\necho "apt-mark $*" >>/tmp/probe/apt-mark.calls\n' > /tmp/probe/bin/apt-mark; chmod +x /tmp/probe/bin/apt-mark
export PATH=/tmp/probe/bin:$PATH GPU_SWARM_VERSIONS=$PWD/node/versions.env GPU_SWARM_NODE_ENV=/nonexistent \
  GPU_SWARM_LOG=/tmp/probe/log GPU_SWARM_STATE=/tmp/probe/state
cp old-install-nvidia-driver.sh node/old-install-nvidia-driver.sh
ms() { local s=$EPOCHREALTIME; "$@" >/dev/null 2>&1; local rc=$?; echo "$(( (${EPOCHREALTIME/./} - ${s/./}) / 1000 )) rc=$rc"; }
for i in 1 2 3 4 5 6 7; do
  echo "run $i: before $(ms bash node/old-install-nvidia-driver.sh)  after $(ms bash node/install-nvidia-driver.sh)  nvidia-smi -L $(ms nvidia-smi -L)  --query-gpu=driver_version $(ms nvidia-smi --query-gpu=driver_version --format=csv,noheader)"
done
grep -h "skipped" /tmp/probe/log | tail -2
rm -f node/old-install-nvidia-driver.sh
