"""The real `pulumi up`: Pulumi's own CLI and engine make the dev stack on the rehearsal's machines.

Each aws.ec2.Instance is a machine that boots the program's user data with real cloud-init,
each command.remote.Command runs its own script over real SSH, and the engine (not ours)
orders, parallelises, diffs and records every step (localswarm/pulumi_cli.py,
localswarm/provider_plugin.py, localswarm/plugin_cloud.py). The module runs the stack's life:
the first up from freshly booted machines, a second with nothing changed, and destroy.
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


def test_destroy_deletes_everything_and_the_machines_go(first):
    gone = pulumi("destroy", "--yes")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-3000:]
    assert summary(gone.stdout) == {"deleted": first[0]["changeSummary"]["create"]}
    assert machines.machines() == []
    assert not pulumi_cli.holds_machines()
