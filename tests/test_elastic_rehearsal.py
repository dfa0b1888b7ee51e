"""An elastic pool through the program's real path: Pulumi's CLI makes the group, the scaler on the manager sizes it.

The dev stack with its pool elastic (min 0, max 2, idleMinutes 1) and its stack of two one-GPU replicas: the
first `up` makes no GPU node, and the replicas wait. The scaler (node/swarm_scaler.py, on the manager machine)
asks the rehearsal's Auto Scaling endpoint for two nodes, signed with the manager's role from IMDS; the group
boots two machines from its launch template's user data through real cloud-init; each joins the swarm by
itself from its SSM parameter; the scaler admits each through the pool's admit script; both replicas run.
Then one replica goes: its node idles and goes, the other, running a GPU task, is never touched. Then the
stack goes (`pulumi config rm`, and a second `up` without it): the pool goes back to zero nodes.
"""
from __future__ import annotations

import json
import time

import pytest

from localswarm import api, elastic_cloud, machines, network, pulumi_cli, pulumi_host
from tests.rehearsal_tools import cli, config_set_all, diagnostics, pulumi, require_engine

pytestmark = pytest.mark.integration
POOLS = [{"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"max": 2, "idleMinutes": 1}}]
GROUP = "gpu-swarm-dev-t4"


def _pulumi(*args: str) -> None:
    done = pulumi(*args)
    assert done.returncode == 0, diagnostics(done)


def _manager() -> machines.Machine:
    return next(m for m in machines.machines() if m.index < min(elastic_cloud.GROUP_INDEXES))


def _swarm() -> tuple[list[dict], list[dict]]:
    sock = pulumi_host.docker_socket(_manager())
    return api.get(sock, "/nodes"), api.get(sock, "/tasks", filters={"desired-state": ["running"]})


def _until(what: str, check, timeout: float, seen: list | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes, tasks = _swarm()
        if seen is not None:
            seen.append((nodes, tasks))
        if check(nodes, tasks):
            return nodes, tasks
        time.sleep(2)
    raise AssertionError(f"no {what} in {timeout:g} s; the scaler said:\n{_journal()[-3000:]}")


def _journal() -> str:
    return machines.run(_manager(), "journalctl -u gpu-swarm-scaler --no-pager -o cat", timeout=60).stdout


def _gpu_tasks(tasks: list[dict]) -> list[dict]:
    return [t for t in tasks if t["Status"]["State"] == "running" and t.get("GenericResources")]


def _status(nodes: list[dict]) -> dict:
    """The scaler's status label on the manager (empty before its first publish)."""
    manager = next(n for n in nodes if n["Spec"]["Role"] == "manager")
    return json.loads(manager["Spec"].get("Labels", {}).get("gpu-swarm.autoscale.status", "{}"))


def _workers(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n["Spec"]["Role"] == "worker"]


@pytest.fixture(scope="module")
def life():
    require_engine()
    cli("down")
    facts: dict = {}
    try:
        config_set_all({"gpuPools": POOLS})
        _pulumi("up", "--yes")
        facts["first_up_nodes"] = [n["name"] for n in pulumi_cli.status("dev")["nodes"]]
        nodes, tasks = _until("two running replicas", lambda n, t: len(_gpu_tasks(t)) == 2, 420)
        facts["grown"] = {"nodes": nodes, "tasks": _gpu_tasks(tasks),
                          "group": elastic_cloud.STORE.read()["groups"][GROUP]}
        # One replica goes: its node idles out; the other keeps its task, and must be left alone.
        machines.run(_manager(), "docker service scale --detach gpu-smoke_gpu=1", timeout=60)
        busy_seen: list = []
        _until("one elastic node left", lambda n, t: len(_workers(n)) == 1 and len(_gpu_tasks(t)) == 1, 420,
               busy_seen)
        facts["one_left"] = busy_seen
        _pulumi("config", "rm", "gpu-swarm:stacks")
        _pulumi("up", "--yes")
        # The scaler removes the node, then publishes its status on the manager: wait for both.
        nodes, _ = _until("the pool back at zero, said on the manager",
                          lambda n, t: not _workers(n) and " forget " in _status(n).get("t4", {}).get("last", ""), 420)
        state = elastic_cloud.STORE.read()
        facts["zero"] = {"nodes": nodes, "group": state["groups"][GROUP], "machines": state["machines"],
                         "running": sorted(m.name for m in machines.machines())}
        facts["journal"] = _journal()
        yield facts
    finally:
        cli("down")


def test_the_first_up_makes_no_gpu_node_and_the_waiting_replicas_grow_the_pool_until_both_run(life):
    assert life["first_up_nodes"] == ["gpu-swarm-dev-manager-0"]
    grown = life["grown"]
    assert grown["group"]["desired"] == 2 and len(grown["group"]["instances"]) == 2
    workers = {n["ID"]: n for n in _workers(grown["nodes"])}
    assert len(workers) == 2 and {t["NodeID"] for t in grown["tasks"]} == set(workers)
    for n in workers.values():
        labels, engine = n["Spec"]["Labels"], n["Description"]["Engine"]["Labels"]
        # Admitted by the scaler: the pool's labels and the release, after the instance matched the group.
        assert labels["gpu-swarm.pool"] == "t4" and len(labels["gpu-swarm.software"]) == 64
        assert engine["gpu-swarm.instance-id"] in grown["group"]["instances"]
        assert engine["gpu-swarm.elastic-pool"] == "t4"
    assert "pool t4: desired capacity 2: 2 pending GPU task(s) fit the pool" in life["journal"]


def test_a_node_running_a_gpu_task_is_never_taken_out_while_the_idle_one_goes(life):
    rounds = life["one_left"]
    busy = {t["NodeID"] for t in _gpu_tasks(rounds[-1][1])}
    assert len(busy) == 1
    for nodes, _ in rounds:
        for n in nodes:
            if n["ID"] in busy:
                assert n["Spec"]["Availability"] == "active" and "gpu-swarm.autoscale" not in n["Spec"]["Labels"]
    journal = life["journal"]
    for step in (": pause: no GPU task for", ": drain: paused and still without a GPU task",
                 "terminated and the group shrinks: drained, no task left", "removed from the swarm: its instance"):
        assert step in journal, step


def test_removing_the_stack_brings_the_pool_back_to_zero(life):
    zero = life["zero"]
    assert zero["group"]["desired"] == 0 and zero["group"]["instances"] == {} and zero["machines"] == {}
    assert not _workers(zero["nodes"])
    assert zero["running"] == [f"{network.NETNS_PREFIX}1"]  # the manager's machine alone
    status = _status(zero["nodes"])
    assert (status["t4"]["desired"], status["t4"]["ready"], status["t4"]["booting"]) == (0, 0, 0)
    assert " forget " in status["t4"]["last"] and "its instance left the group" in status["t4"]["last"]
