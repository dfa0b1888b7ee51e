"""The real `pulumi up`, later in a stack's life: Pulumi's own CLI moves a pool to a new GPU type, makes a
reclaimed node again, takes routine changes of several inputs, and destroys the stack.

A stack of its own (tests/test_pulumi_up.py's first half of the life, which this needs nothing of, runs
beside it in a lane of its own): the first up makes the dev stack with two GPU nodes, then
1. a new GPU type on spot (every node replaced, new first), one of them reclaimed behind the program's
   back; routine changes of several inputs in two ups, the manager resized in place;
2. a boot that fails, loudly, and the next wait that installs;
3. destroy.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import pytest

from to_node import commands as node_commands
from to_node import software as node_software
from to_node.software import NodeRelease
from components.cloud_config import render_cloud_config
from components.remote import as_root
from localswarm import fake_imds, machines, network, nspawn, object_store, pulumi_cli, ssh
from tests.rehearsal_tools import cli, machine, pulumi, records, require_engine, tasks_of
from tests.test_pulumi_up import NODES, config_set, inventory, ran, status, stepped, summary, t4_machines, up

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def first():
    """The dev stack's first up with two GPU nodes, as tests/test_pulumi_up.py's (which proves it)."""
    require_engine()
    cli("down")
    config_set("gpuPools[0].count", "2")
    up("--skip-preview")
    yield
    cli("down")


# ---------------------------------------------------------------- 1. a new GPU type, a reclaim, routine changes


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


# ---------------------------------------------------------------- 2. a boot that fails, loudly


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


# ---------------------------------------------------------------- 3. destroy


def test_destroy_deletes_everything_and_the_machines_go(first):
    held = json.loads(pulumi("stack", "export").stdout)["deployment"]["resources"]
    # The CLI counts the stack and every resource, but not its default providers.
    counted = [r for r in held if not r["type"].startswith("pulumi:providers:")]
    gone = pulumi("destroy", "--yes")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-3000:]
    assert summary(gone.stdout) == {"deleted": len(counted)}
    assert machines.machines() == []
    assert not pulumi_cli.holds_machines()
