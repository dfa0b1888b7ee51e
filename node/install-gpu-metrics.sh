#!/usr/bin/env bash
# The GPU metrics exporter (gpu_metrics.py, in the agent's venv): Prometheus metrics of each GPU,
# labelled with the swarm task that holds it, for the monitoring stack (monitoring: true).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-metrics.service
