#!/usr/bin/env bash
# The health reconciler (swarm_reconciler.py, system python3) on a manager: the leader's
# drains the GPU nodes whose watcher reports a fault, and gives them back once healthy.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-reconciler.service
