"""GPU isolation and shared GPUs on a swarm made by Pulumi's own CLI (the rehearsal): shared GPUs spread,
a task sees only what it reserved, and no GPU is ever held twice.

The dev stack, set as a user sets it (`pulumi config set-all`): a CPU manager, a pool `whole` of one
g4dn.12xlarge (4 GPUs, not shared) and a pool `shared` of one g4dn.12xlarge whose GPUs are shared as 4
slots each, and the stack tests/data/sharing/spread.yml. Every task goes through the node's runtime
guard, which the node's user data installed (in front of runc here, as it is in front of
nvidia-container-runtime on a GPU node), with its ledger of who holds which GPU; the stand-in image
asks for every GPU (NVIDIA_VISIBLE_DEVICES=all) as CUDA images do, and its nvidia-smi lists what the
runtime gave. Its own lane.
"""
from __future__ import annotations

import collections
import json
import re
import time

import pytest

from localswarm import machines
from swarm.labels import VERIFIED_LABEL
from tests import rehearsal_tools
from tests.rehearsal_tools import (cli, cli_engines, config_set_all, diagnostics, machine, node_of, one_off, pulumi,
                                   require_engine, task_output, tasks_of)
from tests.test_pulumi_up import outputs, status

pytestmark = pytest.mark.integration
WHOLE, SHARED = "gpu-swarm-dev-whole-0", "gpu-swarm-dev-shared-0"
POOLS = [{"name": "whole", "instanceType": "g4dn.12xlarge", "count": 1},
         {"name": "shared", "instanceType": "g4dn.12xlarge", "count": 1, "sharing": {"slotsPerGpu": 4}}]
STACKS = [{"name": "spread", "file": "tests/data/sharing/spread.yml"}]
RUNTIME = "/opt/gpu-swarm/software/gpu-swarm-runtime"  # the guard: Docker's default runtime on a GPU node
# A runtime that lets GPUs leak: the guard skipped, every container straight to the NVIDIA runtime. Not by
# editing daemon.json: the node's agent runs before every engine start and puts the guard back.
BYPASS = '#!/bin/sh\nexec nvidia-container-runtime "$@"\n'


@pytest.fixture(scope="module")
def swarm():
    require_engine()
    cli("down")
    config_set_all({"gpuPools": POOLS, "stacks": STACKS})
    done = pulumi("up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    yield cli_engines()
    cli("down")


def wait_for(predicate, timeout: float, what: str) -> dict:
    return rehearsal_tools.wait_for(predicate, timeout, what, look=status)


def test_every_gpu_node_proved_its_gpus_when_it_joined(swarm):
    checked = {n["name"]: n.get("gpusVerified") for n in outputs()["inventory"]}
    assert {checked[WHOLE], checked[SHARED]} == {True}, checked
    assert {n["availability"] for n in status()["nodes"]} == {"active"}


def running(view: dict, service: str) -> list[dict]:
    return [t for t in tasks_of(view, service) if t["state"] == "running"]


def per_gpu(view: dict, service: str) -> collections.Counter:
    return collections.Counter(t["gpus"][0] for t in running(view, service))


def scale(swarm, replicas: int) -> dict:
    swarm.docker(swarm.lead, "service", "scale", "--detach", f"spread_embed={replicas}")
    return wait_for(lambda v: len(running(v, "spread_embed")) == replicas, 90, f"{replicas} replicas running")


def test_four_replicas_on_four_gpus_with_four_slots_each_take_four_gpus(swarm):
    view = wait_for(lambda v: len(running(v, "spread_embed")) == 4, 60, "4 replicas")
    gpus = per_gpu(view, "spread_embed")
    assert len(gpus) == 4 and set(gpus.values()) == {1}, gpus
    assert {t["node"] for t in running(view, "spread_embed")} == {SHARED}


def test_more_replicas_fill_the_gpus_evenly(swarm):
    try:
        for replicas, most in ((8, 2), (13, 4), (16, 4)):
            gpus = per_gpu(scale(swarm, replicas), "spread_embed")
            assert len(gpus) == 4 and max(gpus.values()) == most and max(gpus.values()) - min(gpus.values()) <= 1
        # One more than the 16 slots: it waits, and no slot is held twice.
        swarm.docker(swarm.lead, "service", "scale", "--detach", "spread_embed=17")
        view = wait_for(lambda v: len(tasks_of(v, "spread_embed")) == 17 and len(running(v, "spread_embed")) == 16
                        and any(t["state"] == "pending" for t in tasks_of(v, "spread_embed")), 90, "16 of 17 running")
        (pending,) = [t for t in tasks_of(view, "spread_embed") if t["state"] == "pending"]
        assert "insufficient resources" in pending["reason"]
        assert set(per_gpu(view, "spread_embed").values()) == {4}  # every shared GPU hosts exactly 4 tasks
        for t in running(view, "spread_embed"):
            (slot,) = t["slots"]
            assert t["gpus"] == [slot.rsplit("-s", 1)[0]] and t["node"] == SHARED
        assert len({s for t in running(view, "spread_embed") for s in t["slots"]}) == 16  # no slot held twice
    finally:
        scale(swarm, 4)


def test_a_service_that_names_a_held_gpu_does_not_start(swarm):
    (held,) = running(status(), "spread_hold")[0]["gpus"]
    log = one_off(swarm, "names-held", WHOLE, "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={held}")
    assert log.startswith(("Failed", "Rejected")), log
    assert f"gpu-swarm guard: GPU {held} is held by container" in log and "never given to another" in log


def test_a_service_that_names_a_held_slot_does_not_start(swarm):
    slot = running(status(), "spread_embed")[0]["slots"][0]
    log = one_off(swarm, "names-slot", SHARED, "--env", f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={slot}")
    assert log.startswith(("Failed", "Rejected")) and f"gpu-swarm guard: slot {slot} is held by container" in log, log


def test_a_whole_gpu_named_on_a_node_that_shares_does_not_start(swarm):
    gpu = running(status(), "spread_embed")[0]["gpus"][0]
    log = one_off(swarm, "names-whole", SHARED, "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={gpu}")
    assert log.startswith(("Failed", "Rejected")) and "this node shares its GPUs" in log, log


def test_a_free_gpu_named_without_a_reservation_is_given_and_held_while_it_runs(swarm):
    """README "Isolation": the guard cannot tell that variable from swarm's on a worker. The free GPU
    is given, and held: a task that swarm gives it meanwhile does not start, naming the holder."""
    view = status()
    node1 = node_of(view, WHOLE)
    (held,) = running(view, "spread_hold")[0]["gpus"]
    free = sorted(set(node1["gpus"]) - {held})
    log = one_off(swarm, "names-free", WHOLE, "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={free[0]}")
    assert log.startswith("Complete") and f"(UUID: {free[0]})" in log, log
    # Held while it runs: a long-running squatter, then every GPU of the whole pool's node reserved by swarm.
    swarm.docker(swarm.lead, "service", "create", "--detach", "--name", "squatter", "--constraint",
                 f"node.hostname=={WHOLE}", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={free[0]}", swarm.image, "sleep",
                 "600")
    try:
        wait_for(lambda v: len(running(v, "squatter")) == 1, 60, "the squatter running")
        swarm.docker(swarm.lead, "service", "scale", "--detach", "spread_hold=4")
        errors = ""
        deadline = time.monotonic() + 90
        while "is held by container" not in errors and time.monotonic() < deadline:
            errors = swarm.docker(swarm.lead, "service", "ps", "--no-trunc", "--format", "{{.Error}}",
                                  "spread_hold").stdout
            time.sleep(1)
        assert f"gpu-swarm guard: GPU {free[0]} is held by container" in errors
        view = status()
        holders = [t["gpus"][0] for t in running(view, "spread_hold")] + [free[0]]  # the squatter's
        assert len(holders) == len(set(holders))  # never two holders of one GPU
    finally:
        swarm.docker(swarm.lead, "service", "rm", "squatter", check=False)
    view = wait_for(lambda v: len(running(v, "spread_hold")) == 4, 90, "all four GPUs held once the squatter left")
    assert sorted(t["gpus"][0] for t in running(view, "spread_hold")) == sorted(node1["gpus"])


def test_a_slot_task_sees_exactly_its_gpu_and_knows_its_share(swarm):
    (container,) = swarm.docker(SHARED, "ps", "-q", "--filter", "label=com.docker.swarm.service.name=spread_embed",
                                "--latest").stdout.split()
    log = swarm.docker(SHARED, "logs", container).stdout
    pid = swarm.docker(SHARED, "inspect", "--format", "{{.State.Pid}}", container).stdout.strip()
    # What the guard gave the task's process, which the container's config does not show: read in the machine.
    environ = machines.run(machine(SHARED), ["cat", f"/proc/{pid}/environ"], check=True).stdout
    env = dict(e.split("=", 1) for e in environ.split("\0") if "=" in e)
    assert env["GPU_SWARM_SHARE"] == "1/4" and env["GPU_SWARM_SLOT"].startswith(env["GPU_SWARM_GPU"] + "-s")
    assert log.strip() == f"GPU 0: NVIDIA T4 (UUID: {env['GPU_SWARM_GPU']})"  # the g4dn's stand-in GPU


def test_whole_gpu_tasks_stay_on_the_pool_without_sharing_and_each_lists_the_gpu_swarm_gave_it(swarm):
    view = status()
    held = running(view, "spread_hold")
    assert held and {t["node"] for t in held} == {WHOLE} and all(len(t["gpus"]) == 1 for t in held)
    assert len({t["gpus"][0] for t in held}) == len(held)  # never two tasks on one GPU
    logs = task_output(swarm, "spread_hold")
    seen = sorted(line.split("UUID: ")[1].rstrip(")") for line in logs.splitlines() if "UUID: " in line)
    assert seen == sorted(t["gpus"][0] for t in held)


@pytest.mark.parametrize("node", [WHOLE, SHARED])
def test_a_task_that_reserved_nothing_sees_no_gpu_whatever_its_image_says(swarm, node):
    log = one_off(swarm, f"nores-{node.rsplit('-', 2)[1]}", node)
    assert log.startswith("Complete") and "No devices were found" in log and "UUID" not in log


def test_a_service_that_sets_the_swarm_variable_itself_does_not_start(swarm):
    log = one_off(swarm, "sneaky", WHOLE, "--env", "DOCKER_RESOURCE_NVIDIA-GPU=all")
    assert log.startswith(("Failed", "Rejected"))
    assert "gpu-swarm guard: DOCKER_RESOURCE_NVIDIA-GPU=all is not a GPU swarm assigned" in log



def test_a_node_whose_runtime_lets_gpus_leak_fails_its_check_when_checked_again_and_is_drained(swarm):
    """The shared node's runtime lets GPUs leak, and its GPU check runs again as docs/stacks/isolation.md
    says: `pulumi up --replace` of its admit. The check's job that reserved nothing sees every GPU, so
    the up fails and the node is drained; with the guard back, the same replace gives the node back."""
    node = machine(SHARED)
    machines.run(node, ["sh", "-c", f"cp -p {RUNTIME} {RUNTIME}.kept && cat >{RUNTIME}"], input=BYPASS, check=True)
    swarm.docker(swarm.lead, "node", "update", "--label-rm", VERIFIED_LABEL, SHARED)
    (urn,) = re.findall(r"urn:[^ ]*gpu-swarm-rollout-shared-0-admit\b", pulumi("stack", "--show-urns").stdout)
    try:
        failed = pulumi("up", "--yes", "--replace", urn)
        said = failed.stdout + failed.stderr
        assert failed.returncode != 0 and "failed its GPU check, so it was drained" in said, diagnostics(failed)
        # The evidence: the job that reserved nothing got all 4 GPUs from the NVIDIA runtime.
        evidence = json.loads(said.split("so it was drained: ", 1)[1].split("Evidence:\n", 1)[1].splitlines()[0])
        assert evidence["unreserved_devices"] == 4 and evidence["unreserved_saw"] == evidence["expected"], evidence
        view = wait_for(lambda v: node_of(v, SHARED)["availability"] == "drain", 30, "the shared node drained")
        assert node_of(view, SHARED)["drained_by"] == "gpu-check"
    finally:
        machines.run(node, ["mv", f"{RUNTIME}.kept", RUNTIME], check=True)
    again = pulumi("up", "--yes", "--replace", urn)  # fixed: the node is given back, and nothing leaks any more
    assert again.returncode == 0, diagnostics(again)
    view = wait_for(lambda v: node_of(v, SHARED)["availability"] == "active", 60, "the shared node active again")
    assert not node_of(view, SHARED)["drained_by"]
