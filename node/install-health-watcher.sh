#!/usr/bin/env bash
# The GPU health watcher (gpu_health.py, in the agent's venv): it reports this node's GPU
# condition as engine labels; the managers' reconciler drains the node on a fault.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-health.service
