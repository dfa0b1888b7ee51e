"""The health watcher's look at a pool that shares its GPUs by MPS: each GPU's MPS control daemon,
and the relay (mps_relay.py) through which slot tasks reach them.

A GPU whose daemon is gone is unhealthy: its slot tasks' clients lose their server, and the
guard starts no new slot task on it (without the daemon CUDA would run it outside MPS, without
its memory limit). The reconciler then drains the node; `systemctl restart gpu-swarm-mps`
brings the daemons back, and the condition clears after the usual recovery time. Without the
relay no slot task reaches any daemon and the guard starts none: every GPU is unhealthy alike.
"""
from __future__ import annotations

from guard_files import mps_daemon_alive, mps_relay_alive  # the guard's own tests, so both see them alike
from health_rules import RANK, Tracker


def mps_reason(uuid: str) -> str:
    return f"mps_daemon_down_on_{uuid}"


MPS_RELAY_DOWN = "mps_relay_down"


def check_mps(uuids: list[str], tracker: Tracker, now: float, mps_dir: str) -> None:
    """After the GPU check: a GPU that passed it but has no live MPS daemon, or no relay, is unhealthy."""
    relay = mps_relay_alive(mps_dir)
    for uuid in uuids:
        condition, _ = tracker.checks.get(uuid, ("healthy", "ok"))
        if RANK[condition] < RANK["unhealthy"]:
            if not mps_daemon_alive(mps_dir, uuid):
                tracker.check(uuid, "unhealthy", mps_reason(uuid), now)
            elif not relay:
                tracker.check(uuid, "unhealthy", MPS_RELAY_DOWN, now)
