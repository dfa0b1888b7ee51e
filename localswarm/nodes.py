"""What the host side of the rehearsal shares: its folders, the local registry's address, and the docker CLI
run against one machine's engine (through the socket its init's root holds, localswarm/pulumi_host.py)."""
from __future__ import annotations

import subprocess

from localswarm import lane
from localswarm.host import Engine, run
from localswarm.network import BRIDGE_ADDR

STATE_ROOT, RUN_ROOT = lane.NAMESPACED_STATE, lane.NAMESPACED_RUN
REGISTRY = f"{BRIDGE_ADDR}:5000"


def docker(node, engine: Engine, *args: str, check: bool = True, input: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """`docker ARGS` against node's engine (node: anything with a .sock, a pulumi_host.ViewNode)."""
    return run([engine.docker, "-H", f"unix://{node.sock}", *args], check=check, input=input,
               env=engine.env(), timeout=timeout)
