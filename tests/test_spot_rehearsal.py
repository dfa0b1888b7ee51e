"""Spot notices and failed hardware in the rehearsal, on one `up` whose nodes stand for a spot pool: real
engines, the real watcher on every node and the real reconciler on the manager (localswarm/health.py).

- A task that traps SIGTERM gets the spot pools' stop grace period (swarm/compose_spot.py): on a spot
  notice its node is drained, swarm sends it SIGTERM, and it spends 12 s writing its checkpoint, more
  than swarm's default 10 s, before it exits 0, well inside the notice's two minutes.
- A task that dies of its GPU's XID (it watches the rehearsal's faults file for its own GPU, as a CUDA
  program dies of Xid 79) is reported with the XID and the GPU by `localswarm status` (node/stack_tasks.py).
"""
from __future__ import annotations

import io
import tarfile
import time
from datetime import datetime, timezone

import pytest

from localswarm import api, rehearsal
from localswarm.nodes import STATE_ROOT
from localswarm.state import nodes_of, require_state
from tests.rehearsal_tools import cli, cli_json, node_of, status, tasks_of, wait_for

pytestmark = pytest.mark.integration
CHECKPOINT_S = 12  # longer than swarm's default grace period (10 s): without the spot default it is killed first
LABEL_WAIT_S = 60  # a label reaches the manager on swarmkit's 20 s node-update tick
STACK = f"""\
version: "3.8"
services:
  ckpt:
    image: nvidia/cuda:12.6.3-base-ubuntu24.04
    command: ["sh", "-c", "trap 'sleep {CHECKPOINT_S}; echo step-42 > /tmp/checkpoint; exit 0' TERM;
              while :; do sleep 1; done"]
    deploy:
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec: {{kind: NVIDIA-GPU, value: 1}}
  cuda-job:
    image: nvidia/cuda:12.6.3-base-ubuntu24.04
    volumes: ["{STATE_ROOT}:/rehearsal:ro"]
    command: ["sh", "-c", "while ! cat /rehearsal/*/faults.json 2>/dev/null | grep -q $$NVIDIA_VISIBLE_DEVICES;
              do sleep 0.2; done; echo 'CUDA error: unspecified launch failure (Xid 79)'; exit 3"]
    deploy:
      restart_policy: {{condition: none}}
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec: {{kind: NVIDIA-GPU, value: 1}}
"""


@pytest.fixture(scope="module")
def spot_rehearsal(engine, tmp_path_factory):
    compose = tmp_path_factory.mktemp("spot") / "spot.yml"
    compose.write_text(STACK)
    cli("down")
    started = time.monotonic()
    rehearsal.up(n_nodes=3, gpus=1, stacks=[f"spot={compose}"], spot=True, progress=lambda _: None)
    print(f"up took {time.monotonic() - started:.1f} s")
    yield {n.name: n for n in nodes_of(require_state())}
    cli("down")


def _epoch(timestamp: str) -> float:
    whole, _, fraction = timestamp.rstrip("Z").partition(".")
    return datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() \
        + float("0." + (fraction or "0"))


def _running(view: dict, service: str) -> dict:
    return next(t for t in tasks_of(view, service) if t["state"] == "running")


def test_a_spot_notice_gives_a_task_that_traps_sigterm_time_to_checkpoint(spot_rehearsal):
    nodes = spot_rehearsal
    manager = next(n for n in nodes.values() if n.role == "manager")
    (service,) = api.get(manager.sock, "/services", filters={"name": ["spot_ckpt"]})
    assert service["Spec"]["TaskTemplate"]["ContainerSpec"]["StopGracePeriod"] == 90 * 10**9
    victim = _running(status(), "spot_ckpt")["node"]
    (task,) = [t for t in api.get(manager.sock, "/tasks", filters={"service": ["spot_ckpt"]})
               if t["Status"]["State"] == "running"]
    container = task["Status"]["ContainerStatus"]["ContainerID"]
    noticed = time.time()
    notice = cli_json("node", "spot-notice", victim)
    view = wait_for(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    drained = time.time()
    assert node_of(view, victim)["drained_by"] == "health"
    took = _checkpointed(nodes[victim], container, drained, noticed)
    print(f"spot notice ({notice['action']}) -> drained {drained - noticed:.1f} s -> checkpoint written, task "
          f"exited 0 at {took:.1f} s")
    # The drain came on the sentinel; the labels that say why follow on the agent's tick.
    # The reconciler writes the labels' reason over "sentinel" on its first round after they arrive.
    view = wait_for(lambda v: node_of(v, victim)["condition"] == "reclaim"
                    and not node_of(v, victim)["health"].endswith(":sentinel"), LABEL_WAIT_S, f"{victim}'s labels")
    assert node_of(view, victim)["health"].startswith("reclaim:spot_")
    # The task runs again elsewhere: the node it left is drained.
    wait_for(lambda v: any(t["state"] == "running" and t["node"] != victim for t in tasks_of(v, "spot_ckpt")),
             60, "the checkpointing task running on another node")


def _checkpointed(node, container: str, drained: float, noticed: float) -> float:
    """The task's container stopped with exit 0 and its checkpoint written, well inside the two minutes; when."""
    deadline = time.monotonic() + 90
    while api.get(node.sock, f"/containers/{container}/json")["State"]["Running"]:
        assert time.monotonic() < deadline, "the task was not stopped"
        time.sleep(0.5)
    state = api.get(node.sock, f"/containers/{container}/json")["State"]
    assert state["ExitCode"] == 0, state  # its trap ran to the end: not killed (137) at the grace's end
    took = _epoch(state["FinishedAt"]) - noticed
    assert _epoch(state["FinishedAt"]) - drained >= CHECKPOINT_S - 1, "stopped before it could checkpoint"
    assert took < 120, f"the notice gives two minutes; the task ended {took:.0f} s after it"
    archive = api.request(node.sock, f"/containers/{container}/archive?path=%2Ftmp%2Fcheckpoint")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.extractfile("checkpoint").read() == b"step-42\n"
    return took


def test_a_task_that_fails_on_a_faulted_gpu_is_reported_with_the_xid_and_the_gpu(spot_rehearsal):
    task = _running(status(), "spot_cuda-job")
    (gpu,) = task["gpus"]
    cli_json("node", "gpu-fault", task["node"], "--gpu", gpu, "--xid", "79")

    def reported(v: dict) -> bool:
        return any((t.get("last_run") or {}).get("hardware") for t in tasks_of(v, "spot_cuda-job"))
    view = wait_for(reported, LABEL_WAIT_S, "the failed task reported with its hardware")
    (job,) = tasks_of(view, "spot_cuda-job")
    assert job["ended"] and job["last_run"]["state"] == "failed" and job["last_run"]["exit_code"] == 3
    assert {k: job["last_run"]["hardware"][k] for k in ("gpu", "xid")} == {"gpu": gpu, "xid": 79}
    table = cli("status").stdout
    assert (f"spot_cuda-job task 1 failed on GPU {gpu} of {task['node']}, which its node's health watcher marked "
            "faulty (XID 79)") in table


def test_scheduled_maintenance_drains_its_node_and_gives_the_task_time_to_checkpoint(spot_rehearsal):
    """IMDS lists a system-reboot a minute away (events/maintenance/scheduled): the node goes as a reclaimed one."""
    for name in spot_rehearsal:  # every notice and fault above cleared
        cli_json("node", "gpu-heal", name)
    view = wait_for(lambda v: all(n["availability"] == "active" for n in v["nodes"])
                    and any(t["state"] == "running" for t in tasks_of(v, "spot_ckpt")),
                    LABEL_WAIT_S + 10, "every node active again, the checkpointing task running")
    victim = _running(view, "spot_ckpt")["node"]
    manager = next(n for n in spot_rehearsal.values() if n.role == "manager")
    (task,) = [t for t in api.get(manager.sock, "/tasks", filters={"service": ["spot_ckpt"]})
               if t["Status"]["State"] == "running"]
    noticed = time.time()
    notice = cli_json("node", "maintenance-notice", victim)
    assert notice["Code"] == "system-reboot" and notice["State"] == "active"
    wait_for(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    drained = time.time()
    _checkpointed(spot_rehearsal[victim], task["Status"]["ContainerStatus"]["ContainerID"], drained, noticed)
    view = wait_for(lambda v: node_of(v, victim)["condition"] == "reclaim"
                    and not node_of(v, victim)["health"].endswith(":sentinel"), LABEL_WAIT_S, f"{victim}'s labels")
    assert node_of(view, victim)["health"].startswith("reclaim:maintenance_now_system-reboot_at_")
    assert node_of(view, victim)["drained_by"] == "health"
    print(f"maintenance notice -> drained {drained - noticed:.1f} s")
