"""`pulumi up` tells the truth about stacks: Pulumi's real CLI runs the program on the rehearsal's machines.

Each stack's deploy command waits on the manager (node/stack_settle.py) until the stack has
settled, and fails the run with swarm's own reason when it will not. The dev stack (Pulumi.dev.yaml:
one GPU, two one-GPU replicas) settles with its second replica waiting for the GPU; a stack whose
task swarm rejects (its bind source is on no node) fails `up` inside the program's own command,
on a second `up` that swaps the dev stack for it (its task first waits for the GPU the old stack's
task still holds) and on a first `up`.
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from localswarm import fake_prices, monitoring_stack, pulumi_cli
from tests.rehearsal_tools import cli, diagnostics, pulumi, require_engine, tasks_of

pytestmark = pytest.mark.integration

BAD = {"name": "models", "file": "tests/data/stacks/bind-source-missing.yml", "waitSeconds": "300"}
REASON = "bind source path does not exist: /srv/gpu-swarm-rehearsal/no-such-models"


def config_set(key: str, value: str) -> None:
    done = pulumi("config", "set", "--path", f"gpu-swarm:{key}", value)
    assert done.returncode == 0, done.stderr


def outputs() -> dict:
    return json.loads(pulumi("stack", "output", "--json", "--show-secrets").stdout)


def swap_in_the_rejected_stack() -> None:
    for key, value in BAD.items():
        config_set(f"stacks[0].{key}", value)


def failed_as_swarm_said(proc: subprocess.CompletedProcess) -> str:
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    # The CLI names the resource whose step failed and prints the node's output that the command failed with.
    assert re.search(r"command:remote:Command \(gpu-swarm-stack-models-deploy\):\s*\n\s*error: ", said), said
    assert "Process exited with status 1" in said, said
    assert "stack models: models_server task 1 failed 3 times and never completed (rejected: " in said, said
    assert REASON in said
    return said


@pytest.fixture(scope="module")
def dev():
    require_engine()
    cli("down")
    done = pulumi("up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    yield outputs()
    cli("down")


def test_the_dev_stack_settles_with_its_extra_replica_waiting_for_the_gpu(dev):
    (running,) = [t for t in tasks_of(pulumi_cli.status("dev"), "gpu-smoke_gpu") if t["state"] == "running"]
    assert len(running["gpus"]) == 1
    reported = dev["stackTasks"]["gpu-smoke"]
    assert reported["services"] == {"gpu-smoke_gpu": "1 running, 1 waiting for resources"}
    (waiting,) = reported["waitingForGpus"]
    assert waiting["service"] == "gpu-smoke_gpu" and "insufficient resources" in waiting["reason"]


def test_with_monitoring_on_up_says_where_to_look_and_prometheus_answers_there(dev):
    """A second up that turns monitoring on: the report prints the stack output's tunnel and addresses, and
    where each answers in the rehearsal; Prometheus, where it says, returns the GPU node's series."""
    config_set("monitoring", "true")
    done = pulumi("--report", "up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    out = done.stdout
    manager_ip = dev["managerPublicIps"][0]
    assert re.search(rf"^  ssh -N -L 3000:localhost:3000 -L 9090:localhost:9090 \S+@{re.escape(manager_ip)}$", out,
                     re.M), out
    assert "  Grafana:    http://localhost:3000" in out and "  Prometheus: http://localhost:9090" in out
    nodes = pulumi_cli.nodes()
    (manager,) = [n for n in nodes if n.role == "manager"]
    where = monitoring_stack.prometheus_task(manager)
    assert where and f"  Prometheus: runs on {where['node']} and answers /-/ready in its task; its published port " \
        f"http://{manager.address}:9090 " in out, out
    assert re.search(rf"^  Grafana:    http://{re.escape(manager.address)}:3000 (does not )?answer.*a stand-in", out,
                     re.M), out
    (gpu_node,) = [n.name for n in nodes if n.role == "worker"]
    deadline = time.monotonic() + 90
    while True:
        series = monitoring_stack.query(where, "gpu_swarm_gpu_up", nodes=nodes)
        if any(s["metric"].get("node") == gpu_node and s["value"][1] == "1" for s in series):
            break
        assert time.monotonic() < deadline, f"Prometheus has no gpu_swarm_gpu_up for {gpu_node}: {series}"
        time.sleep(3)
    # The node's price, as the first up's preview read it: its health command wrote cost.env on the machine, and
    # the exporter its unit runs publishes it. The report prints the preview's table, as `cost` has it.
    (t4,) = [p for p in dev["cost"]["pools"] if p["pool"] == "t4"]
    (price,) = monitoring_stack.query(where, f'gpu_swarm_node_cost_dollars_per_hour{{node="{gpu_node}"}}', nodes=nodes)
    assert float(price["value"][1]) == t4["prices"][0]["perNodeHour"] == float(fake_prices.ON_DEMAND["g4dn.xlarge"])
    assert price["metric"]["instance_type"] == "g4dn.xlarge" and price["metric"]["market"] == "on-demand"
    assert "\n".join(dev["cost"]["table"]) in out


def test_a_second_up_that_swaps_in_a_stack_swarm_rejects_fails_with_swarms_reason(dev):
    swap_in_the_rejected_stack()
    started = time.monotonic()
    proc = pulumi("up", "--yes")
    took = time.monotonic() - started
    print(f"second up, swapping in a rejected stack, failed after {took:.1f} s")
    failed_as_swarm_said(proc)
    assert took < 240, "a rejection should be seen long before the stack's 300 s wait"
    view = pulumi_cli.status("dev")  # the old stack is gone: the reconcile ran before the deploy
    assert not tasks_of(view, "gpu-smoke_gpu") and tasks_of(view, "models_server")


def test_a_first_up_with_a_stack_swarm_rejects_fails_with_swarms_reason(dev):
    cli("down")
    swap_in_the_rejected_stack()
    failed_as_swarm_said(pulumi("up", "--yes"))
