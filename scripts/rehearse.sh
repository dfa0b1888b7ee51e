#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh) and brings up the local rehearsal: a real Docker
# Swarm of namespaced engines with simulated GPUs. Run as root; extra arguments go to
# `localswarm up` (see `.venv/bin/python -m localswarm up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m localswarm up "$@"
