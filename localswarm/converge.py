"""The Pulumi program's swarm steps, in the order its resource graph runs them, on the rehearsal's engines.

components/ wires these builders into pulumi-command resources; here they run one after the
other through each node's socket: probe the other managers, init (or join a live swarm),
read the tokens, join every node, admit it, reconcile, deploy the stacks (each deploy waits
until its stack has settled). Running converge() again is what a second `pulumi up` does, so
the scenarios in the tests (replace the first manager, scale down, remove a stack, roll new
software) exercise the very scripts the program sends to AWS.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

from localswarm.host import Engine, parallel
from localswarm.nodes import Node, run_script
from swarm import formation, reconcile, rollout, stacks as stack_scripts
from swarm.gpu_check import GpuCheck
from swarm.labels import POOL_GPU_COUNT_LABEL, POOL_LABEL

OVERLAY_POOL = "10.200.0.0/16"  # the program's default; off the rehearsal's 192.168.213.0/24


@dataclass(frozen=True)
class Desired:
    """What `pulumi up` would be asked for: nodes (managers first), labels, GPUs, stacks, software."""

    nodes: list[Node]
    kind: str
    gpus: dict[str, int]  # node name -> GPUs it has
    stacks: dict[str, str]  # stack name -> compose text
    release: str  # what every node runs (the program's node_software.release)
    shared_kind: str = ""
    slots: dict[str, int] = field(default_factory=dict)  # node name -> slots per GPU, for nodes that share
    check: GpuCheck | None = None  # the post-join GPU check, with the rehearsal's stand-in


def pool_labels(node: Node, gpus: int) -> dict[str, str]:
    labels = {POOL_LABEL: node.pool}
    if node.role == "worker":
        labels[POOL_GPU_COUNT_LABEL] = str(gpus)
    return labels


def admit(desired: Desired, engine: Engine, node: Node, node_id: str) -> tuple[list, dict | None]:
    """admit_node for one node, run on the first manager; returns its resources and GPU check."""
    first = next(n for n in desired.nodes if n.role == "manager")
    gpus = desired.gpus.get(node.name, 0)
    script = rollout.admit_node(node_id, pool_labels(node, gpus), expected_gpus=gpus, kind=desired.kind,
                                software=desired.release, slots_per_gpu=desired.slots.get(node.name, 0),
                                shared_kind=desired.shared_kind, check=desired.check)
    return rollout.admitted(run_script(first, engine, script))


def converge(desired: Desired, engine: Engine, say: Callable[[str], None] = lambda _: None) -> dict:
    """Bring the swarm to `desired`; returns {"cluster_id", "node_ids", "checks"}. Safe to run again."""
    formed = form_swarm(desired, engine, say)
    deploy_stacks(desired, engine)
    return formed


def form_swarm(desired: Desired, engine: Engine, say: Callable[[str], None] = lambda _: None,
               lap: Callable[[str], object] = lambda _: None,
               before_admit: Callable[[], object] = lambda: None) -> dict:
    """Every step up to the reconcile: the swarm has the desired members, admitted.

    lap(phase) is called as each step ends, so `up` can time them; before_admit() waits for
    what the admissions need that `up` prepares meanwhile (the GPU check's image on every node).
    """
    managers = [n for n in desired.nodes if n.role == "manager"]
    first, peers = managers[0], managers[1:]

    answers = parallel(lambda n: run_script(n, engine, formation.probe_manager()), peers)
    init = json.loads(run_script(first, engine,
                                 formation.init_swarm(first.address, peers=[p.address for p in peers],
                                                      address_pool=OVERLAY_POOL),
                                 stdin=formation.live_peers(answers)))
    cluster = init["cluster_id"]
    say(f"{first.name}: {'created the swarm' if init['created'] else 'in swarm'} {cluster[:12]}")
    lap("swarm_init")
    tokens = json.loads(run_script(first, engine, formation.read_join_tokens(cluster)))

    def join(node: Node) -> str:
        script = formation.join_swarm(role=node.role, managers=[m.address for m in managers],
                                      advertise_addr=node.address, expected_cluster=cluster)
        return run_script(node, engine, script, stdin=tokens[node.role] + "\n").strip()

    node_ids = {}
    for node in managers:  # managers one at a time, so Raft grows by one member per step
        node_ids[node.name] = join(node)
    workers = [n for n in desired.nodes if n.role == "worker"]
    node_ids.update(zip((w.name for w in workers), parallel(join, workers)))
    lap("joins")
    before_admit()

    results = parallel(lambda n: admit(desired, engine, n, node_ids[n.name]), desired.nodes)
    checks = {}
    for node, (resources, check) in zip(desired.nodes, results):
        checks[node.name] = check
        verified = "" if check is None else {True: ", GPUs proven", False: ", GPU check FAILED"}.get(
            check.get("verified"), ", GPUs not proven this time (busy, or the check's output unread)")
        say(f"{node.name} is in as {node.role}, advertising {len(resources)} GPU resource(s){verified}")
    lap("admit_and_gpu_check")
    run_script(first, engine, reconcile.reconcile(nodes=list(node_ids.values()), stacks=list(desired.stacks)))
    lap("reconcile")
    return {"cluster_id": cluster, "node_ids": node_ids, "checks": checks}


def deploy_stacks(desired: Desired, engine: Engine, wait_seconds: int = stack_scripts.DEFAULT_WAIT_SECONDS) -> dict:
    """Every stack's deploy command, side by side as the program's run: each returns once its stack
    has settled (node/stack_settle.py), or fails with swarm's reason. Returns each stack's report."""
    first = next(n for n in desired.nodes if n.role == "manager")

    def deploy(item: tuple[str, str]) -> dict:
        name, text = item
        script = stack_scripts.deploy_stack(name, hashlib.sha256(text.encode()).hexdigest(), wait_seconds)
        return stack_scripts.settle_report(run_script(first, engine, script, stdin=text))

    return dict(zip(desired.stacks, parallel(deploy, list(desired.stacks.items()))))
