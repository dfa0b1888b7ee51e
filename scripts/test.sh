#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh) and runs every test: unit, real tools and the
# rehearsal's integration tests. Run as root; extra arguments go to pytest, after -ra (a
# later -r wins, and -ra twice is the same as once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The agent's tests validate every daemon.json they generate with this engine's `dockerd --validate`.
export GPU_SWARM_DOCKERD=${GPU_SWARM_DOCKERD:-/opt/gpu-swarm/docker/usr/sbin/dockerd}
# -ra: the summary names every skipped test and why (a missing tool, not root).
exec .venv/bin/python -m pytest -ra "$@"
