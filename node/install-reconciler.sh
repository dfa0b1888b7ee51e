#!/usr/bin/env bash
# The health reconciler (swarm_reconciler.py, system python3) on a manager: the leader's
# drains the GPU nodes whose watcher reports a fault, and gives them back once healthy.
# Beside it the scaler of elastic pools (swarm_scaler.py), which idles without one.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-reconciler.service
install_service gpu-swarm-scaler.service
