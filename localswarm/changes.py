"""The rehearsal changed as `pulumi up` changes a cluster: again with nothing changed, a node
replaced, added or removed, other stacks, new node software; and one node's engine stopped,
started or its GPUs re-detected, or a GPU fault or spot notice injected for the health watcher.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from localswarm import health, metrics, network, nodes as nodes_mod, registry
from localswarm.converge import admit, converge
from localswarm.host import RehearsalError, find_engine, parallel
from localswarm.nodes import Node
from localswarm.rehearsal import Progress, stack_name, status
from localswarm.stacks import prepare_stack
from localswarm.state import (SHARED_POOL, agent_args, desired, find_node, first_boot, new_node, next_index,
                              require_state, save_state)
from swarm import rollout
from swarm.labels import POOL_LABEL



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


def replace_node(name: str, *, progress: Progress = print) -> dict:
    """The node's instance is lost and a new one takes its place (a new address, empty disk)."""
    state = require_state()
    engine = find_engine()
    old = find_node(state, name)
    new = Node(f"node-{next_index(state)}", next_index(state), old.role, old.pool)  # the same pool's new instance
    progress(f"replacing {old.name} ({old.address}) with {new.name} ({new.address})")
    health.stop(old)  # the old instance is gone, and its watcher with it
    metrics.stop(old)
    nodes_mod.remove_everything_of(old)
    state["nodes"] = [new.to_dict() if n["name"] == name else n for n in state["nodes"]]
    return _launch(new, state, engine, progress)


def add_node(*, role: str = "worker", progress: Progress = print) -> dict:
    state = require_state()
    engine = find_engine()
    node = new_node(next_index(state), role)
    state["nodes"].append(node.to_dict())
    result = _launch(node, state, engine, progress)
    progress(f"added {node.name} as {role}")
    return result


def _launch(node: Node, state: dict, engine, progress: Progress) -> dict:
    """A new instance of the program's: it boots (agent, engine, check image), `pulumi up`
    runs the swarm steps again to admit it, and its health services start."""
    network.create_node_netns(node.name, node.index)
    save_state(state)
    first_boot(node, state)
    nodes_mod.start_dockerd(node, engine)
    nodes_mod.wait_ready(node, engine)
    registry.pull_standin([node], engine)
    result = converge_again(progress=progress)
    health.start_all([node], engine, state["kind"], state.get("shared_kind", ""))
    metrics.start_all([node], state["kind"], state.get("shared_kind", ""))
    return result


def remove_node(name: str, *, progress: Progress = print) -> dict:
    """Scale down: the program no longer has the node. The reconcile drains and removes it,
    then its instance goes, as `pulumi up` deletes resources last."""
    state = require_state()
    node = find_node(state, name)
    if node.role == "manager" and sum(n["role"] == "manager" for n in state["nodes"]) == 1:
        raise RehearsalError("that is the only manager; the cluster needs one")
    state["nodes"] = [n for n in state["nodes"] if n["name"] != name]
    save_state(state)
    result = converge_again(progress=progress)
    health.stop(node)
    metrics.stop(node)
    nodes_mod.remove_everything_of(node)
    progress(f"{name} drained, removed from the swarm, and its instance terminated")
    return result


def set_stacks(files: list[str], *, progress: Progress = print) -> dict:
    """The program's stack list changed: deploy what is listed, remove the rest."""
    state = require_state()
    prepared = {}
    for arg in files:
        name, _, file = arg.rpartition("=") if "=" in arg else ("", "", arg)
        name = name or stack_name(Path(file))
        shared = any(n["pool"] == SHARED_POOL for n in state["nodes"])
        whole = any(n["pool"] != SHARED_POOL for n in state["nodes"])
        prepared[name] = prepare_stack(Path(file), name, state["kind"], state["gpus_per_node"] if whole else 0, 0,
                                       scale=False, say=progress, shared_kind=state["shared_kind"] if shared else None)
    state["stacks"] = prepared
    save_state(state)
    return converge_again(progress=progress)


def roll(*, progress: Progress = print) -> dict:
    """New node software reaches every node as `pulumi up` rolls it: each pool's nodes one after
    the other (drained, "upgraded", admitted), the pools side by side, as the program's graph
    chains them (components/node_rollout.py). Upgrading here is what the installer's GPU agent
    step does: it writes daemon.json again, and the engine restarts only if that changed
    (node/gpu-swarm-agent.service, node/apply-docker-config.sh). A release that changes no node's
    configuration restarts no engine, so no manager's restart hands the swarm a new leader; what a
    leader change does to GPU bookings is tests/test_swarm_leader_change.py's. Returns the most
    nodes of each pool the swarm had drained at once, and the nodes whose engine restarted."""
    state = require_state()
    engine = find_engine()
    state["rolls"] = state.get("rolls", 0) + 1
    save_state(state)
    want = desired(state)
    first = want.nodes[0]

    def one(node: Node) -> None:
        node_id = nodes_mod.docker(node, engine, "info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
        nodes_mod.run_script(first, engine, rollout.cordon_node(node_id, pool=node.pool, software=want.release))
        if redetect(node, state, engine)["engine_restarted"]:
            restarted.append(node.name)
        admit(want, engine, node, node_id)
        progress(f"{node.name}: software applied and admitted")

    def pool_chain(pool: str) -> None:
        for node in [n for n in want.nodes if n.pool == pool]:
            one(node)

    peak: dict[str, int] = {}
    restarted: list[str] = []
    done = threading.Event()

    def watch() -> None:  # what the swarm itself says: drained nodes per pool
        while not done.is_set():
            out = nodes_mod.docker(first, engine, "node", "ls", "-q", "--filter", f"node.label={POOL_LABEL}",
                                   check=False).stdout.split()
            counts: dict[str, int] = {}
            for info in placement_nodes(first, engine, out):
                if info["Spec"].get("Availability") == "drain":
                    pool = (info["Spec"].get("Labels") or {}).get(POOL_LABEL, "?")
                    counts[pool] = counts.get(pool, 0) + 1
            for pool, n in counts.items():
                peak[pool] = max(peak.get(pool, 0), n)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        parallel(pool_chain, list(dict.fromkeys(n.pool for n in want.nodes)))
    finally:
        done.set()
        watcher.join()
    converge(want, engine, progress)
    return {"peak_drained_per_pool": peak, "engines_restarted": sorted(restarted), "view": status()}


def placement_nodes(manager: Node, engine, ids: list[str]) -> list[dict]:
    if not ids:
        return []
    proc = nodes_mod.docker(manager, engine, "node", "inspect", *ids, check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else []


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
