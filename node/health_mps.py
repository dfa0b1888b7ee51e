"""The health watcher's look at a pool that shares its GPUs by MPS: each GPU's MPS control daemon.

A GPU whose daemon is gone is unhealthy: its slot tasks' clients lose their server, and the
guard starts no new slot task on it (without the daemon CUDA would run it outside MPS, without
its memory limit). The reconciler then drains the node; `systemctl restart gpu-swarm-mps`
brings the daemons back, and the condition clears after the usual recovery time.
"""
from __future__ import annotations

from guard_files import mps_daemon_alive  # the guard's own test, so both see a daemon alike
from health_rules import RANK, Tracker


def mps_reason(uuid: str) -> str:
    return f"mps_daemon_down_on_{uuid}"


def check_mps(uuids: list[str], tracker: Tracker, now: float, mps_dir: str) -> None:
    """After the GPU check: a GPU that passed it but has no live MPS daemon is unhealthy."""
    for uuid in uuids:
        condition, _ = tracker.checks.get(uuid, ("healthy", "ok"))
        if RANK[condition] < RANK["unhealthy"] and not mps_daemon_alive(mps_dir, uuid):
            tracker.check(uuid, "unhealthy", mps_reason(uuid), now)
