"""What a leader change does to swarm's GPU bookkeeping, on real engines, and what still holds.

When a manager becomes leader (a restart of the only manager is enough), swarmkit's scheduler
rebuilds its view of each node from the task store, and books generic resources afresh for every
running task it finds: the node's first free ones, not the ones the task was given (moby/swarmkit
manager/scheduler/nodeinfo.go, addTask; unchanged in the swarmkit that Docker 26.1.5 vendors).
A task that holds a node's second GPU is then booked on the first one, so the scheduler gives
the second GPU, which that task still runs on, to the next task, and leaves the first unused.

The runtime guard refuses such a container: no GPU ever runs two tasks. docs/stacks/isolation.md
says what an operator sees and does. The check below that swarm gives the held GPU again is
the engine's behaviour, kept as a canary: an engine that books GPUs right fails it, and the
docs must then say so.
"""
from __future__ import annotations

import json

import pytest

from localswarm.nodes import Node, docker, restart_dockerd
from localswarm.registry import STANDIN_IMAGE
from localswarm.state import nodes_of, require_state
from swarm.node_contract import GPU_HELD
from tests.rehearsal_tools import KIND, rehearsal_up, until

pytestmark = pytest.mark.integration
# A task's states up to running: the scheduler's rebuild books every task in one of these.
LIVE = ("new", "pending", "assigned", "accepted", "preparing", "ready", "starting", "running")


@pytest.fixture(scope="module")
def two_nodes(engine):
    yield from rehearsal_up("--nodes", "2", "--gpus-per-node", "2")


def _tasks(manager: Node, engine, service: str) -> list[dict]:
    """Every task of `service` as the store holds it: state, error and the GPUs swarm assigned."""
    ids = docker(manager, engine, "service", "ps", "-q", "--no-trunc", service).stdout.split()
    if not ids:
        return []
    # A task listed a moment ago can be gone from the store now (a scale to 0 removes them; CI met
    # it): `docker inspect` then prints the others and says "not found" for it.
    proc = docker(manager, engine, "inspect", "--type", "task", *ids, check=False)
    gone = proc.stderr.count("not found")
    assert proc.returncode == 0 or gone == proc.stderr.count("Error response"), proc.stderr
    docs = json.loads(proc.stdout or "[]")
    return [{"state": t["Status"]["State"], "error": t["Status"].get("Err", ""),
             "gpus": [g["NamedResourceSpec"]["Value"] for g in t.get("GenericResources") or []
                      if g.get("NamedResourceSpec", {}).get("Kind") == KIND]} for t in docs]


def _running_gpus(node: Node, engine) -> list[str]:
    """The GPU of each container running on `node`, from the variable swarm set in it."""
    gpus = []
    for container in docker(node, engine, "ps", "-q").stdout.split():
        env = json.loads(docker(node, engine, "inspect", "--format", "{{json .Config.Env}}", container).stdout)
        gpus += [v.split("=", 1)[1] for v in env if v.startswith(f"DOCKER_RESOURCE_{KIND}=")]
    return gpus


def test_after_a_leader_change_swarm_gives_a_held_gpu_again_and_the_guard_refuses_it(two_nodes, engine):
    manager, worker = nodes_of(require_state())
    node_doc = json.loads(docker(manager, engine, "node", "inspect", worker.name).stdout)[0]
    first, second = [g["NamedResourceSpec"]["Value"] for g in node_doc["Description"]["Resources"]["GenericResources"]
                     if g.get("NamedResourceSpec", {}).get("Kind") == KIND]

    def create(name: str) -> None:
        docker(manager, engine, "service", "create", "--detach", "--name", name, "--constraint",
               f"node.hostname=={worker.name}", "--generic-resource", f"{KIND}=1",
               "--restart-delay", "1s", STANDIN_IMAGE, "sleep", "infinity")

    def holder(name: str) -> str:
        create(name)
        return until(lambda: next((t["gpus"][0] for t in _tasks(manager, engine, name) if t["state"] == "running"),
                                  None), 60, f"{name} running")

    def stop(name: str) -> None:
        """Scaled to 0, and waited for until the store holds no live task of it: the rebuild would book one."""
        docker(manager, engine, "service", "scale", "--detach", f"{name}=0")
        until(lambda: not any(t["state"] in LIVE for t in _tasks(manager, engine, name)), 60, f"{name} stopped")

    stop("smoke_gpu")
    # Two holders take both GPUs; the one on the node's first GPU stops. (Which holder gets which
    # GPU depends on the order swarm got them back from the tasks before.)
    on = {holder("hold-a"): "hold-a", holder("hold-b"): "hold-b"}
    assert set(on) == {first, second}
    stop(on[first])
    until(lambda: _running_gpus(worker, engine) == [second], 30, "one holder left, on the second GPU")

    # Control, with no leader change: the next task gets the free GPU.
    assert holder("control") == first
    stop("control")
    until(lambda: _running_gpus(worker, engine) == [second], 30, "one holder left again")

    restart_dockerd(manager, engine)  # the only manager: it becomes leader again and rebuilds its view
    until(lambda: docker(manager, engine, "node", "ls", check=False).returncode == 0, 60, "the manager back")

    create("after")
    until(lambda: any(GPU_HELD in t["error"] for t in _tasks(manager, engine, "after")), 60,
          "a task of the new service refused by the guard")
    tried = [t for t in _tasks(manager, engine, "after") if t["gpus"]]
    assert {g for t in tried for g in t["gpus"]} == {second}, (
        f"the engine booked the GPUs right after a leader change ({tried}): update docs/stacks/isolation.md "
        "and this test")
    assert all(GPU_HELD in t["error"] for t in tried if t["state"] in ("failed", "rejected")), tried
    # The guard held: the holder still runs alone on its GPU, and the first GPU, free all along, is unused.
    assert _running_gpus(worker, engine) == [second]
    assert not any(t["state"] == "running" for t in _tasks(manager, engine, "after"))
