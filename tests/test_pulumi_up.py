"""The real `pulumi up`: Pulumi's own CLI and engine run the program's life on the rehearsal's machines.

Each aws.ec2.Instance is a machine that boots the program's user data with real cloud-init,
from the freshly started state an EC2 instance is in; each command.remote.Command runs its own
script over real SSH; the engine (not ours) orders, parallelises, diffs and records every step
(localswarm/pulumi_cli.py, localswarm/provider_plugin.py, localswarm/plugin_cloud.py). Every
change is made as a user makes it: `pulumi config set --path`, `pulumi up --replace URN`,
`pulumi up --parallel 1`, `pulumi destroy`. The module runs one stack through its life:
1. the first up, two GPU nodes, from freshly booted machines; a second with nothing changed;
2. new node software rolled in place at `--parallel 1` (where a command that waited inside
   another would deadlock); a node rebooted, which the next up leaves alone;
3. the pool grown and shrunk by one input; a node replaced by `--replace`;
4. a new GPU type on spot (every node replaced, new first), one of them reclaimed behind the
   program's back; routine changes of several inputs in two ups, the manager resized in place;
5. destroy. (A pool of 4 rolled in 2 waves, and its nodes' health drills, are tests/test_pulumi_pool.py: a stack of its own, so it runs
   beside this module, in a lane of its own.)
A command's host and seconds, and the most nodes of a pool drained at once, are what the
rehearsal records beside the CLI (pulumi_cli.last_run()): the CLI's display does not say them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from to_node import commands as node_commands
from to_node import software as node_software
from to_node.software import NodeRelease
from components.cloud_config import render_cloud_config
from components.remote import as_root
from localswarm import aws_moves, fake_aws, fake_imds, machines, network, nspawn, object_store, pulumi_cli, ssh
from settings.aws_lookups import UBUNTU_AMI_PARAMETER
from swarm.labels import VERIFIED_LABEL
from tests.rehearsal_tools import (REPO, ami_of, cli, diagnostics, machine, pulumi, records, require_engine, tasks_of,
                                   until)

pytestmark = pytest.mark.integration

NODES = {"gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"}
# Ubuntu's next image (the dev stack's `image: ubuntu`), which AWS publishes as "latest" after the first up.
NEXT_UBUNTU_AMI = "ami-0a1b2c3d4e5f60719"


def up(*args: str, rehearsal: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`pulumi up --yes` (and args); rehearsal: localswarm's own flags, before the CLI's."""
    done = pulumi(*rehearsal, "up", "--yes", *args)
    assert done.returncode == 0, diagnostics(done)
    return done


def interrupted_up(ready) -> subprocess.CompletedProcess:
    """`pulumi up --yes`, and a Ctrl-C once ready() holds: SIGINT to the command's process group, as a
    terminal sends it to its foreground job. Its output goes to files: a pipe nobody reads would stall it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "localswarm", "pulumi", "--stack", "dev", "up", "--yes"],
                                cwd=REPO, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            until(lambda: proc.poll() is not None or ready(), 600, "the moment to press Ctrl-C", interval=0.2)
            assert proc.poll() is None, "the up ended before its Ctrl-C"
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def config_set(key: str, value: str) -> None:
    done = pulumi("config", "set", "--path", f"gpu-swarm:{key}", value)
    assert done.returncode == 0, done.stderr


def summary(out: str) -> dict[str, int]:
    """The CLI's "Resources:" lines: {"created": 77, "unchanged": 0, ...}."""
    tail = out.rsplit("\nResources:\n", 1)[1].split("\n\n", 1)[0]
    return {m[2]: int(m[1]) for m in re.finditer(r"^\s+(?:[-+~] )?(\d+) (\w+)", tail, re.M)}


def stepped(out: str, word: str) -> set[str]:
    """The resources the CLI's display reports `word` for (created, updated, deleted; a replacement's
    "created replacement" and "deleted original" lines are marked ++ and --)."""
    return {m[1] for m in re.finditer(rf"^ [-+~]{{1,2}} +\S+ (\S+) {word} \(", out, re.M)}


def ran() -> list[str]:
    """The commands the last CLI run ran a script of, in the order they finished."""
    return [c["name"] for c in pulumi_cli.last_run()["commands"]]


def outputs() -> dict:
    shown = pulumi("stack", "output", "--json", "--show-secrets")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def inventory() -> dict:
    return {n["name"]: n for n in outputs()["inventory"]}


def status() -> dict:
    return pulumi_cli.status("dev")


def t4_machines() -> dict[str, str]:
    return {r["machine"]: h for h, r in records().items() if h.startswith("gpu-swarm-dev-t4-")}


def admit_check(name: str) -> dict:
    """The GPU check's result that a node's admit printed, as the state holds its stdout."""
    exported = json.loads(pulumi("stack", "export", "--show-secrets").stdout)
    (admit,) = [r for r in exported["deployment"]["resources"] if r["urn"].endswith(f"::{name}")]
    return json.loads(admit["outputs"]["stdout"].strip().splitlines()[-1])["check"]


def checked_or_busy(check: dict) -> bool:
    """A node's GPU check when a stack's task waits for a GPU: it either won the GPU and proved it, or saw
    at once that a task holds it (swarm/gpu_check.py), or the runtime guard refused its job a GPU a
    container still held; it never fails the node, and never waits its busy_after_s out."""
    because = check.get("busy_because") or ""
    return check["verified"] is True or because == "held" or because.startswith("the runtime guard refused the job")


@pytest.fixture(scope="module")
def first():
    require_engine()
    cli("down")
    config_set("gpuPools[0].count", "2")  # two GPU nodes: a roll has a node to keep serving
    planned = pulumi("preview", "--json")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    done = pulumi("--report", "up", "--yes", "--skip-preview")  # as ./scripts/rehearse.sh runs it
    yield json.loads(planned.stdout), done, pulumi_cli.last_run()
    cli("down")


# ---------------------------------------------------------------- 1. the first up, and a second


def test_the_first_up_makes_what_its_preview_planned_from_freshly_booted_machines(first):
    planned, done, run = first
    assert done.returncode == 0, diagnostics(done)
    assert summary(done.stdout) == {"created": planned["changeSummary"]["create"]}
    assert "pulumi-resource-aws from $PATH" in done.stdout  # the rehearsal's plugin, said by the CLI itself
    assert {m.name for m in machines.machines()} == {r["machine"] for r in records().values()}
    assert set(records()) == NODES and all(machines.running(m) for m in machines.machines())
    # Only the program's commands formed the swarm, each run once.
    names = [c["name"] for c in run["commands"]]
    assert "gpu-swarm-swarm-init" in names and "gpu-swarm-stack-gpu-smoke-deploy" in names
    assert len(names) == len(set(names))
    for node in ("managers-0", "t4-0", "t4-1"):
        for step in ("boot-{}-wait", "member-{}-join", "rollout-{}-admit"):
            assert f"gpu-swarm-{step.format(node)}" in names
        # It booted the release and joined drained: its cordon and upgrade are made, and run nothing.
        assert not {f"gpu-swarm-rollout-{node}-cordon", f"gpu-swarm-rollout-{node}-upgrade"} & set(names), node
        assert f"gpu-swarm-rollout-{node}-cordon" in stepped(done.stdout, "created")


def test_the_nodes_advertise_their_gpus_and_the_stack_runs_on_them(first):
    out = outputs()
    nodes = {n["name"]: n for n in out["inventory"]}
    assert set(nodes) == NODES and nodes["gpu-swarm-dev-manager-0"]["role"] == "manager"
    for name in ("gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"):
        assert nodes[name]["gpusVerified"] is True and len(nodes[name]["gpusAdvertised"]) == 1, nodes[name]
        assert nodes[name]["gpusAdvertised"][0].startswith("GPU-") and nodes[name]["health"]["state"] == "ready"
    assert out["stackTasks"]["gpu-smoke"]["services"] == {"gpu-smoke_gpu": "2 running"}
    shown = pulumi("stack", "output", "--json")
    assert json.loads(shown.stdout)["privateKey"] == "[secret]"  # the CLI keeps the secret output a secret
    view = status()
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in view["nodes"])
    running = [t for t in tasks_of(view, "gpu-smoke_gpu") if t["state"] == "running"]
    assert {t["node"] for t in running} == {"gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"}
    assert all(len(t["gpus"]) == 1 and t["gpus_from"] == "container" for t in running)
    advertised = {n["name"]: n["gpus"] for n in view["nodes"]}
    assert all(t["gpus"][0] in advertised[t["node"]] for t in running)


def test_the_report_reads_the_stacks_real_outputs(first):
    report = first[1].stdout.rsplit("\nDuration: ", 1)[1]
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith("gpu-swarm-dev-")}
    assert rows["gpu-swarm-dev-t4-0"][1:] == ["worker", "t4", "ready", "active", "1/1", "yes"]
    assert rows["gpu-swarm-dev-manager-0"][1:] == ["manager", "managers", "ready", "active", "0/0", "-"]
    assert "stack gpu-smoke: gpu-smoke_gpu: 2 running" in report
    assert re.search(r"gpu-swarm-dev-t4-0: .*cloud-init [\d.]+ s \(done\)", report)
    assert "TOTAL" in report  # the cost table, as the stack output holds it


def test_every_node_booted_its_user_data_with_cloud_init_and_reports_its_steps(first):
    out = outputs()
    timings = out["bootstrapTimings"]
    assert set(timings) == NODES
    for node, steps in timings.items():
        assert steps["cloud-init"]["status"] == "done" and steps["fetch-bundle"]["status"] == "done", node
        # The rehearsal's image has Docker and the (stand-in) driver and toolkit: those steps skip.
        assert steps["install-docker"]["status"] == "skipped", node
    gpu = timings["gpu-swarm-dev-t4-0"]
    assert gpu["install-nvidia-driver"]["status"] == "skipped" and gpu["install-gpu-agent"]["status"] == "done"
    for m in machines.machines():
        status_ = json.loads(machines.run(m, ["cloud-init", "status", "--format", "json"]).stdout)
        assert status_["status"] == "done", m.name
        installed = machines.run(m, ["cat", f"{node_software.SOFTWARE_DIR}/.bundle"]).stdout.strip()
        assert installed == out["nodeSoftware"]["bundleSha256"], m.name
        # Real systemd: the boot's new units start without a reload each, and one reload at the end
        # reads the enables' links (node/common.sh install_unit, bootstrap.sh reload_once).
        journal = machines.run(m, ["journalctl", "-b", "-o", "cat", "_PID=1"]).stdout.splitlines()
        reloads = [line for line in journal if line.startswith("Reload requested") and "cloud-init" in line]
        assert len(reloads) == 1, (m.name, reloads)


# A container on the node's bridge, as a task: a GET without a token (401 proves IMDS answers it), then a
# token's PUT, which the hop limit of 1 keeps from it (one hop more than the node), so it never answers.
FROM_A_CONTAINER = r"""docker run --rm --network bridge -v /bin/busybox:/busybox:ro gpu-swarm.invalid/check:1 \
  /busybox ash -c 'printf "GET /latest/meta-data/user-data HTTP/1.0\r\n\r\n" | /busybox timeout 5 /busybox nc \
  169.254.169.254 80 | /busybox head -1; printf "PUT /latest/api/token HTTP/1.0\r\nX-aws-ec2-metadata-token-ttl-seconds: \
  60\r\n\r\n" | /busybox timeout 5 /busybox nc 169.254.169.254 80; echo "token exit $?"'"""


def test_every_node_runs_the_pinned_engine_imdsv2_only_and_takes_the_fan_out(first):
    """What each node proved at its boot and what it runs: the engine node/versions.env pins, IMDS refusing a
    request without a token (the secure-imds step's check, against an IMDS that answers as EC2 keeps the
    instance's metadata options, which the aws plugin registered from the instance's inputs), no token for
    a container, and sshd taking 256 handshakes at once."""
    pins = node_software.min_versions()
    for m in machines.machines():
        log = machines.run(m, ["cat", node_software.BOOTSTRAP_LOG]).stdout
        assert "IMDS refuses a request without a token: IMDSv2 is required" in log, m.name
        engine_ = machines.run(m, ["docker", "version", "--format",
                                   "{{.Server.Version}} {{range .Server.Components}}{{.Name}}={{.Version}} {{end}}"])
        assert engine_.stdout.startswith(pins["DOCKER_VERSION"] + "+"), engine_.stdout
        assert f"containerd={pins['CONTAINERD_VERSION'].rsplit('.', 1)[0]}." in engine_.stdout, engine_.stdout
        assert "maxstartups 256:30:1024" in machines.run(m, ["sshd", "-T"]).stdout, m.name
    asked = machines.run(machine("gpu-swarm-dev-t4-0"), FROM_A_CONTAINER, timeout=60).stdout
    assert asked.splitlines()[0].startswith("HTTP/1.0 401"), asked
    assert "token exit 143" in asked and "200 OK" not in asked, asked  # timed out, no token


def test_a_second_up_with_nothing_changed_reads_health_again_and_changes_nothing_else(first):
    """Nothing changed in the program or its stack; AWS has published a new "latest" Ubuntu image since
    the first up, which the program's lookup finds, and which changes nothing either: the GPU pool keeps
    the image its first up found, and no running node, the manager included, is replaced or stopped for
    it (docs/operations/day-2.md)."""
    assert {ami_of(n) for n in NODES} == {fake_aws.UBUNTU_AMI}
    aws_moves.publish_image(UBUNTU_AMI_PARAMETER, NEXT_UBUNTU_AMI, root_gib=8)
    again = up()
    # The health read's script carries the time it reads at (components/swarm_health.py): it runs each up.
    assert stepped(again.stdout, "updated") == {"gpu-swarm-health-read"} and ran() == ["gpu-swarm-health-read"]
    assert summary(again.stdout) == {"updated": 1, "unchanged": first[0]["changeSummary"]["create"] - 1}
    assert " refresh (" in again.stdout  # Pulumi.yaml's refresh: always, done by the CLI


# ---------------------------------------------------------------- 2. a roll in place, a reboot


def test_new_node_software_rolls_in_place_one_node_per_pool_even_one_command_at_a_time(first):
    before, bundle = {m.name for m in machines.machines()}, outputs()["nodeSoftware"]["bundleSha256"]
    rolled = up("--parallel", "1", rehearsal=("--bump-node-software",))
    names = set(ran())
    for node in ("managers-0", "t4-0", "t4-1"):
        assert {f"gpu-swarm-rollout-{node}-{step}" for step in ("cordon", "upgrade", "admit")} <= names, node
    assert not any(name.endswith(("-wait", "-join")) for name in names)  # no node booted or joined again
    assert {m.name for m in machines.machines()} == before and "replaced" not in summary(rolled.stdout)
    peak = pulumi_cli.last_run()["peak_drained_per_pool"]
    assert 1 <= peak.get("t4", 0) <= 1, peak  # the swarm saw each node drained, never both at once
    new = outputs()["nodeSoftware"]["bundleSha256"]
    assert new != bundle
    for m in machines.machines():
        assert machines.run(m, ["cat", f"{node_software.SOFTWARE_DIR}/.bundle"]).stdout.strip() == new, m.name
    assert all(n["availability"] == "active" for n in status()["nodes"])
    # Each GPU node's smoke task waited for a GPU while its node rolled, and takes it once the node is back.
    for name in ("gpu-swarm-rollout-t4-0-admit", "gpu-swarm-rollout-t4-1-admit"):
        assert checked_or_busy(admit_check(name)), name


def test_a_rebooted_node_comes_back_with_its_gpu_and_the_next_up_has_nothing_to_do(first):
    """cloud-init installs once per instance; at every later boot the agent's unit writes the
    GPUs into daemon.json before dockerd starts, and the node rejoins as the same swarm node."""
    before = {n["name"]: n["gpus"] for n in status()["nodes"]}
    m = machine("gpu-swarm-dev-t4-1")
    machines.stop(m)
    machines.start(m)

    def back():
        view = {n["name"]: n for n in status()["nodes"]}
        node = view["gpu-swarm-dev-t4-1"]
        return view if node["state"] == "ready" and node["gpus"] == before["gpu-swarm-dev-t4-1"] else None
    view = until(back, 180, "gpu-swarm-dev-t4-1 back with its GPU", interval=2)
    assert set(view) == set(before)  # the same swarm node, not a second one
    up()
    assert ran() == ["gpu-swarm-health-read"]


# ---------------------------------------------------------------- 3. one input at a time


def test_a_pool_grown_by_one_input_adds_one_node_and_its_commands_even_after_a_ctrl_c_mid_up(first):
    config_set("gpuPools[0].count", "3")
    # Ctrl-C once the new node's machine is launched, while its commands are still to come: Pulumi cancels,
    # the steps in flight end and are saved, and no step is left pending in the state.
    cut = interrupted_up(lambda: "gpu-swarm-dev-t4-2" in records())
    assert cut.returncode != 0 and re.search(r"cancel", cut.stdout + cut.stderr, re.I), cut.stdout[-3000:]
    deployment = json.loads(pulumi("stack", "export").stdout)["deployment"]
    assert not deployment.get("pending_operations"), deployment["pending_operations"]
    saved = {r["urn"].rsplit("::", 1)[1]: r for r in deployment["resources"]}
    assert saved["gpu-swarm-t4-2"]["id"] in pulumi_cli.world()["machines"]  # its machine, and the state's
    grown = up()  # the next up makes the rest, and not the instance again
    assert "gpu-swarm-t4-2" not in stepped(grown.stdout, "created")
    made = stepped(cut.stdout, "created") | stepped(grown.stdout, "created")
    assert {"gpu-swarm-t4-2", "gpu-swarm-t4-2-host-key", "gpu-swarm-boot-t4-2-wait", "gpu-swarm-member-t4-2-join",
            "gpu-swarm-rollout-t4-2-admit"} <= made
    assert not {m for m in made if re.search(r"t4-[01]|managers-0", m)}  # the others are left as they are
    assert not stepped(grown.stdout, "deleted")
    t4_2 = inventory()["gpu-swarm-dev-t4-2"]
    assert t4_2["health"]["state"] == "ready" and len(t4_2["gpusAdvertised"]) == 1
    assert ami_of("gpu-swarm-dev-t4-2") == fake_aws.UBUNTU_AMI  # its pool's image, not AWS's newest
    check = admit_check("gpu-swarm-rollout-t4-2-admit")
    assert checked_or_busy(check), check
    assert t4_2["gpusVerified"] is check["verified"]
    assert len(machines.machines()) == 4


def test_a_node_left_unverified_is_checked_again_by_replacing_its_admit_as_the_docs_say(first):
    """A GPU check that found the node's GPUs busy leaves it in, unverified, and no up checks it again by
    itself (an admit runs once per release). docs/stacks/isolation.md says how: `pulumi up --replace` of
    its admit command, found with `pulumi stack --show-urns`. Here on the node of three whose GPU no
    gpu-smoke task holds, with its verified label taken away as a busy check leaves it."""
    running = {t["node"] for t in tasks_of(status(), "gpu-smoke_gpu") if t["state"] == "running"}
    (free,) = {"gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1", "gpu-swarm-dev-t4-2"} - running
    node_id = inventory()[free]["swarmNodeId"]
    on_manager = machine("gpu-swarm-dev-manager-0")
    label = machines.run(on_manager, ["docker", "node", "inspect", "--format",
                                      f'{{{{index .Spec.Labels "{VERIFIED_LABEL}"}}}}', node_id], check=True)
    release = label.stdout.strip()
    assert release  # the check of its first admit passed
    machines.run(on_manager, ["docker", "node", "update", "--label-rm", VERIFIED_LABEL, node_id], check=True)
    urns = pulumi("stack", "--show-urns")
    admit = f"gpu-swarm-rollout-{free.removeprefix('gpu-swarm-dev-')}-admit"
    (urn,) = re.findall(rf"urn:[^ ]*{admit}\b", urns.stdout)  # the docs' grep
    again = up("--replace", urn)
    assert admit in ran() and not [c for c in ran() if re.search(r"-(cordon|upgrade|admit|join|wait)$", c) and c != admit]
    check = admit_check(admit)
    assert check["verified"] is True and "note" not in check, check  # its jobs ran, not "verified before"
    label = machines.run(on_manager, ["docker", "node", "inspect", "--format",
                                      f'{{{{index .Spec.Labels "{VERIFIED_LABEL}"}}}}', node_id], check=True)
    assert label.stdout.strip() == release and inventory()[free]["gpusVerified"] is True
    assert stepped(again.stdout, "deleted") <= {admit}  # its original: a command without a delete script
    assert all(n["availability"] == "active" and n["state"] == "ready" for n in status()["nodes"])


def test_the_pool_shrunk_takes_its_node_out_of_the_swarm_before_its_instance_goes(first):
    config_set("gpuPools[0].count", "2")
    shrunk = up()
    gone = stepped(shrunk.stdout, "deleted")
    assert "gpu-swarm-t4-2" in gone and all("t4-2" in g for g in gone)
    lines = shrunk.stdout.splitlines()
    reconciled = next(i for i, line in enumerate(lines) if re.search(r"gpu-swarm-reconcile-run updated \(", line))
    terminated = next(i for i, line in enumerate(lines) if re.search(r"Instance gpu-swarm-t4-2 deleted \(", line))
    assert reconciled < terminated  # the engine waited for the program's reconcile (components/swarm_reconcile.py)
    assert set(inventory()) == NODES and len(machines.machines()) == 3


def test_a_node_replaced_boots_a_new_machine_first_and_the_old_one_goes(first):
    """With its pool's image parameter replaced in the same up, as docs/operations/day-2.md says to move a
    pool to AWS's newest image: the parameter takes the newest and the replaced node boots it. The
    parameter's name is fixed, and the provider's create refuses a name that exists, so it goes first
    (delete_before_replace); the nodes that ignore their AMI are not replaced with it."""
    before, neighbour = inventory()["gpu-swarm-dev-t4-0"], records()["gpu-swarm-dev-t4-1"]["machine"]
    urns = pulumi("stack", "--show-urns")
    urn = re.search(r"(urn:pulumi:\S+aws:ec2/instance:Instance::gpu-swarm-t4-0)\b", urns.stdout)[1]
    image = re.search(r"(urn:pulumi:\S+aws:ssm/parameter:Parameter::gpu-swarm-t4-image)\b", urns.stdout)[1]
    out = up("--replace", urn, "--replace", image).stdout
    new = re.search(r"^ \+\+ +aws:ec2:Instance gpu-swarm-t4-0 created replacement \(", out, re.M)
    old = re.search(r"^ -- +aws:ec2:Instance gpu-swarm-t4-0 deleted original \(", out, re.M)
    assert new and old and new.start() < old.start()  # create before delete, the engine's default
    gone = re.search(r"^ -- +aws:ssm:Parameter gpu-swarm-t4-image deleted original \(", out, re.M)
    made = re.search(r"^ \+\+ +aws:ssm:Parameter gpu-swarm-t4-image created replacement \(", out, re.M)
    assert gone and made and gone.start() < made.start(), out[-4000:]
    assert ami_of("gpu-swarm-dev-t4-0") == NEXT_UBUNTU_AMI
    assert ami_of("gpu-swarm-dev-t4-1") == fake_aws.UBUNTU_AMI  # not replaced, and not stopped
    assert records()["gpu-swarm-dev-t4-1"]["machine"] == neighbour and not re.search(r"t4-1\S* (created replacement|deleted)", out)
    after = inventory()["gpu-swarm-dev-t4-0"]
    assert after["swarmNodeId"] != before["swarmNodeId"] and after["health"]["state"] == "ready"
    assert after["gpusAdvertised"] != before["gpusAdvertised"] and len(after["gpusAdvertised"]) == 1
    assert len(machines.machines()) == 3


# ---------------------------------------------------------------- 4. a new GPU type, a reclaim, routine changes


def test_a_new_gpu_type_replaces_the_pools_nodes_new_ones_first_and_drains_the_old_one_at_a_time(first):
    old = t4_machines()
    config_set("gpuPools[0].instanceType", "g4dn.12xlarge")  # 4 GPUs a node
    config_set("gpuPools[0].marketType", "spot")  # the replacements take the program's current inputs
    moved = up()
    new = t4_machines()
    assert not set(old) & set(new) and sorted(new.values()) == sorted(old.values())
    assert {m.name for m in machines.machines()} >= set(new) and not {m.name for m in machines.machines()} & set(old)
    assert {"gpu-swarm-t4-0", "gpu-swarm-t4-1"} <= stepped(moved.stdout, "created replacement")
    # The swarm holds the new nodes only, each with its new type's 4 GPUs, checked; the old ones
    # were drained and removed by the reconcile, one at a time, before their instances went.
    view, nodes = status(), inventory()
    t4 = [n for n in view["nodes"] if n["name"].startswith("gpu-swarm-dev-t4-")]
    assert len(t4) == 2 and all(len(n["gpus"]) == 4 and nodes[n["name"]]["gpusVerified"] is True for n in t4), t4
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in view["nodes"])
    assert pulumi_cli.last_run()["peak_drained_per_pool"].get("t4", 0) <= 1
    assert len([t for t in tasks_of(view, "gpu-smoke_gpu") if t["state"] == "running"]) == 2


def test_a_spot_node_reclaimed_behind_the_programs_back_is_created_again_and_its_swarm_node_removed(first):
    machines.terminate(machine("gpu-swarm-dev-t4-1"))  # AWS took it back
    again = up()  # refresh (Pulumi.yaml) reads it gone
    assert "gpu-swarm-t4-1" in stepped(again.stdout, "created")
    names = set(ran())
    assert {"gpu-swarm-boot-t4-1-wait", "gpu-swarm-member-t4-1-join", "gpu-swarm-reconcile-run"} <= names
    assert not {"gpu-swarm-boot-t4-0-wait", "gpu-swarm-member-t4-0-join"} & names  # the other node stays as it is
    view = status()
    assert sorted(n["name"] for n in view["nodes"]) == sorted(NODES)  # the dead one gone from the swarm
    assert all(n["state"] == "ready" for n in view["nodes"])


def test_routine_changes_reach_only_what_they_must(first):
    """Rows of the README's Day-2 table, two `pulumi up`s of several changes each: a pool's count up,
    new health settings and a second authorized key; then the count down, the stack removed and a
    new manager type."""
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJdx8rR6pcuMMd7T9M4xI7Dt1uT3v8vV9Hh9qz0y8c3X colleague@laptop"
    kept = t4_machines()
    config_set("gpuPools[0].count", "3")
    config_set("health.ignoreXids[0]", "94")
    config_set("sshAuthorizedKeys[0]", key)
    grown = up()
    names = set(ran())
    assert set(t4_machines()) > set(kept) and not stepped(grown.stdout, "created replacement")  # nothing replaced
    new = next(n for n in status()["nodes"] if n["name"] == "gpu-swarm-dev-t4-2")
    assert new["availability"] == "active" and len(new["gpus"]) == 4
    assert inventory()["gpu-swarm-dev-t4-2"]["gpusVerified"] is True
    # The new node booted the release: admitted (checked) without a drain or an upgrade of its own.
    assert "gpu-swarm-rollout-t4-2-admit" in names and "gpu-swarm-rollout-t4-2-upgrade" not in names
    for node in ("managers-0", "t4-0", "t4-1"):  # the new key reaches every node; no running node is touched
        assert f"gpu-swarm-boot-{node}-access" in names and f"gpu-swarm-boot-{node}-wait" not in names
        assert f"gpu-swarm-rollout-{node}-cordon" not in names
    assert any(name.endswith("-health") for name in names)  # the health services restarted with the settings
    peak = pulumi_cli.last_run()["peak_drained_per_pool"]
    assert peak.get("t4", 0) <= 1 and "managers" not in peak
    boot_pid = nspawn.init_pid(machine("gpu-swarm-dev-manager-0"))
    manager = records()["gpu-swarm-dev-manager-0"]["machine"]

    # A stack someone deployed by hand is not the program's to remove.
    hand = ("services:\n  web:\n    image: nvidia/cuda:12.6.3-base-ubuntu24.04\n    command: [sleep, infinity]\n"
            "    deploy:\n      placement:\n        constraints: [node.role == manager]\n")
    machines.run(machine("gpu-swarm-dev-manager-0"), "docker stack deploy --detach=true -c - handmade >/dev/null",
                 input=hand, check=True)
    config_set("gpuPools[0].count", "1")
    done = pulumi("config", "rm", "gpu-swarm:stacks")
    assert done.returncode == 0, done.stderr
    done = pulumi("config", "set", "gpu-swarm:managerInstanceType", "t3.large")
    assert done.returncode == 0, done.stderr
    shrunk = up()
    view = status()
    assert sorted(n["name"] for n in view["nodes"]) == ["gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"]
    assert len(t4_machines()) == 1 and {"gpu-swarm-t4-1", "gpu-swarm-t4-2"} <= stepped(shrunk.stdout, "deleted")
    # The stack the program no longer has is gone from the swarm; the one deployed by hand is not.
    assert [s["name"] for s in view["services"]] == ["handmade_web"], view["services"]
    # The manager was resized in place: the same machine, stopped and started (a new init), its
    # Elastic IP kept, so nothing that dials it changed; the swarm came back with it.
    assert "gpu-swarm-managers-0" in stepped(shrunk.stdout, "updated")
    assert records()["gpu-swarm-dev-manager-0"]["machine"] == manager
    assert nspawn.init_pid(machine("gpu-swarm-dev-manager-0")) != boot_pid
    # Its worker reconnected before `up` ended: the reconcile waits for every kept node to be ready.
    assert all(n["state"] == "ready" for n in view["nodes"]), view["nodes"]
    machines.run(machine("gpu-swarm-dev-manager-0"), ["docker", "stack", "rm", "handmade"], check=True)


def test_with_the_health_read_off_a_second_up_reports_no_changes(first):
    """The health read is the one command that runs each up (its script carries the time); with
    health.inventoryEachUp off, the stack's next `pulumi up` with nothing changed is Pulumi's own "no
    changes": the CLI's --expect-no-changes fails a preview or an up that would change anything, after
    the refresh Pulumi.yaml asks for, so every Read of the rehearsal's providers matched the state too."""
    config_set("health.inventoryEachUp", "false")
    up()  # the read's script loses its time stamp: one update, once
    preview = pulumi("preview", "--expect-no-changes", "--diff")
    assert preview.returncode == 0, changed_lines(preview)
    again = pulumi("up", "--yes", "--expect-no-changes", "--diff")
    assert again.returncode == 0, changed_lines(again)
    assert set(summary(again.stdout)) == {"unchanged"} and ran() == []


def changed_lines(proc: subprocess.CompletedProcess) -> str:
    """What a run with --diff would change: each step's line and its property lines (the refreshes left out)."""
    lines = [line for line in proc.stdout.splitlines() if re.match(r"^\s*[-+~]", line) and " refresh" not in line]
    return "\n".join(lines[-120:]) + "\n" + proc.stderr[-2000:]


# ---------------------------------------------------------------- a boot that fails, loudly


def test_a_failed_first_boot_fails_its_wait_with_the_nodes_log_and_the_next_wait_installs(tmp_path, first):
    """The boot wait, the program's first command on a node, against a machine whose install failed:
    the bundle is not where its user data says. Then the bundle appears: the next wait installs."""
    # A bucket of this run's own: an object left by an earlier run on this machine would make the boot succeed.
    bucket = f"gpu-swarm-boot-test-{uuid.uuid4().hex[:12]}"
    sha = node_software.bundle_sha256()
    object_store.object_path(bucket, "x").parent.mkdir(parents=True)  # the bucket is there; its object is not
    env = node_software.node_env(gpu=True, gpu_kind="NVIDIA-GPU", instance_type="g4dn.xlarge", image="ubuntu")
    release = NodeRelease(object_store.url(bucket, node_software.bundle_key(sha)), sha, env,
                          tuple(node_software.bootstrap_steps(gpu=True, instance_type="g4dn.xlarge")))
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    index = 200
    # As EC2 launches it from the program's arguments: IMDSv2 required (its first step checks that).
    fake_imds.register(fake_imds.RECORDS, network.node_addr(index), {
        "instance-id": "i-boottest", "user-data": "", "metadataOptions": {
            "httpTokens": "required", "httpPutResponseHopLimit": 1, "httpEndpoint": "enabled"}})
    m = machines.launch(f"{network.NETNS_PREFIX}boot-test", index, user_data=render_cloud_config(release),
                        meta_data={"instance-id": "i-boottest", "local-hostname": "boot-test",
                                   "public-keys": [(tmp_path / "id.pub").read_text().strip()]},
                        gpus=[{"uuid": "GPU-00000000-0000-0000-0000-0000000000aa", "name": "NVIDIA T4",
                               "memory_mib": 15360}],
                        hosts={f"{bucket}.s3.us-east-1.amazonaws.com": network.BRIDGE_ADDR})
    try:
        conn = {"host": m.address, "user": "ubuntu", "privateKey": key.read_text(), "dialErrorLimit": 60,
                "perDialTimeout": 10}
        wait = as_root(node_commands.wait_for_boot(env=env, expected_gpus=1))
        with pytest.raises(ssh.CommandFailed) as failed:
            ssh.run(conn, wait)
        text = str(failed.value)
        print(text)  # what `pulumi up` shows; the README quotes it
        assert "the first boot failed: step fetch-bundle failed" in text
        assert "cannot download the node software" in text and "last 40 lines of" in text
        object_store.put(bucket, node_software.bundle_key(sha), node_software.bundle())
        result = ssh.run(conn, wait)
        timings = json.loads(result.stdout.splitlines()[-1])
        assert timings["fetch-bundle"]["status"] == "done" and timings["install-gpu-agent"]["status"] == "done"
    finally:
        machines.terminate(m)
        fake_imds.unregister(fake_imds.RECORDS, m.address)
        shutil.rmtree(object_store.object_path(bucket, "x").parent, ignore_errors=True)


# ---------------------------------------------------------------- 5. a pool rolled in waves, then destroy


def test_destroy_deletes_everything_and_the_machines_go(first):
    held = json.loads(pulumi("stack", "export").stdout)["deployment"]["resources"]
    # The CLI counts the stack and every resource, but not its default providers.
    counted = [r for r in held if not r["type"].startswith("pulumi:providers:")]
    gone = pulumi("destroy", "--yes")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-3000:]
    assert summary(gone.stdout) == {"deleted": len(counted)}
    assert machines.machines() == []
    assert not pulumi_cli.holds_machines()
