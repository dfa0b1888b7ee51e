"""The fast rehearsal changed as `pulumi up` would change it with nothing changed (converge), and one
node's engine stopped, started or its GPUs re-detected, or a GPU fault or spot notice injected for the
health watcher. The program's own day 2 (nodes replaced, added, removed, rolled; stacks changed) is
rehearsed with Pulumi's CLI (tests/test_pulumi_up.py, tests/test_program_day2.py, tests/test_pulumi_pool.py).
"""
from __future__ import annotations

import json

from localswarm import health, nodes as nodes_mod
from localswarm.converge import converge
from localswarm.host import RehearsalError, find_engine
from localswarm.nodes import Node
from localswarm.rehearsal import Progress, status
from localswarm.state import agent_args, desired, find_node, require_state, save_state


def converge_again(*, progress: Progress = print) -> dict:
    """Run every swarm step of `pulumi up` again, as a second `pulumi up` with nothing changed would."""
    state = require_state()
    engine = find_engine()
    result = converge(desired(state), engine, progress)
    state["cluster_id"] = result["cluster_id"]
    state["gpus_verified"] = {**state.get("gpus_verified", {}),
                              **{name: (check or {}).get("verified") for name, check in result["checks"].items()}}
    save_state(state)
    return {**result, "view": status()}


def node_engine(name: str, action: str, *, gpus: int | None = None) -> dict:
    """Stop or start one node's engine, or re-run its agent on a new simulated inventory."""
    state = require_state()
    node = find_node(state, name)
    engine = find_engine()
    if action == "stop":
        nodes_mod.stop_dockerd(node)
        return {"node": name, "running": False}
    if action == "start":
        nodes_mod.start_dockerd(node, engine)
        nodes_mod.wait_ready(node, engine)
        return {"node": name, "running": True}
    if action == "redetect":
        return redetect(node, state, engine, gpus)
    raise ValueError(action)


def redetect(node: Node, state: dict, engine, gpus: int | None = None) -> dict:
    """The agent run again on the node's GPUs, as its unit runs at boot and the installer at a roll."""
    # The same hardware keeps its GPUs (a reboot); another count is other hardware.
    current = json.loads(node.inventory.read_text()) if node.inventory.exists() else []
    inventory = current if gpus is None or gpus == len(current) else nodes_mod.simulated_gpus(gpus)
    report = nodes_mod.run_agent(node, inventory, state["kind"], agent_args(node, state))
    # As the agent's unit does on a real node: dockerd reads its resources only at start.
    report["engine_restarted"] = bool(report["changed"]) and nodes_mod.is_running(node)
    if report["engine_restarted"]:
        nodes_mod.restart_dockerd(node, engine)
    return report


def node_health(name: str, action: str, *, gpu: str | None = None, xid: int = health.DEFAULT_XID) -> dict:
    """Inject a GPU fault, a spot notice or scheduled maintenance into one node, or clear them; its watcher
    does the rest."""
    state = require_state()
    node = find_node(state, name)
    if not health.watching(node):
        raise RehearsalError(f"{name} has no health watcher running (see {health.log_file(node)}), "
                             f"so nothing would act on a {action}")
    if action == "gpu-fault":
        return health.gpu_fault(node, gpu, xid)
    if action == "gpu-heal":
        return health.gpu_heal(node)
    if action == "spot-notice":
        return health.spot_notice(node)
    if action == "maintenance-notice":
        return health.maintenance_notice(node)
    raise ValueError(action)
