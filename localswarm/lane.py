"""Which rehearsal this process belongs to, when several run side by side on one host (GPU_SWARM_LANE).

Lane 0, the default, is the rehearsal a user runs: its bridge, namespaces, folders and machine names
are the ones the docs show. Lane N > 0 is another whole rehearsal beside it, with its own bridge and
subnet, its own name prefixes and its own folders, so that the test suite can run N rehearsals at
once (scripts/test.sh, through pytest-xdist: one lane per worker). Nothing of one lane is a prefix of
another's, because teardown finds what is its own by prefix.
"""
from __future__ import annotations

import os
from pathlib import Path

LANE = int(os.environ.get("GPU_SWARM_LANE", "0") or 0)
if not 0 <= LANE <= 9:  # one digit: the interface names below have 15 characters at most
    raise SystemExit(f"GPU_SWARM_LANE={LANE}: a lane is 0 (the default) to 9")


def name(prefix: str) -> str:
    """A host-wide name prefix: "lsw" in lane 0, "lsw3" in lane 3 (then "lsw-", "lsw3-", ...)."""
    return prefix if LANE == 0 else f"{prefix}{LANE}"


def folder(default: str) -> Path:
    """A host-wide folder: the default in lane 0; in lane N, the same leaf under /var/lib/gpu-swarm-lanes/N
    (or /run/gpu-swarm-lanes/N), which no lane's folder is a prefix of."""
    if LANE == 0:
        return Path(default)
    top = "/run" if default.startswith("/run/") else "/var/lib"
    return Path(top) / "gpu-swarm-lanes" / str(LANE) / Path(default).name


# The folders of this lane's rehearsals: the machines' (GPU_SWARM_REHEARSAL_STATE: a test's own), and the
# namespaced rehearsal's state and run folders, which its `down` removes whole.
MACHINES_STATE = Path(os.environ.get("GPU_SWARM_REHEARSAL_STATE") or folder("/var/lib/gpu-swarm-rehearsal"))
NAMESPACED_STATE, NAMESPACED_RUN = folder("/var/lib/localswarm"), folder("/run/localswarm")
