"""A spot pool made by Pulumi's own CLI on the rehearsal's machines: what its notices and a failed GPU do to
the tasks on it. The machines run their own watcher and reconciler, as their user data installed them; the
drills only make a stand-in GPU fail or the instance's IMDS announce (localswarm/machine_health.py).

A stack of its own (its own lane): the dev stack with its pool of 3 one-GPU nodes on spot, a short
health.recoverySeconds, and tests/data/stacks/spot-checkpoint.yml for its stack, all set as a user sets them.
- A task that traps SIGTERM gets the spot pools' stop grace period (swarm/compose_spot.py): on a spot notice
  its node is drained, swarm sends it SIGTERM, and it spends 12 s writing its checkpoint, more than swarm's
  default 10 s, before it exits 0, well inside the notice's two minutes. It then runs on another node.
- A task that dies of its GPU's XID is reported with the XID and the GPU (node/stack_tasks.py).
- A reboot AWS scheduled drains the node as a reclaim does, with the same time to checkpoint.
"""
from __future__ import annotations

import io
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from localswarm import api, pulumi_host
from localswarm.standins import LIB
from tests.rehearsal_tools import cli, cli_json, node_of, require_engine, tasks_of, until
from tests.test_pulumi_up import config_set, machine, status, up

pytestmark = pytest.mark.integration
STACK_FILE = "tests/data/stacks/spot-checkpoint.yml"
CHECKPOINT_S = 12  # the stack's trap: longer than swarm's default grace period (10 s)
LABEL_WAIT_S = 60  # a label reaches the manager on swarmkit's 20 s node-update tick
RECOVERY_S = 5
NODES = [f"gpu-swarm-dev-t4-{i}" for i in range(3)]


@pytest.fixture(scope="module")
def spot_pool():
    require_engine()
    # The stack's job reads the machine's stand-in hardware, where the drill's fault goes.
    assert f'"{LIB}:/rehearsal:ro"' in (Path(__file__).parent.parent / STACK_FILE).read_text()
    cli("down")
    config_set("gpuPools[0].count", "3")
    config_set("gpuPools[0].marketType", "spot")
    config_set("health.recoverySeconds", str(RECOVERY_S))
    config_set("stacks[0].name", "spot")
    config_set("stacks[0].file", STACK_FILE)
    yield up()
    cli("down")


def _wait(predicate, timeout: float, what: str) -> dict:
    return until(lambda: (lambda v: v if predicate(v) else None)(status()), timeout, what, interval=0.5)


def _socket(hostname: str) -> str:
    return pulumi_host.docker_socket(machine(hostname))


def _running(view: dict, service: str) -> dict:
    return next(t for t in tasks_of(view, service) if t["state"] == "running")


def _container(service: str) -> tuple[str, str]:
    """The node and the container of the service's running task, as the manager has them."""
    view = _wait(lambda v: any(t["state"] == "running" for t in tasks_of(v, service)), LABEL_WAIT_S + 30,
                 f"{service} running")
    node = _running(view, service)["node"]
    (task,) = [t for t in api.get(_socket("gpu-swarm-dev-manager-0"), "/tasks", filters={"service": [service]})
               if t["Status"]["State"] == "running"]
    return node, task["Status"]["ContainerStatus"]["ContainerID"]


def _epoch(timestamp: str) -> float:
    whole, _, fraction = timestamp.rstrip("Z").partition(".")
    return datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() \
        + float("0." + (fraction or "0")[:6])


def _checkpointed(node: str, container: str, drained: float, noticed: float) -> float:
    """The task's container stopped with exit 0 and its checkpoint written, well inside the two minutes; when."""
    sock = _socket(node)
    until(lambda: not api.get(sock, f"/containers/{container}/json")["State"]["Running"], 100, "the task stopped")
    state = api.get(sock, f"/containers/{container}/json")["State"]
    assert state["ExitCode"] == 0, state  # its trap ran to the end: not killed (137) at the grace's end
    finished = _epoch(state["FinishedAt"])
    assert finished - drained >= CHECKPOINT_S - 1, "stopped before it could checkpoint"
    assert finished - noticed < 120, f"the notice gives two minutes; the task ended {finished - noticed:.0f} s after"
    archive = api.request(sock, f"/containers/{container}/archive?path=%2Ftmp%2Fcheckpoint")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.extractfile("checkpoint").read() == b"step-42\n"
    return finished - noticed


def test_a_spot_notice_gives_a_task_that_traps_sigterm_time_to_checkpoint_and_it_runs_elsewhere(spot_pool):
    (service,) = api.get(_socket("gpu-swarm-dev-manager-0"), "/services", filters={"name": ["spot_ckpt"]})
    assert service["Spec"]["TaskTemplate"]["ContainerSpec"]["StopGracePeriod"] == 90 * 10**9
    victim, container = _container("spot_ckpt")
    noticed = time.time()
    notice = cli_json("node", "spot-notice", victim)
    assert notice["node"] == victim and notice["action"] == "terminate"
    view = _wait(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    drained = time.time()
    assert node_of(view, victim)["drained_by"] == "health"
    took = _checkpointed(victim, container, drained, noticed)
    print(f"spot notice -> drained {drained - noticed:.1f} s -> checkpoint written, task exited 0 at {took:.1f} s")
    # The drain came on the sentinel; the labels that say why follow on the agent's tick.
    view = _wait(lambda v: node_of(v, victim)["condition"] == "reclaim"
                 and not node_of(v, victim)["health"].endswith(":sentinel"), LABEL_WAIT_S, f"{victim}'s labels")
    assert node_of(view, victim)["health"].startswith("reclaim:spot_")
    _wait(lambda v: any(t["state"] == "running" and t["node"] != victim for t in tasks_of(v, "spot_ckpt")),
          60, "the checkpointing task running on another node")


def test_a_task_that_fails_on_a_faulted_gpu_is_reported_with_the_xid_and_the_gpu(spot_pool):
    task = _running(status(), "spot_cuda-job")
    (gpu,) = task["gpus"]
    assert cli_json("node", "gpu-fault", task["node"], "--gpu", gpu, "--xid", "79")["gpu"] == gpu

    def reported(v: dict) -> bool:
        return any((t.get("last_run") or {}).get("hardware") for t in tasks_of(v, "spot_cuda-job"))
    view = _wait(reported, LABEL_WAIT_S, "the failed task reported with its hardware")
    (job,) = tasks_of(view, "spot_cuda-job")
    assert job["ended"] and job["last_run"]["state"] == "failed" and job["last_run"]["exit_code"] == 3
    assert {k: job["last_run"]["hardware"][k] for k in ("gpu", "xid")} == {"gpu": gpu, "xid": 79}
    table = cli("pulumi", "--stack", "dev", "--status").stdout
    assert (f"spot_cuda-job task 1 failed on GPU {gpu} of {task['node']}, which its node's health watcher marked "
            "faulty (XID 79)") in table, table


def test_scheduled_maintenance_drains_its_node_and_gives_the_task_time_to_checkpoint(spot_pool):
    """IMDS lists a system-reboot a minute away (events/maintenance/scheduled): the node goes as a reclaimed one."""
    for name in NODES:  # every notice and fault above cleared
        cli_json("node", "gpu-heal", name)
    _wait(lambda v: all(n["availability"] == "active" for n in v["nodes"]), LABEL_WAIT_S + RECOVERY_S + 10,
          "every node active again")
    victim, container = _container("spot_ckpt")
    noticed = time.time()
    event = cli_json("node", "maintenance-notice", victim)
    assert event["Code"] == "system-reboot" and event["State"] == "active"
    _wait(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    drained = time.time()
    _checkpointed(victim, container, drained, noticed)
    view = _wait(lambda v: node_of(v, victim)["condition"] == "reclaim"
                 and not node_of(v, victim)["health"].endswith(":sentinel"), LABEL_WAIT_S, f"{victim}'s labels")
    assert node_of(view, victim)["health"].startswith("reclaim:maintenance_now_system-reboot_at_")
    assert node_of(view, victim)["drained_by"] == "health"
    print(f"maintenance notice -> drained {drained - noticed:.1f} s")
