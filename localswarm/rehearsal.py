"""Show the rehearsal, and take it down: everything Pulumi's CLI made there, and what the host runs for it.

The machines come and go with `localswarm pulumi up` and `destroy` (localswarm/pulumi_cli.py); `down`
removes whatever is left, after a finished run or an interrupted one, so that the next starts clean.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from localswarm import network, registry
from localswarm.host import CLI, RehearsalError, run
from localswarm.nodes import RUN_ROOT, STATE_ROOT

Progress = Callable[[str], None]


def status(*, progress: Progress = print) -> dict:
    """The swarm of the CLI's machines: nodes, GPUs, services and tasks (localswarm/placement.py)."""
    from localswarm import pulumi_cli
    if not pulumi_cli.holds_machines():
        raise RehearsalError(f"no rehearsal is up: `{CLI} pulumi up` makes one (./scripts/rehearse.sh runs it)")
    return pulumi_cli.status(pulumi_cli.held_stack() or "dev")


def _our_mounts() -> list[str]:
    roots = (str(STATE_ROOT) + "/", str(RUN_ROOT) + "/")
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(roots) or point in (str(STATE_ROOT), str(RUN_ROOT)):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def down(*, progress: Progress = print) -> dict:
    """Remove everything the rehearsal made; safe to run twice, and after a failed or interrupted run."""
    if os.geteuid() != 0:
        raise RehearsalError("run `down` as root, as the rehearsal was")
    from localswarm import pulumi_cli, pulumi_host  # the machines of Pulumi's CLI in the rehearsal, its S3 stand-in
    machines_removed = pulumi_host.down(pulumi_cli.world().get("machines", {}))
    registry.stop_registry()
    for ns in network.our_netns():  # anything else still living in our namespaces
        for pid in network.netns_pids(ns):
            run(["kill", "-9", str(pid)], check=False)
    mounts = _our_mounts()
    for point in mounts:
        run(["umount", "-l", point], check=False)
    network.teardown_network()
    for root in (STATE_ROOT, RUN_ROOT):
        shutil.rmtree(root, ignore_errors=True)
    progress(f"rehearsal removed ({len(machines_removed)} machine(s), {len(mounts)} mount(s))")
    return {"removed_nodes": machines_removed, "unmounted": len(mounts)}
