"""GPU health in the rehearsal, end to end: the real watcher on every node, the real reconciler on
the manager, real engines. A fault drains its node and the tasks move; healing makes it active;
a spot notice drains its node. Labels reach the manager on swarmkit's 20 s node-update tick,
so each wait allows 60 s."""
from __future__ import annotations

import re

import pytest

from localswarm.host import REPO
from tests.rehearsal_tools import cli, cli_json, node_of, rehearsal_up, tasks_of, wait_for

pytestmark = pytest.mark.integration
REPLICAS = 2  # on 6 GPUs: a drained node's tasks have free GPUs to move to
LABEL_WAIT_S = 60


@pytest.fixture(scope="module")
def rehearsal(engine, tmp_path_factory):
    stack = (REPO / "stacks" / "gpu-smoke.yml").read_text()
    compose = tmp_path_factory.mktemp("health") / "smoke.yml"
    compose.write_text(re.sub(r"replicas: \d+", f"replicas: {REPLICAS}", stack, count=1))
    yield from rehearsal_up("--nodes", "3", "--gpus-per-node", "2", "--stack", f"smoke={compose}")


def _running(view: dict) -> list[dict]:
    return [t for t in tasks_of(view, "smoke_gpu") if t["state"] == "running"]


def _worker_with_a_task(view: dict) -> str:
    workers = {n["name"] for n in view["nodes"] if n["role"] == "worker"}
    return next(t["node"] for t in _running(view) if t["node"] in workers)


def test_every_node_reports_healthy(rehearsal):
    view = wait_for(lambda v: all(n["condition"] == "healthy" for n in v["nodes"]), LABEL_WAIT_S,
                    "every watcher's first report to reach the manager")
    assert all(n["availability"] == "active" and n["health"] == "" for n in view["nodes"])


def test_gpu_fault_drains_the_node_its_tasks_move_and_heal_gives_it_back(rehearsal):
    view = wait_for(lambda v: len(_running(v)) == REPLICAS, 60, "both replicas running")
    victim = _worker_with_a_task(view)
    gpu = node_of(view, victim)["gpus"][1]
    fault = cli_json("node", "gpu-fault", victim, "--gpu", gpu, "--xid", "48")
    assert fault == {"node": victim, "gpu": gpu, "xid": 48}

    def drained_and_moved(v: dict) -> bool:
        running = _running(v)
        return (node_of(v, victim)["availability"] == "drain" and len(running) == REPLICAS
                and all(t["node"] != victim for t in running))
    view = wait_for(drained_and_moved, LABEL_WAIT_S, f"{victim} drained and its task running elsewhere")
    # The sentinel drains it at once; the labels that say why follow on the swarm agent's tick, and
    # their reason replaces the sentinel's.
    view = wait_for(lambda v: "xid_48" in node_of(v, victim)["health"], LABEL_WAIT_S, f"{victim}'s labels to say why")
    node = node_of(view, victim)
    assert node["condition"] == "unhealthy" and node["drained_by"] == "health"
    assert node["condition_gpu"] == gpu and "xid_48" in node["condition_reason"]
    assert node["health"].startswith("unhealthy:") and node["health_last"].startswith("drained:")
    assert all(n["availability"] == "active" for n in view["nodes"] if n["name"] != victim)
    table = cli("status").stdout
    row = next(line for line in table.splitlines() if line.startswith(victim + " "))
    assert "drain (health)" in row and "unhealthy: xid_48" in row

    healed = cli_json("node", "gpu-heal", victim)
    assert healed["healed"] == [gpu]
    view = wait_for(lambda v: node_of(v, victim)["availability"] == "active", LABEL_WAIT_S + 10,
                    f"{victim} active again after the heal")
    node = node_of(view, victim)
    assert node["condition"] == "healthy" and node["drained_by"] == "" and node["health"] == ""
    assert node["health_last"].startswith("reactivated:")


def test_spot_notice_drains_the_node(rehearsal):
    view = wait_for(lambda v: len(_running(v)) == REPLICAS and all(n["availability"] == "active" for n in v["nodes"]),
                    60, "every node active, both replicas running")
    victim = _worker_with_a_task(view)
    notice = cli_json("node", "spot-notice", victim)
    assert notice["action"] == "terminate"
    view = wait_for(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    view = wait_for(lambda v: node_of(v, victim)["condition"] == "reclaim", LABEL_WAIT_S, f"{victim}'s labels")
    node = node_of(view, victim)
    assert node["condition"] == "reclaim" and "spot_terminate" in node["condition_reason"]
    assert node["drained_by"] == "health"
    cli_json("node", "gpu-heal", victim)  # the rehearsal's instance survives its notice
    wait_for(lambda v: node_of(v, victim)["availability"] == "active", LABEL_WAIT_S + 10, f"{victim} active again")


def test_a_fault_on_a_gpu_the_node_lacks_is_refused(rehearsal):
    proc = cli("node", "gpu-fault", "node-2", "--gpu", "GPU-not-there", check=False)
    assert proc.returncode == 1
    assert "node-2 has no GPU GPU-not-there; its GPUs are GPU-" in proc.stderr
    proc = cli("node", "gpu-fault", "node-2", "--xid", "5000", check=False)
    assert proc.returncode == 1 and "--xid 5000 is not an XID" in proc.stderr
