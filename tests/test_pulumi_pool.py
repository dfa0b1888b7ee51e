"""A pool of 4 GPU nodes made by Pulumi's own CLI on the rehearsal's machines: its roll in waves, and what
each node's own health machinery does with a failing GPU and a scheduled reboot.

A stack of its own (its own lane, beside tests/test_pulumi_up.py, whose life it needs nothing of): the
first up makes the pool of 4 with rollout.maxUnavailable 2, and a health.recoverySeconds short enough
for a drill, all set as a user sets them (`pulumi config set --path`). One up at `--parallel 1` rolls it.
Then the drills: nothing here starts a watcher or a reconciler. Each machine runs the ones its user
data installed (gpu-swarm-health.service, and gpu-swarm-reconciler.service on the manager), and the
drills only make its stand-in GPU fail or its IMDS announce (localswarm/machine_health.py). Labels reach
the manager on swarmkit's 20 s node-update tick, so each wait allows 60 s.
"""
from __future__ import annotations

import time

import pytest

from localswarm import machines, pulumi_cli
from swarm.labels import SOFTWARE_LABEL
from tests.rehearsal_tools import cli, cli_json, node_of, require_engine, tasks_of, until
from tests.test_pulumi_up import config_set, inventory, machine, ran, status, up

pytestmark = pytest.mark.integration
REPLICAS = 2  # the dev stack's gpu-smoke, on 4 GPUs: a drained node's task has free GPUs to move to
LABEL_WAIT_S = 60
RECOVERY_S = 5  # health.recoverySeconds: how long a healed GPU's checks must pass (300 by default)


@pytest.fixture(scope="module")
def pool_of_4():
    require_engine()
    cli("down")
    config_set("gpuPools[0].count", "4")
    config_set("gpuPools[0].rollout.maxUnavailable", "2")
    config_set("health.recoverySeconds", str(RECOVERY_S))
    yield up()
    cli("down")


def _on_manager(*argv: str) -> str:
    return machines.run(machine("gpu-swarm-dev-manager-0"), list(argv), check=True).stdout


def test_a_pool_of_4_with_max_unavailable_2_rolls_in_2_waves_even_one_command_at_a_time(pool_of_4):
    """A pool of 4 nodes with rollout.maxUnavailable 2: new node software rolls at
    `--parallel 1`: wave 1's cordons run only once both of wave 0's nodes are admitted, and the swarm
    never sees more than 2 of the pool drained by the roll. A node an operator drained before stays drained:
    the roll upgrades it and gives back only what it took."""
    assert sorted(n for n in inventory() if "-t4-" in n) == [f"gpu-swarm-dev-t4-{i}" for i in range(4)]
    kept_out = "gpu-swarm-dev-t4-3"
    _on_manager("docker", "node", "update", "--availability", "drain", kept_out)
    started = time.monotonic()
    up("--parallel", "1", rehearsal=("--bump-node-software",))
    seconds = round(time.monotonic() - started, 1)
    order = ran()  # in the order they finished
    for node in range(4):
        assert {f"gpu-swarm-rollout-t4-{node}-{step}" for step in ("cordon", "upgrade", "admit")} <= set(order), node
    first_wave_in = max(order.index(f"gpu-swarm-rollout-t4-{n}-admit") for n in (0, 1))
    assert all(order.index(f"gpu-swarm-rollout-t4-{n}-cordon") > first_wave_in for n in (2, 3)), order
    peak = pulumi_cli.last_run()["peak_drained_per_pool"]  # the operator's drain not counted
    assert 1 <= peak.get("t4", 0) <= 2, peak
    view = status()
    assert node_of(view, kept_out)["availability"] == "drain" and node_of(view, kept_out)["drained_by"] == ""
    assert all(n["availability"] == "active" for n in view["nodes"] if n["name"] != kept_out)
    software = {n: _on_manager("docker", "node", "inspect", "--format",
                               f'{{{{index .Spec.Labels "{SOFTWARE_LABEL}"}}}}', n).strip()
                for n in (kept_out, "gpu-swarm-dev-t4-0")}
    assert software[kept_out] and len(set(software.values())) == 1, software  # upgraded all the same
    _on_manager("docker", "node", "update", "--availability", "active", kept_out)
    took = {c["name"]: c["seconds"] for c in pulumi_cli.last_run()["commands"]}
    per_node = [sum(took[f"gpu-swarm-rollout-t4-{n}-{s}"] for s in ("cordon", "upgrade", "admit")) for n in range(4)]
    print(f"roll of 4 GPU nodes in 2 waves at --parallel 1: {seconds} s; per node (cordon + upgrade + admit): "
          f"{', '.join(f'{s:.1f}' for s in per_node)} s; peak drained {peak}")  # the README's roll times (pytest -s)


# ---------------------------------------------------------------- the nodes' own health machinery


def _running(view: dict) -> list[dict]:
    return [t for t in tasks_of(view, "gpu-smoke_gpu") if t["state"] == "running"]


def _wait(predicate, timeout: float, what: str) -> dict:
    return until(lambda: (lambda v: v if predicate(v) else None)(status()), timeout, what, interval=0.5)


def _serving() -> tuple[dict, str]:
    """Every node active and both replicas running; a GPU node that runs one of them."""
    view = _wait(lambda v: len(_running(v)) == REPLICAS and all(n["availability"] == "active" for n in v["nodes"]),
                 90, "every node active, both replicas running")
    return view, _running(view)[0]["node"]


def test_every_gpu_node_reports_healthy_from_the_watcher_its_user_data_installed(pool_of_4):
    def gpu_nodes(v: dict) -> list[dict]:
        return [n for n in v["nodes"] if n["role"] == "worker"]
    view = _wait(lambda v: all(n["condition"] == "healthy" for n in gpu_nodes(v)), LABEL_WAIT_S,
                 "every GPU node's watcher's report to reach the manager")
    assert len(gpu_nodes(view)) == 4
    assert all(n["availability"] == "active" and n["health"] == "" for n in view["nodes"])
    # A manager has no GPU and no watcher (install-health-watcher runs on GPU nodes), so no report either.
    assert [n["condition"] for n in view["nodes"] if n["role"] == "manager"] == ["unknown"]


def test_a_gpu_fault_drains_its_node_the_task_moves_and_a_heal_gives_it_back(pool_of_4):
    view, victim = _serving()
    (gpu,) = node_of(view, victim)["gpus"]
    assert cli_json("node", "gpu-fault", victim, "--xid", "48") == {"node": victim, "gpu": gpu, "xid": 48}

    def drained_and_moved(v: dict) -> bool:
        running = _running(v)
        return (node_of(v, victim)["availability"] == "drain" and len(running) == REPLICAS
                and all(t["node"] != victim for t in running))
    _wait(drained_and_moved, LABEL_WAIT_S, f"{victim} drained and its task running elsewhere")
    # The sentinel drains it at once; the labels that say why follow on the swarm agent's tick.
    view = _wait(lambda v: "xid_48" in node_of(v, victim)["health"], LABEL_WAIT_S, f"{victim}'s labels to say why")
    node = node_of(view, victim)
    assert node["condition"] == "unhealthy" and node["drained_by"] == "health", node
    assert node["condition_gpu"] == gpu and "xid_48" in node["condition_reason"], node
    assert all(n["availability"] == "active" for n in view["nodes"] if n["name"] != victim)
    row = next(line for line in cli("pulumi", "--stack", "dev", "--status").stdout.splitlines()
               if line.startswith(victim + " "))
    assert "drain (health)" in row and "unhealthy: xid_48" in row, row

    assert cli_json("node", "gpu-heal", victim)["healed"] == [gpu]
    view = _wait(lambda v: node_of(v, victim)["availability"] == "active", LABEL_WAIT_S + RECOVERY_S + 10,
                 f"{victim} active again after the heal")
    node = node_of(view, victim)
    assert node["condition"] == "healthy" and node["drained_by"] == "" and node["health"] == "", node
    assert node["health_last"].startswith("reactivated:"), node


def test_a_reboot_aws_scheduled_drains_the_node_and_a_spot_notice_is_refused_on_demand(pool_of_4):
    """AWS schedules maintenance for any instance, and every node's watcher asks IMDS for it; an on-demand
    instance never gets a spot notice, so the rehearsal refuses to fake one."""
    _, victim = _serving()
    refused = cli("node", "spot-notice", victim, check=False)
    assert refused.returncode == 1 and f"{victim} is no spot instance (IMDS's instance-life-cycle says on-demand)" in refused.stderr, refused.stderr
    event = cli_json("node", "maintenance-notice", victim)
    assert event["Code"] == "system-reboot" and event["State"] == "active"
    view = _wait(lambda v: node_of(v, victim)["availability"] == "drain", LABEL_WAIT_S, f"{victim} drained")
    assert node_of(view, victim)["drained_by"] == "health"
    view = _wait(lambda v: node_of(v, victim)["condition"] == "reclaim", LABEL_WAIT_S, f"{victim}'s labels")
    assert "maintenance_now_system-reboot" in node_of(view, victim)["condition_reason"]
    assert cli_json("node", "gpu-heal", victim)["notices_cleared"] == 1
    _wait(lambda v: node_of(v, victim)["availability"] == "active", LABEL_WAIT_S + 10, f"{victim} active again")


def test_a_drill_on_a_gpu_or_node_that_is_not_there_is_refused(pool_of_4):
    node = "gpu-swarm-dev-t4-0"
    proc = cli("node", "gpu-fault", node, "--gpu", "GPU-not-there", check=False)
    assert proc.returncode == 1 and f"{node} has no GPU GPU-not-there; its GPUs are GPU-" in proc.stderr, proc.stderr
    proc = cli("node", "gpu-fault", node, "--xid", "5000", check=False)
    assert proc.returncode == 1 and "--xid 5000 is not an XID" in proc.stderr, proc.stderr
    proc = cli("node", "gpu-fault", "node-9", check=False)
    assert proc.returncode == 1 and "no machine of Pulumi's CLI is node-9" in proc.stderr, proc.stderr
