"""GPU isolation and shared GPUs on a real swarm: every task goes through the node's runtime guard.

The rehearsal's nodes run the guard as their default runtime (in front of runc, as it is in
front of nvidia-container-runtime on a GPU node), and the stand-in image asks for every GPU
(NVIDIA_VISIBLE_DEVICES=all) as CUDA images do; its nvidia-smi lists what the runtime would
give. Two of the three nodes share their GPUs (4 slots each); node-1 has whole GPUs.
"""
from __future__ import annotations

import collections
import json

import pytest

from localswarm import changes
from localswarm.host import RehearsalError
from localswarm.nodes import STATE_ROOT, Node, docker, restart_dockerd
from tests.rehearsal_tools import (cli_json, fast_engines, node_of, node_update, one_off, rehearsal_up, status,
                                   task_output, tasks_of, wait_for)

pytestmark = pytest.mark.integration
MANAGER = Node("node-1", 1, "manager", "managers")



@pytest.fixture(scope="module")
def shared(engine):
    yield from rehearsal_up("--nodes", "3", "--gpus-per-node", "2", "--slots-per-gpu", "4", "--shared-nodes", "2")


def test_every_node_proved_its_gpus_when_it_joined(shared, engine):
    again = cli_json("converge")
    assert set(again["checks"]) == {"node-1", "node-2", "node-3"}
    assert all(check and check["verified"] for check in again["checks"].values())
    assert {n["availability"] for n in again["view"]["nodes"]} == {"active"}


def test_seventeen_shared_replicas_on_sixteen_slots(shared):
    tasks = tasks_of(shared, "inference-shared_embed")
    running = [t for t in tasks if t["state"] == "running"]
    pending = [t for t in tasks if t["state"] == "pending"]
    assert len(tasks) == 17 and len(running) == 16 and len(pending) == 1
    assert "insufficient resources" in pending[0]["reason"]
    per_gpu = collections.Counter((t["node"], t["gpus"][0]) for t in running)
    assert len(per_gpu) == 4 and set(per_gpu.values()) == {4}  # every shared GPU hosts exactly 4 tasks
    for t in running:
        (slot,) = t["slots"]
        assert t["gpus"] == [slot.rsplit("-s", 1)[0]] and t["node"] in ("node-2", "node-3")
    assert len({s for t in running for s in t["slots"]}) == 16  # no slot held twice


def test_a_slot_task_sees_exactly_its_gpu_and_knows_its_share(shared, engine):
    node = Node("node-2", 2, "worker", "shared")
    container = docker(node, engine, "ps", "-q", "--filter",
                       "label=com.docker.swarm.service.name=inference-shared_embed").stdout.split()[0]
    log = docker(node, engine, "logs", container).stdout
    pid = docker(node, engine, "inspect", "--format", "{{.State.Pid}}", container).stdout.strip()
    env = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().decode().split("\0") if "=" in e)
    assert env["GPU_SWARM_SHARE"] == "1/4" and env["GPU_SWARM_SLOT"].startswith(env["GPU_SWARM_GPU"] + "-s")
    assert log.strip() == f"GPU 0: Simulated GPU (UUID: {env['GPU_SWARM_GPU']})"


def test_whole_gpu_tasks_stay_on_the_pool_without_sharing_and_never_share(shared):
    tasks = tasks_of(shared, "smoke_gpu")
    running = [t for t in tasks if t["state"] == "running"]
    assert len(running) == 2 and {t["node"] for t in running} == {"node-1"}
    assert len({t["gpus"][0] for t in running}) == 2 and all(len(t["gpus"]) == 1 for t in running)
    assert [t["state"] for t in tasks if t not in running] == ["pending"]


def test_each_whole_gpu_task_lists_the_gpu_swarm_gave_it(shared, engine):
    logs = task_output(fast_engines(engine), "smoke_gpu")
    seen = sorted(line.split("UUID: ")[1].rstrip(")") for line in logs.splitlines() if "UUID: " in line)
    assert seen == sorted(t["gpus"][0] for t in tasks_of(status(), "smoke_gpu") if t["state"] == "running")


@pytest.mark.parametrize("node", ["node-1", "node-2"])
def test_a_task_that_reserved_nothing_sees_no_gpu_whatever_its_image_says(shared, engine, node):
    log = one_off(fast_engines(engine), f"nores-{node}", node)
    assert log.startswith("Complete") and "No devices were found" in log and "UUID" not in log


def test_a_service_that_sets_the_swarm_variable_itself_does_not_start(shared, engine):
    log = one_off(fast_engines(engine), "sneaky", "node-1", "--env", "DOCKER_RESOURCE_NVIDIA-GPU=all")
    assert log.startswith(("Failed", "Rejected"))
    assert "gpu-swarm guard: DOCKER_RESOURCE_NVIDIA-GPU=all is not a GPU swarm assigned" in log


def test_a_node_whose_runtime_lets_gpus_leak_fails_its_check_and_is_drained(shared, engine):
    node = Node("node-2", 2, "worker", "shared")
    daemon_json = STATE_ROOT / "node-2" / "daemon.json"
    guarded = daemon_json.read_text()
    config = json.loads(guarded)
    del config["default-runtime"], config["runtimes"]["gpu-swarm"]  # as if the guard were lost
    daemon_json.write_text(json.dumps(config))
    restart_dockerd(node, engine)
    node_update(engine, "node-2", "--label-rm", "gpu-swarm.gpus-verified")
    try:
        with pytest.raises(RehearsalError) as err:
            changes.converge_again(progress=lambda _: None)
        assert "failed its GPU check, so it was drained" in str(err.value)
        assert '"unreserved_saw": ["GPU 0: every GPU of the node (NVIDIA_VISIBLE_DEVICES=all, no guard)' in str(err.value)
        view = wait_for(lambda v: node_of(v, "node-2")["availability"] == "drain", 30, "node-2 drained")
        assert node_of(view, "node-2")["drained_by"] == "gpu-check"
    finally:
        daemon_json.write_text(guarded)
        restart_dockerd(node, engine)
    result = cli_json("converge")  # fixed: the node is given back, and nothing leaks any more
    check = result["checks"]["node-2"]
    # Its slots may already be taken again by the tasks that waited for them: that is no evidence.
    assert check["verified"] in (True, None) and check["unreserved_saw"] == []
    view = wait_for(lambda v: node_of(v, "node-2")["availability"] == "active", 30, "node-2 active again")
    assert not node_of(view, "node-2")["drained_by"]
