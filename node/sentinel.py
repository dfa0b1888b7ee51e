"""The watcher's fast word to the managers: its node's sentinel task, stopped with a known exit code.

An engine label (the node's condition) reaches the managers with the node's description, which the
swarm agent sends every 20 s (swarmkit agent.go, nodeUpdatePeriod); a task's state reaches them at
once. So on a fault the watcher sends SENTINEL_SIGNAL to this node's sentinel task, the task exits
SENTINEL_EXIT, and the reconciler on the leader drains the node from that (swarm_reconciler.py);
the labels follow and say why. Stdlib only: the Engine API over its unix socket.
"""
from __future__ import annotations

from contract import DOCKER_SERVICE_NAME, SENTINEL_SERVICE, SENTINEL_SIGNAL
from gpu_tasks import DockerUnavailable, docker_get, docker_request


def signal_sentinel(sock: str) -> str:
    """Signal this node's running sentinel task(s); says what happened, for the log."""
    try:
        running = docker_get(sock, "/containers/json",
                             filters={"label": [f"{DOCKER_SERVICE_NAME}={SENTINEL_SERVICE}"], "status": ["running"]})
        for container in running:
            docker_request(sock, "POST", f"/containers/{container['Id']}/kill", signal=SENTINEL_SIGNAL)
    except DockerUnavailable as e:
        return f"the sentinel was not signalled ({e}); the labels still reach the managers, on the agent's tick"
    if not running:
        return "no sentinel task runs here (a manager, or drained); the labels reach the managers on the agent's tick"
    return f"signalled the sentinel ({', '.join(c['Id'][:12] for c in running)})"
