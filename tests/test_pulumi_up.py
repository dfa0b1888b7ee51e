"""The real `pulumi up`: Pulumi's own CLI and engine make the dev stack on the rehearsal's machines.

Each aws.ec2.Instance is a machine that boots the program's user data with real cloud-init,
each command.remote.Command runs its own script over real SSH, and the engine (not ours)
orders, parallelises, diffs and records every step (localswarm/pulumi_cli.py,
localswarm/provider_plugin.py, localswarm/plugin_cloud.py). The module runs the stack's life:
the first up from freshly booted machines, a second with nothing changed, a pool grown and
shrunk by one input (`config set --path`), a node replaced (`up --replace URN`), and destroy.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from localswarm import machines, pulumi_cli
from tests.rehearsal_tools import REPO, cli, require_engine

pytestmark = pytest.mark.integration


def pulumi(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localswarm", "pulumi", "--stack", "dev", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def summary(out: str) -> dict[str, int]:
    """The CLI's "Resources:" lines: {"created": 77, "unchanged": 0, ...}."""
    tail = out.rsplit("\nResources:\n", 1)[1].split("\n\n", 1)[0]
    return {m[2]: int(m[1]) for m in re.finditer(r"^\s+(?:[-+~] )?(\d+) (\w+)", tail, re.M)}


def stepped(out: str, word: str) -> set[str]:
    """The resources the CLI's display reports `word` for (created, updated, deleted)."""
    return {m[1] for m in re.finditer(rf"^ [-+~]  \S+ (\S+) {word} \(", out, re.M)}


@pytest.fixture(scope="module")
def first():
    require_engine()
    cli("down")
    planned = pulumi("preview", "--json")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    done = pulumi("--report", "up", "--yes", "--skip-preview")  # as ./scripts/rehearse.sh runs it
    yield json.loads(planned.stdout), done
    cli("down")


def outputs() -> dict:
    shown = pulumi("stack", "output", "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_real_up_makes_what_its_preview_planned_from_freshly_booted_machines(first):
    planned, done = first
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert summary(done.stdout) == {"created": planned["changeSummary"]["create"]}
    assert "pulumi-resource-aws from $PATH" in done.stdout  # the rehearsal's plugin, said by the CLI itself
    assert len(machines.machines()) == 2 and all(machines.running(m) for m in machines.machines())


def test_the_nodes_advertise_their_gpus_and_the_stack_runs(first):
    out = outputs()
    nodes = {n["name"]: n for n in out["inventory"]}
    assert set(nodes) == {"gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"}
    t4 = nodes["gpu-swarm-dev-t4-0"]
    assert t4["gpusVerified"] is True and len(t4["gpusAdvertised"]) == 1
    assert t4["gpusAdvertised"][0].startswith("GPU-") and t4["health"]["state"] == "ready"
    assert nodes["gpu-swarm-dev-manager-0"]["role"] == "manager"
    assert out["stackTasks"]["gpu-smoke"]["services"] == {"gpu-smoke_gpu": "1 running, 1 waiting for resources"}
    assert out["privateKey"] == "[secret]"  # the CLI keeps the secret output a secret


def test_the_report_reads_the_stacks_real_outputs(first):
    report = first[1].stdout.rsplit("\nDuration: ", 1)[1]
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith("gpu-swarm-dev-")}
    assert rows["gpu-swarm-dev-t4-0"][1:] == ["worker", "t4", "ready", "active", "1/1", "yes"]
    assert rows["gpu-swarm-dev-manager-0"][1:] == ["manager", "managers", "ready", "active", "0/0", "-"]
    assert "stack gpu-smoke: gpu-smoke_gpu: 1 running, 1 waiting for resources" in report
    assert re.search(r"gpu-swarm-dev-t4-0: .*cloud-init [\d.]+ s \(done\)", report)
    assert "TOTAL" in report  # the cost table, as the stack output holds it


def test_a_second_up_with_nothing_changed_reads_health_again_and_changes_nothing_else(first):
    again = pulumi("up", "--yes")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    counts = summary(again.stdout)
    # The health read's script carries the time it reads at (components/swarm_health.py): it runs each up.
    assert stepped(again.stdout, "updated") == {"gpu-swarm-health-read"}
    assert counts == {"updated": 1, "unchanged": first[0]["changeSummary"]["create"] - 1}
    assert " refresh (" in again.stdout  # Pulumi.yaml's refresh: always, done by the CLI


def _inventory() -> dict:
    return {n["name"]: n for n in outputs()["inventory"]}


def _set_count(n: int) -> None:
    done = pulumi("config", "set", "--path", "gpu-swarm:gpuPools[0].count", str(n))
    assert done.returncode == 0, done.stderr


def test_a_pool_grown_by_one_input_adds_one_node_and_its_commands(first):
    _set_count(2)
    grown = pulumi("up", "--yes")
    assert grown.returncode == 0, grown.stdout[-3000:] + grown.stderr[-3000:]
    made = stepped(grown.stdout, "created")
    assert {"gpu-swarm-t4-1", "gpu-swarm-t4-1-host-key", "gpu-swarm-boot-t4-1-wait", "gpu-swarm-member-t4-1-join",
            "gpu-swarm-rollout-t4-1-admit"} <= made
    assert not {m for m in made if "t4-0" in m or "managers-0" in m}  # the others are left as they are
    assert not stepped(grown.stdout, "deleted")
    t4_1 = _inventory()["gpu-swarm-dev-t4-1"]
    assert t4_1["health"]["state"] == "ready" and len(t4_1["gpusAdvertised"]) == 1
    # The stack's second replica waits for a GPU: it may take the new one while the admit checks it. The
    # check then runs its unreserved half only and says so (swarm/gpu_check.py); it never fails the node.
    check = _admit_check("gpu-swarm-rollout-t4-1-admit")
    assert check["verified"] is True or (check["gpus_busy"] and check["busy_because"] == "held"), check
    assert t4_1["gpusVerified"] is check["verified"]
    assert len(machines.machines()) == 3


def _admit_check(name: str) -> dict:
    """The GPU check's result that a node's admit printed, as the state holds its stdout."""
    exported = json.loads(pulumi("stack", "export", "--show-secrets").stdout)
    (admit,) = [r for r in exported["deployment"]["resources"] if r["urn"].endswith(f"::{name}")]
    return json.loads(admit["outputs"]["stdout"])["check"]


def test_the_pool_shrunk_takes_its_node_out_of_the_swarm_before_its_instance_goes(first):
    _set_count(1)
    shrunk = pulumi("up", "--yes")
    assert shrunk.returncode == 0, shrunk.stdout[-3000:] + shrunk.stderr[-3000:]
    gone = stepped(shrunk.stdout, "deleted")
    assert "gpu-swarm-t4-1" in gone and all("t4-1" in g for g in gone)
    lines = shrunk.stdout.splitlines()
    reconciled = next(i for i, line in enumerate(lines) if re.search(r"gpu-swarm-reconcile-run updated \(", line))
    terminated = next(i for i, line in enumerate(lines) if re.search(r"Instance gpu-swarm-t4-1 deleted \(", line))
    assert reconciled < terminated  # the engine waited for the program's reconcile (components/swarm_reconcile.py)
    assert set(_inventory()) == {"gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"}
    assert len(machines.machines()) == 2


def test_a_node_replaced_boots_a_new_machine_first_and_the_old_one_goes(first):
    before = _inventory()["gpu-swarm-dev-t4-0"]
    urns = pulumi("stack", "--show-urns")
    urn = re.search(r"(urn:pulumi:\S+aws:ec2/instance:Instance::gpu-swarm-t4-0)\b", urns.stdout)[1]
    replaced = pulumi("up", "--yes", "--replace", urn)
    assert replaced.returncode == 0, replaced.stdout[-3000:] + replaced.stderr[-3000:]
    out = replaced.stdout
    new = re.search(r"^ \+\+ +aws:ec2:Instance gpu-swarm-t4-0 created replacement \(", out, re.M)
    old = re.search(r"^ -- +aws:ec2:Instance gpu-swarm-t4-0 deleted original \(", out, re.M)
    assert new and old and new.start() < old.start()  # create before delete, the engine's default
    after = _inventory()["gpu-swarm-dev-t4-0"]
    assert after["swarmNodeId"] != before["swarmNodeId"] and after["health"]["state"] == "ready"
    assert after["gpusAdvertised"] != before["gpusAdvertised"] and len(after["gpusAdvertised"]) == 1
    assert len(machines.machines()) == 2


def test_destroy_deletes_everything_and_the_machines_go(first):
    gone = pulumi("destroy", "--yes")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-3000:]
    assert summary(gone.stdout) == {"deleted": first[0]["changeSummary"]["create"]}  # the pool is back at 1
    assert machines.machines() == []
    assert not pulumi_cli.holds_machines()
