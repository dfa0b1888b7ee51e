"""The program's real path: `localswarm program up` runs __main__.py, and every command it sends runs on a machine.

The machines boot the program's own user data through real cloud-init, from the freshly
started state an EC2 instance is in; every command runs its own script over real SSH in
the program's dependency order. The module runs one stack through its life: the first
`pulumi up`, a second with nothing changed, and a roll of new node software at
`--parallel 1`, where a roll that waited inside a command for another would deadlock.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import pytest

from to_node import commands as node_commands
from to_node import software as node_software
from components.cloud_config import render_cloud_config
from components.remote import as_root
from localswarm import engine, fake_imds, local_cloud, machines, network, nspawn, object_store, program, ssh
from to_node.software import NodeRelease
from tests.rehearsal_tools import cli, cli_json, require_engine, tasks_of

pytestmark = pytest.mark.integration

# The dev stack with two GPU nodes in its pool: a roll has a pool in which to keep one node in.
POOLS = json.dumps([{"name": "t4", "instanceType": "g4dn.xlarge", "count": 2}])
UP = ("program", "up", "--stack", "dev", "--set", f"gpuPools={POOLS}", "--json")


def program_up(*extra: str) -> dict:
    proc = cli(*UP, *extra, timeout=1500)
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def first():
    require_engine()
    cli("down")
    report = program_up()
    yield report
    cli("down")


def test_the_first_up_forms_the_swarm_from_freshly_booted_machines(first):
    nodes = {n["name"]: n for n in first["nodes"]}
    assert set(nodes) == {"gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"}
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in nodes.values())
    assert nodes["gpu-swarm-dev-manager-0"]["role"] == "manager"
    for name in ("gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"):
        assert len(nodes[name]["gpus"]) == 1 and nodes[name]["gpus_verified"] is True, nodes[name]
    # The program ran every one of its commands, and only its commands formed the swarm.
    ran = {c["name"] for c in first["commands"]}
    assert "gpu-swarm-swarm-init" in ran and "gpu-swarm-stack-gpu-smoke-deploy" in ran
    assert first["commands_executed"] == len(ran) and first["unchanged_commands"] == 0
    for node in ("managers-0", "t4-0", "t4-1"):
        for step in ("boot-{}-wait", "member-{}-join", "rollout-{}-admit"):
            assert f"gpu-swarm-{step.format(node)}" in ran
        # It booted the release and joined drained: its cordon and upgrade are made, and run nothing.
        assert not {f"gpu-swarm-rollout-{node}-cordon", f"gpu-swarm-rollout-{node}-upgrade"} & ran, node


def test_the_stack_runs_on_the_gpus_the_program_advertised(first):
    tasks = tasks_of(first, "gpu-smoke_gpu")
    running = [t for t in tasks if t["state"] == "running"]
    assert len(running) == 2 and {t["node"] for t in running} == {"gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"}
    assert all(len(t["gpus"]) == 1 and t["gpus_from"] == "container" for t in running)


def test_every_node_booted_its_user_data_with_cloud_init_and_reports_its_steps(first):
    timings = first["outputs"]["bootstrapTimings"]
    assert set(timings) == {"gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"}
    for node, steps in timings.items():
        assert steps["cloud-init"]["status"] == "done" and steps["fetch-bundle"]["status"] == "done", node
        # The rehearsal's image has Docker and the (stand-in) driver and toolkit: those steps skip.
        assert steps["install-docker"]["status"] == "skipped", node
    gpu = timings["gpu-swarm-dev-t4-0"]
    assert gpu["install-nvidia-driver"]["status"] == "skipped" and gpu["install-gpu-agent"]["status"] == "done"
    for m in machines.machines():
        status = json.loads(machines.run(m, ["cloud-init", "status", "--format", "json"]).stdout)
        assert status["status"] == "done", m.name
        installed = machines.run(m, ["cat", f"{node_software.SOFTWARE_DIR}/.bundle"]).stdout.strip()
        assert installed == first["outputs"]["nodeSoftware"]["bundleSha256"], m.name
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
    instance's metadata options), no token for a container, and sshd taking 256 handshakes at once."""
    pins = node_software.min_versions()
    for m in machines.machines():
        log = machines.run(m, ["cat", node_software.BOOTSTRAP_LOG]).stdout
        assert "IMDS refuses a request without a token: IMDSv2 is required" in log, m.name
        engine_ = machines.run(m, ["docker", "version", "--format",
                                   "{{.Server.Version}} {{range .Server.Components}}{{.Name}}={{.Version}} {{end}}"])
        assert engine_.stdout.startswith(pins["DOCKER_VERSION"] + "+"), engine_.stdout
        assert f"containerd={pins['CONTAINERD_VERSION'].rsplit('.', 1)[0]}." in engine_.stdout, engine_.stdout
        assert "maxstartups 256:30:1024" in machines.run(m, ["sshd", "-T"]).stdout, m.name
    gpu_node = next(m for m in machines.machines() if "toolkit" in machines.run(
        m, ["cat", f"{node_software.STATE_DIR}/bootstrap-timings.json"]).stdout)
    asked = machines.run(gpu_node, FROM_A_CONTAINER, timeout=60).stdout
    assert asked.splitlines()[0].startswith("HTTP/1.0 401"), asked
    assert "token exit 143" in asked and "200 OK" not in asked, asked  # timed out, no token


def test_a_second_up_with_nothing_changed_runs_only_the_health_read(first):
    again = program_up()
    assert [c["name"] for c in again["commands"]] == ["gpu-swarm-health-read"]
    assert again["resources"]["create"] == again["resources"]["replace"] == again["resources"]["delete"] == 0
    assert {n["name"] for n in again["nodes"]} == {n["name"] for n in first["nodes"]}


def test_new_node_software_rolls_in_place_one_node_per_pool_even_one_command_at_a_time(first):
    before = {m.name for m in machines.machines()}
    rolled = program_up("--bump-node-software", "--parallel", "1")
    ran = {c["name"] for c in rolled["commands"]}
    for node in ("managers-0", "t4-0", "t4-1"):
        assert {f"gpu-swarm-rollout-{node}-{step}" for step in ("cordon", "upgrade", "admit")} <= ran, node
    assert not any(name.endswith(("-wait", "-join")) for name in ran)  # no node booted or joined again
    assert {m.name for m in machines.machines()} == before and rolled["resources"]["replace"] == 0
    assert rolled["peak_drained_per_pool"].get("t4", 0) <= 1 and rolled["peak_drained_per_pool"]
    new = rolled["outputs"]["nodeSoftware"]["bundleSha256"]
    assert new != first["outputs"]["nodeSoftware"]["bundleSha256"]
    for m in machines.machines():
        assert machines.run(m, ["cat", f"{node_software.SOFTWARE_DIR}/.bundle"]).stdout.strip() == new, m.name
    assert all(n["availability"] == "active" for n in rolled["nodes"])
    # Each GPU node's smoke task waited for a GPU while its node rolled, and takes it once the node is
    # back: the node's GPU check then either won the GPU and proved it, or saw at once that tasks hold
    # it, instead of waiting its busy_after_s (30 s) out on every node of the roll. (Or the runtime guard
    # refused its job a GPU that a container still held: busy too, and at once.)
    admits = {urn.rsplit("::", 1)[1]: r["outputs"]["stdout"] for urn, r in program.load_state()["resources"].items()
              if urn.endswith(("rollout-t4-0-admit", "rollout-t4-1-admit"))}
    assert len(admits) == 2
    for name, stdout in admits.items():
        check = json.loads(stdout.strip().splitlines()[-1])["check"]
        assert check["verified"] is True or check["busy_because"] == "held" \
            or check["busy_because"].startswith("the runtime guard refused the job"), (name, check)


def test_a_rebooted_node_comes_back_with_its_gpu_and_the_next_up_has_nothing_to_do(first):
    """cloud-init installs once per instance; at every later boot the agent's unit writes the
    GPUs into daemon.json before dockerd starts, and the node rejoins as the same swarm node."""
    records = {r["hostname"]: r for r in program.load_state()["machines"].values()}
    node = records["gpu-swarm-dev-t4-1"]
    m = machines.Machine(node["machine"], node["index"])
    before = {n["name"]: n["gpus"] for n in cli_json("program", "status")["nodes"]}
    machines.stop(m)
    machines.start(m)
    deadline = time.monotonic() + 180
    while True:
        view = {n["name"]: n for n in cli_json("program", "status")["nodes"]}
        node_view = view["gpu-swarm-dev-t4-1"]
        if node_view["state"] == "ready" and node_view["gpus"] == before["gpu-swarm-dev-t4-1"]:
            break
        assert time.monotonic() < deadline, node_view
        time.sleep(2)
    assert set(view) == set(before)  # the same swarm node, not a second one
    again = program_up()
    assert [c["name"] for c in again["commands"]] == ["gpu-swarm-health-read"]


# ---------------------------------------------------------------- day 2 through the engine's own steps

# The pool moved to a type with 4 GPUs, on spot: the replacements take the program's current
# inputs (the market a running node ignores), and a spot node can be reclaimed.
BIGGER = json.dumps([{"name": "t4", "instanceType": "g4dn.12xlarge", "count": 2, "marketType": "spot"}])


def _t4_machines() -> dict[str, str]:
    return {r["machine"]: r["hostname"] for r in program.load_state()["machines"].values()
            if r["hostname"].startswith("gpu-swarm-dev-t4-")}


def test_a_new_gpu_type_replaces_the_pools_nodes_new_ones_first_and_drains_the_old_one_at_a_time(first):
    old = _t4_machines()
    report = program_up("--set", f"gpuPools={BIGGER}")
    new = _t4_machines()
    assert not set(old) & set(new) and sorted(new.values()) == sorted(old.values())
    assert {m.name for m in machines.machines()} >= set(new) and not {m.name for m in machines.machines()} & set(old)
    assert report["resources"]["replace"] >= 2 and report["resources"]["delete"] >= 2
    # The swarm holds the new nodes only, each with its new type's 4 GPUs, checked; the old ones
    # were drained and removed by the reconcile, one at a time, before their instances went.
    nodes = [n for n in report["nodes"] if n["name"].startswith("gpu-swarm-dev-t4-")]
    assert len(nodes) == 2 and all(len(n["gpus"]) == 4 and n["gpus_verified"] is True for n in nodes), nodes
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in report["nodes"])
    assert report["peak_drained_per_pool"].get("t4", 0) <= 1
    assert len([t for t in tasks_of(report, "gpu-smoke_gpu") if t["state"] == "running"]) == 2


def test_a_spot_node_reclaimed_behind_the_programs_back_is_created_again_and_its_swarm_node_removed(first):
    records = {r["hostname"]: r for r in program.load_state()["machines"].values()}
    lost = records["gpu-swarm-dev-t4-1"]
    machines.terminate(machines.Machine(lost["machine"], lost["index"]))  # AWS took it back
    report = program_up("--set", f"gpuPools={BIGGER}")  # refresh (Pulumi.yaml) sees it gone
    assert report["resources"]["create"] >= 1
    ran = {c["name"] for c in report["commands"]}
    assert {"gpu-swarm-boot-t4-1-wait", "gpu-swarm-member-t4-1-join", "gpu-swarm-reconcile-run"} <= ran
    assert not {"gpu-swarm-boot-t4-0-wait", "gpu-swarm-member-t4-0-join"} & ran  # the other node stays as it is
    names = [n["name"] for n in report["nodes"]]
    assert sorted(names) == ["gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0", "gpu-swarm-dev-t4-1"]  # the dead one gone
    assert all(n["state"] == "ready" for n in report["nodes"])


def test_routine_changes_reach_only_what_they_must(first):
    """Rows of the README's Day-2 table, two `pulumi up`s of several changes each: a pool's count up,
    new health settings and a second authorized key; then the count down, the stack removed and a
    new manager type."""
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJdx8rR6pcuMMd7T9M4xI7Dt1uT3v8vV9Hh9qz0y8c3X colleague@laptop"
    kept = _t4_machines()
    grown = json.dumps([{**json.loads(BIGGER)[0], "count": 3}])
    report = program_up("--set", f"gpuPools={grown}", "--set", 'health={"ignoreXids": [94]}',
                        "--set", f"sshAuthorizedKeys={json.dumps([key])}")
    ran = {c["name"] for c in report["commands"]}
    assert set(_t4_machines()) > set(kept) and report["resources"]["replace"] == 0  # nothing replaced
    new = next(n for n in report["nodes"] if n["name"] == "gpu-swarm-dev-t4-2")
    assert new["availability"] == "active" and len(new["gpus"]) == 4 and new["gpus_verified"] is True
    # The new node booted the release: admitted (checked) without a drain or an upgrade of its own.
    assert "gpu-swarm-rollout-t4-2-admit" in ran and "gpu-swarm-rollout-t4-2-upgrade" not in ran
    for node in ("managers-0", "t4-0", "t4-1"):  # the new key reaches every node; no running node is touched
        assert f"gpu-swarm-boot-{node}-access" in ran and f"gpu-swarm-boot-{node}-wait" not in ran
        assert f"gpu-swarm-rollout-{node}-cordon" not in ran
    assert any(name.endswith("-health") for name in ran)  # the health services restarted with the settings
    assert report["peak_drained_per_pool"].get("t4", 0) <= 1 and "managers" not in report["peak_drained_per_pool"]
    manager = next(m for m in program.load_state()["machines"].values() if m["role"] == "manager")
    boot_pid = nspawn.init_pid(machines.Machine(manager["machine"], manager["index"]))

    shrunk = json.dumps([{**json.loads(BIGGER)[0], "count": 1}])
    report = program_up("--set", f"gpuPools={shrunk}", "--set", "stacks=[]", "--set", "managerInstanceType=t3.large")
    assert sorted(n["name"] for n in report["nodes"]) == ["gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"]
    assert len(_t4_machines()) == 1 and report["resources"]["delete"] >= 2
    assert not report["services"]  # the stack the program no longer has is gone from the swarm
    # The manager was resized in place: the same machine, stopped and started (a new init), its
    # Elastic IP kept, so nothing that dials it changed; the swarm came back with it.
    again = next(m for m in program.load_state()["machines"].values() if m["role"] == "manager")
    assert again["machine"] == manager["machine"]
    assert nspawn.init_pid(machines.Machine(again["machine"], again["index"])) != boot_pid
    # Its worker reconnected before `up` ended: the reconcile waits for every kept node to be ready.
    assert all(n["state"] == "ready" for n in report["nodes"]), report["nodes"]


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
    m = machines.launch("lsw-boot-test", index, user_data=render_cloud_config(release),
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


# ---------------------------------------------------------------- a pool rolled in waves (last: it grows the pool)


def test_a_pool_of_4_with_max_unavailable_2_rolls_in_2_waves_even_one_command_at_a_time(first):
    """One up grows the pool to 4 nodes with rollout.maxUnavailable 2; new node software then rolls at
    `--parallel 1`: wave 1's cordons run only once both of wave 0's nodes are admitted, and the swarm
    never sees more than 2 of the pool drained. It keeps the pool's type and market, the manager's
    type and the stacks as the module left them, so nothing else changes."""
    state = program.load_state()["resources"]
    inputs = {engine.name_of(k): r["inputs"] for k, r in state.items()
              if r["type"] in (local_cloud.INSTANCE, local_cloud.SPOT_REQUEST)}
    t4 = next(v for n, v in sorted(inputs.items()) if n.startswith("gpu-swarm-t4-"))
    pool = {"name": "t4", "instanceType": t4["instanceType"], "count": 4, "rollout": {"maxUnavailable": 2},
            **({"marketType": "spot"} if t4.get("instanceMarketOptions") else {})}
    keep = ("--set", f"gpuPools={json.dumps([pool])}", "--set", "stacks=[]",
            "--set", f"managerInstanceType={inputs['gpu-swarm-managers-0']['instanceType']}")
    grown = program_up(*keep)
    assert sorted(n["name"] for n in grown["nodes"] if "-t4-" in n["name"]) == [f"gpu-swarm-dev-t4-{i}" for i in range(4)]
    rolled = program_up(*keep, "--bump-node-software", "--parallel", "1")
    order = [c["name"] for c in rolled["commands"]]  # in the order they finished
    for node in range(4):
        assert {f"gpu-swarm-rollout-t4-{node}-{step}" for step in ("cordon", "upgrade", "admit")} <= set(order), node
    first_wave_in = max(order.index(f"gpu-swarm-rollout-t4-{n}-admit") for n in (0, 1))
    assert all(order.index(f"gpu-swarm-rollout-t4-{n}-cordon") > first_wave_in for n in (2, 3)), order
    assert 1 <= rolled["peak_drained_per_pool"].get("t4", 0) <= 2, rolled["peak_drained_per_pool"]
    assert all(n["availability"] == "active" for n in rolled["nodes"])
    seconds = {c["name"]: c["seconds"] for c in rolled["commands"]}
    per_node = [sum(seconds[f"gpu-swarm-rollout-t4-{n}-{s}"] for s in ("cordon", "upgrade", "admit")) for n in range(4)]
    print(f"roll of 4 GPU nodes in 2 waves at --parallel 1: {rolled['timings']['up_s']} s; per node (cordon + "
          f"upgrade + admit): {', '.join(f'{s:.1f}' for s in per_node)} s; peak drained "
          f"{rolled['peak_drained_per_pool']}")  # the README's roll times (pytest -s)
