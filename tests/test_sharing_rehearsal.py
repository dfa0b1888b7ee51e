"""Shared GPUs spread, and no GPU is ever held twice, on a real swarm (the rehearsal).

node-1 has 4 whole GPUs, node-2 shares its 4 GPUs as 4 slots each. Every task goes through
the node's runtime guard (in front of runc here, as it is in front of nvidia-container-runtime
on a GPU node), with its ledger of who holds which GPU. Run under the shared lock:
    flock /tmp/lsw.lock .venv/bin/python -m pytest -m integration tests/test_sharing_rehearsal.py
"""
from __future__ import annotations

import collections
import time

import pytest

from localswarm.nodes import Node, docker
from localswarm.registry import STANDIN_IMAGE
from tests.rehearsal_tools import one_off, rehearsal_up, status, tasks_of, wait_for

pytestmark = pytest.mark.integration
STANDIN = STANDIN_IMAGE
MANAGER = Node("node-1", 1, "manager", "managers")
STACK = """\
services:
  embed:   # one slot each: they must spread over node-2's four GPUs before two share one
    image: nvidia/cuda:12.6.3-base-ubuntu24.04
    command: ["sh", "-c", "nvidia-smi -L; exec sleep infinity"]
    deploy:
      replicas: 4
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec: {kind: NVIDIA-GPU-SHARED, value: 1}
  hold:    # one whole GPU of node-1, held
    image: nvidia/cuda:12.6.3-base-ubuntu24.04
    command: ["sh", "-c", "nvidia-smi -L; exec sleep infinity"]
    deploy:
      replicas: 1
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec: {kind: NVIDIA-GPU, value: 1}
"""


@pytest.fixture(scope="module")
def swarm(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("stacks") / "spread.yml"
    path.write_text(STACK)
    yield from rehearsal_up("--nodes", "2", "--gpus-per-node", "4", "--slots-per-gpu", "4", "--shared-nodes", "1",
                            "--stack", f"spread={path}")


def running(view: dict, service: str) -> list[dict]:
    return [t for t in tasks_of(view, service) if t["state"] == "running"]


def per_gpu(view: dict, service: str) -> collections.Counter:
    return collections.Counter(t["gpus"][0] for t in running(view, service))


def scale(engine, replicas: int) -> dict:
    docker(MANAGER, engine, "service", "scale", "--detach", f"spread_embed={replicas}")
    return wait_for(lambda v: len(running(v, "spread_embed")) == replicas, 90, f"{replicas} replicas running")


def test_four_replicas_on_four_gpus_with_four_slots_each_take_four_gpus(swarm):
    view = wait_for(lambda v: len(running(v, "spread_embed")) == 4, 60, "4 replicas")
    gpus = per_gpu(view, "spread_embed")
    assert len(gpus) == 4 and set(gpus.values()) == {1}, gpus
    assert {t["node"] for t in running(view, "spread_embed")} == {"node-2"}


def test_more_replicas_fill_the_gpus_evenly(swarm, engine):
    try:
        for replicas, most in ((8, 2), (13, 4), (16, 4)):
            gpus = per_gpu(scale(engine, replicas), "spread_embed")
            assert len(gpus) == 4 and max(gpus.values()) == most and max(gpus.values()) - min(gpus.values()) <= 1
    finally:
        scale(engine, 4)


def test_a_service_that_names_a_held_gpu_does_not_start(swarm, engine):
    (held,) = running(status(), "spread_hold")[0]["gpus"]
    log = one_off(engine, "names-held", "node-1", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={held}")
    assert log.startswith(("Failed", "Rejected")), log
    assert f"gpu-swarm guard: GPU {held} is held by container" in log and "never given to another" in log


def test_a_service_that_names_a_held_slot_does_not_start(swarm, engine):
    slot = running(status(), "spread_embed")[0]["slots"][0]
    log = one_off(engine, "names-slot", "node-2", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={slot}")
    assert log.startswith(("Failed", "Rejected")) and f"gpu-swarm guard: slot {slot} is held by container" in log, log


def test_a_whole_gpu_named_on_a_node_that_shares_does_not_start(swarm, engine):
    gpu = running(status(), "spread_embed")[0]["gpus"][0]
    log = one_off(engine, "names-whole", "node-2", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={gpu}")
    assert log.startswith(("Failed", "Rejected")) and "this node shares its GPUs" in log, log


def test_a_free_gpu_named_without_a_reservation_is_given_and_held_while_it_runs(swarm, engine):
    """README "Isolation": the guard cannot tell that variable from swarm's on a worker. The free GPU
    is given, and held: a task that swarm gives it meanwhile does not start, naming the holder."""
    view = status()
    node1 = next(n for n in view["nodes"] if n["name"] == "node-1")
    (held,) = running(view, "spread_hold")[0]["gpus"]
    free = sorted(set(node1["gpus"]) - {held})
    log = one_off(engine, "names-free", "node-1", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={free[0]}")
    assert log.startswith("Complete") and f"(UUID: {free[0]})" in log, log
    # Held while it runs: a long-running squatter, then every GPU of node-1 reserved by swarm.
    docker(MANAGER, engine, "service", "create", "--detach", "--name", "squatter", "--constraint",
           "node.hostname==node-1", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={free[0]}", STANDIN, "sleep", "600")
    try:
        wait_for(lambda v: len(running(v, "squatter")) == 1, 60, "the squatter running")
        docker(MANAGER, engine, "service", "scale", "--detach", "spread_hold=4")
        errors = ""
        deadline = time.monotonic() + 90
        while "is held by container" not in errors and time.monotonic() < deadline:
            errors = docker(MANAGER, engine, "service", "ps", "--no-trunc", "--format", "{{.Error}}",
                            "spread_hold").stdout
            time.sleep(1)
        assert f"gpu-swarm guard: GPU {free[0]} is held by container" in errors
        view = status()
        holders = [t["gpus"][0] for t in running(view, "spread_hold")] + [free[0]]  # the squatter's
        assert len(holders) == len(set(holders))  # never two holders of one GPU
    finally:
        docker(MANAGER, engine, "service", "rm", "squatter", check=False)
    view = wait_for(lambda v: len(running(v, "spread_hold")) == 4, 90, "all four GPUs held once the squatter left")
    assert sorted(t["gpus"][0] for t in running(view, "spread_hold")) == sorted(node1["gpus"])
