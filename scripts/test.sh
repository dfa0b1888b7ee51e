#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh) and runs every test: unit, real tools and the
# rehearsal's integration tests. Run as root; extra arguments go to pytest, after -ra (a
# later -r wins, and -ra twice is the same as once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The agent's tests validate every daemon.json they generate with this engine's `dockerd --validate`.
export GPU_SWARM_DOCKERD=${GPU_SWARM_DOCKERD:-/opt/gpu-swarm/docker/usr/sbin/dockerd}
# -n: pytest-xdist workers, each with a rehearsal of its own (a lane, localswarm/lane.py): the rehearsals
# mostly wait on their machines, so four share this machine's two cores well (docs/reference/development.md
# has the figures; GPU_SWARM_TEST_WORKERS;
# 0 runs everything in this process, in lane 0). --dist loadgroup keeps a rehearsal module's tests in one
# worker (tests/conftest.py).
# -ra: the summary names every skipped test and why (a missing tool, not root).
exec .venv/bin/python -m pytest -n "${GPU_SWARM_TEST_WORKERS:-4}" --dist loadgroup -ra "$@"
