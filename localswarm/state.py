"""The rehearsal's state file and what it asks of the swarm: its nodes, their pools, and the Desired state.

Every command reads the state `up` saved; the swarm steps get it as a Desired, the same
shape the Pulumi program hands its components.
"""
from __future__ import annotations

import hashlib
import json

from to_node import software as node_software
from localswarm import registry
from localswarm.converge import Desired
from localswarm.host import CLI, RehearsalError
from localswarm import nodes as nodes_mod
from localswarm.nodes import STATE_ROOT, Node
from swarm.gpu_check import GpuCheck

STATE_FILE = STATE_ROOT / "state.json"
SHARED_POOL = "shared"


def load_state() -> dict | None:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def save_state(state: dict) -> None:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(STATE_FILE)


def require_state() -> dict:
    state = load_state()
    if not state:
        raise RehearsalError(f"no rehearsal is up; start one with `{CLI} up`")
    return state


def nodes_of(state: dict) -> list[Node]:
    return [Node(**n) for n in state["nodes"]]


def release_of(state: dict) -> str:
    """What the rehearsal's nodes "run": the program's node software and the rehearsal's settings."""
    seed = f"{node_software.software_hash()}\n{state['kind']}\n{state['gpus_per_node']}\n{state.get('rolls', 0)}"
    return hashlib.sha256(seed.encode()).hexdigest()


def desired(state: dict) -> Desired:
    nodes = nodes_of(state)
    # Every rehearsal node has GPUs, managers too, so a small rehearsal still has room to schedule.
    gpus = {n.name: state["gpus_per_node"] for n in nodes}
    return Desired(nodes=nodes, kind=state["kind"], gpus=gpus,
                   stacks={name: s["text"] for name, s in state["stacks"].items()}, release=release_of(state),
                   shared_kind=state.get("shared_kind", ""),
                   slots={n.name: state["slots_per_gpu"] for n in nodes if n.pool == SHARED_POOL},
                   check=GpuCheck(image=registry.STANDIN_IMAGE, devices=False, busy_after_s=8)
                   if any(gpus.values()) else None)


def agent_args(node: Node, state: dict) -> tuple[str, ...]:
    if node.pool == SHARED_POOL:
        return ("--slots-per-gpu", str(state["slots_per_gpu"]), "--shared-kind", state["shared_kind"])
    return ()


def new_node(index: int, role: str, shared: bool = False) -> Node:
    # Pools as the program names them: the managers' own, one GPU pool for the workers, and one
    # whose GPUs are shared. A manager that shares is in the shared pool: it is rolled with it.
    pool = SHARED_POOL if shared else "managers" if role == "manager" else "rehearsal"
    return Node(f"node-{index}", index, role, pool)


def find_node(state: dict, name: str) -> Node:
    node = next((n for n in nodes_of(state) if n.name == name), None)
    if node is None:
        raise RehearsalError(f"no node {name!r}; nodes are {', '.join(n['name'] for n in state['nodes'])}")
    return node


def first_boot(node: Node, state: dict) -> dict:
    """What the node software's bootstrap does here: the agent writes the node's daemon.json."""
    nodes_mod.prepare(node)
    return nodes_mod.run_agent(node, nodes_mod.simulated_gpus(state["gpus_per_node"]), state["kind"],
                               agent_args(node, state))
