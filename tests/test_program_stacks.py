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
from pathlib import Path

import pytest

from localswarm import fake_prices, lane, machines, monitoring_stack, network, pulumi_cli
from tests.rehearsal_tools import cli, diagnostics, our_processes, pulumi, require_engine, tasks_of

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


def test_stacks_whose_tasks_end_settle_and_each_task_is_reported_with_its_end(dev):
    """The dev stack swapped for two: Compose's `nvidia-smi -L` job (7 one-GPU replicas on the one GPU, the
    default restart policy) and tasks that end under restart_policy none, on-failure and as a replicated job.
    Each deploy settles on them; the swarm's view reports each one's last run, exit code and GPU."""
    config_set("stacks[0].name", "job")
    config_set("stacks[0].file", "stacks/examples/gpu-job.yml")
    config_set("stacks[1].name", "ends")
    config_set("stacks[1].file", "tests/data/stacks/tasks-that-end.yml")
    done = pulumi("up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    view = pulumi_cli.status("dev")
    assert not tasks_of(view, "gpu-smoke_gpu")  # the stack the program no longer has is gone
    smi = tasks_of(view, "job_smi")
    assert len(smi) == 7
    ran = [t for t in smi if t["last_run"]]
    assert ran, smi
    offered = {n["name"]: set(n["gpus"]) for n in view["nodes"]}
    for t in ran:
        assert t["exit_code"] == 0 and t["last_run"]["state"] == "complete"
        (gpu,) = t["last_run"]["gpus"]
        assert gpu in offered[t["last_run"]["node"]]
    # Each of the others waits for the GPU, or is on its way to it at the moment of the read (a job's next
    # task starts as the last one ends: CI once read one with no run yet and no such reason).
    in_flight = ("assigned", "accepted", "preparing", "ready", "starting", "running")
    assert all(t["last_run"] or "insufficient resources" in t["reason"] or t["state"] in in_flight for t in smi), smi
    (once,) = tasks_of(view, "ends_once")
    assert (once["state"], once["ended"], once["exit_code"]) == ("complete", True, 0)
    (fails,) = tasks_of(view, "ends_fails-once")
    assert (fails["state"], fails["ended"], fails["exit_code"]) == ("failed", True, 3)
    (until_ok,) = tasks_of(view, "ends_until-ok")
    assert (until_ok["state"], until_ok["ended"], until_ok["exit_code"]) == ("complete", True, 0)
    batch = tasks_of(view, "ends_batch")
    assert len(batch) == 3 and all(t["state"] == "complete" and t["ended"] for t in batch)
    assert set(outputs()["stackTasks"]) == {"job", "ends"}
    table = cli("pulumi", "--stack", "dev", "--status").stdout
    assert "LAST RUN" in table and "EXIT" in table


def test_compose_gpu_requests_run_as_the_rewritten_stack(dev):
    """A model server as Compose guides write it (`gpus: all`), in place of the stacks above: the preview
    rewrites it for swarm and says so, and its task holds every GPU of its node; the web front end none."""
    done = pulumi("config", "rm", "--path", "gpu-swarm:stacks[1]")
    assert done.returncode == 0, done.stderr
    config_set("stacks[0].name", "ollama")
    config_set("stacks[0].file", "tests/data/stacks/gpus-all.yml")
    done = pulumi("up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    assert "services.server.gpus: count all" in " ".join(outputs()["stacks"]["ollama"]["rewrites"])
    view = pulumi_cli.status("dev")
    (server,) = tasks_of(view, "ollama_server")
    (gpu_node,) = [n for n in view["nodes"] if n["gpus"]]
    assert server["state"] == "running" and server["gpus_from"] == "container" and server["node"] == gpu_node["name"]
    assert set(server["gpus"]) == set(gpu_node["gpus"])
    (web,) = tasks_of(view, "ollama_web")
    assert web["state"] == "running" and web["gpus"] == []
    assert not tasks_of(view, "job_smi") and not tasks_of(view, "ends_once")


def test_a_second_up_that_swaps_in_a_stack_swarm_rejects_fails_with_swarms_reason(dev):
    swap_in_the_rejected_stack()
    started = time.monotonic()
    proc = pulumi("up", "--yes")
    took = time.monotonic() - started
    print(f"second up, swapping in a rejected stack, failed after {took:.1f} s")
    failed_as_swarm_said(proc)
    assert took < 240, "a rejection should be seen long before the stack's 300 s wait"
    view = pulumi_cli.status("dev")  # the old stack is gone: the reconcile ran before the deploy
    assert not tasks_of(view, "ollama_server") and tasks_of(view, "models_server")


def test_a_first_up_with_a_stack_swarm_rejects_fails_with_swarms_reason(dev):
    cli("down")
    swap_in_the_rejected_stack()
    failed_as_swarm_said(pulumi("up", "--yes"))


def test_down_removes_every_machine_and_everything_the_rehearsal_made():
    """Last: `localswarm down` of a rehearsal whose up failed, with its machines running; a second is harmless."""
    assert machines.machines() and our_processes()
    assert cli("down").returncode == 0
    assert machines.machines() == [] and not pulumi_cli.holds_machines()
    assert network.our_netns() == [] and network.our_rules() == []
    assert network.BRIDGE not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert our_processes() == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not [root for root in (lane.MACHINES_STATE, lane.NAMESPACED_STATE, lane.NAMESPACED_RUN)
                if f" {root}/" in mounts or f" {root} " in mounts]
    assert cli("down").returncode == 0
