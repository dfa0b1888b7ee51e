"""EFA devices in a task: the agent advertises them (AWS-EFA), a stack reserves them, the guard gives them.

The kernel's view is a fake /sys/class/infiniband (tests/test_efa.py's, plus each device's
infiniband_verbs/uverbsN folder). No EFA hardware here, so the device a task is given is a
real character device that exists everywhere, /dev/null (1, 3), named as an EFA device in the
guard's settings; the guard reads its major and minor from the node as it would an EFA one's.
The guard runs in-process, behind the real sh front and behind its real server.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from swarm.node_contract import EFA_KIND, EFA_VERBS_DIR, RUNTIME_EFA_DEVICES_KEY, RUNTIME_EFA_KIND_KEY
from swarm.stack_files import StackFileError, validate_stack_file
from tests.test_efa import fake_sysfs
from tests.test_gpu_agent import Node as AgentNode
from tests.test_gpu_agent import dockerd, dockerd_validate, inventory_gpu, uuid  # noqa: F401 (a fixture)
from tests.test_gpu_guard import SETTINGS, spec
from tests.test_gpu_guard_ledger import A, WHOLE, Node
from tests.test_guard_server import Server
from tests.tools import require_tool

import gpu_guard  # noqa: E402  (tests.test_gpu_guard puts node/ on the path, as on a node)

REPO = Path(__file__).resolve().parent.parent
EFA_VAR = f"DOCKER_RESOURCE_{EFA_KIND}"
NULL = os.stat("/dev/null")
NULL_NUMBERS = (os.major(NULL.st_rdev), os.minor(NULL.st_rdev))  # (1, 3) on Linux
# A node with two EFA devices, whose verbs nodes are stood in for by /dev/null and /dev/zero.
EFA = {RUNTIME_EFA_KIND_KEY: EFA_KIND, RUNTIME_EFA_DEVICES_KEY: "rdmap16s0:/dev/null,rdmap17s0:/dev/zero"}


def with_verbs(sysfs: Path, skip: tuple[str, ...] = ()) -> Path:
    """Give each device of a fake sysfs its verbs folder, as the kernel does: device/infiniband_verbs/uverbsN."""
    for n, device in enumerate(sorted(sysfs.iterdir())):
        if device.name not in skip:
            (device / "device" / "infiniband_verbs" / f"uverbs{n}").mkdir(parents=True)
    return sysfs


def env_dict(settings_text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in settings_text.splitlines() if line and not line.startswith("#"))


# ---------------------------------------------------------------- the agent advertises them


@pytest.fixture
def agent(tmp_path, monkeypatch):
    return AgentNode(tmp_path, monkeypatch)


def test_each_efa_device_is_a_named_resource_beside_the_gpus_and_the_guard_learns_its_verbs_node(agent, capsys,
                                                                                                 tmp_path):
    sysfs = with_verbs(fake_sysfs(tmp_path, efa=2, other=1))  # rdmap16s0, rdmap17s0 (efa), rdmap18s0 (mlx5)
    rc, report, err = agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0), inventory_gpu(1)]),
                                "--efa-sysfs", str(sysfs))
    assert rc == 0, err
    assert agent.daemon()["node-generic-resources"] == [f"NVIDIA-GPU={uuid(0)}", f"NVIDIA-GPU={uuid(1)}",
                                                        "AWS-EFA=rdmap16s0", "AWS-EFA=rdmap17s0"]
    assert "efa.count=2" in agent.daemon()["labels"]
    settings = env_dict(agent.runtime_config.read_text())
    assert settings[RUNTIME_EFA_KIND_KEY] == "AWS-EFA"
    assert settings[RUNTIME_EFA_DEVICES_KEY] == \
        f"rdmap16s0:{EFA_VERBS_DIR}/uverbs0,rdmap17s0:{EFA_VERBS_DIR}/uverbs1"
    rc, report, _ = agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0), inventory_gpu(1)]),
                              "--efa-sysfs", str(sysfs))
    assert rc == 0 and report["changed"] is False  # a second boot changes nothing, so docker is not restarted


def test_dockerd_accepts_the_efa_devices_beside_the_gpus(agent, capsys, tmp_path, dockerd):  # noqa: F811
    sysfs = with_verbs(fake_sysfs(tmp_path, efa=2))
    assert agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0)]), "--efa-sysfs", str(sysfs))[0] == 0
    done = dockerd_validate(dockerd, agent.daemon_json)
    assert done.returncode == 0 and "configuration OK" in done.stdout + done.stderr, done.stderr
    assert "AWS-EFA=rdmap17s0" in agent.daemon_json.read_text()


def test_the_runtime_settings_the_agent_writes_are_what_the_guard_reads(agent, capsys, tmp_path):
    """The guard spells the keys itself (it imports nothing of ours): it must find the device the
    agent mapped, and here it then looks for its verbs node, which this machine lacks."""
    sysfs = with_verbs(fake_sysfs(tmp_path, efa=1))
    assert agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0)]), "--efa-sysfs", str(sysfs))[0] == 0
    settings = gpu_guard.read_settings(str(agent.runtime_config))
    if Path(f"{EFA_VERBS_DIR}/uverbs0").exists():
        pytest.fail(f"this machine has {EFA_VERBS_DIR}/uverbs0; the test needs one without RDMA devices")
    with pytest.raises(gpu_guard.Refused, match=f"the EFA device {EFA_VERBS_DIR}/uverbs0 is missing on this node"):
        gpu_guard.guard(spec(f"{EFA_VAR}=rdmap16s0"), settings)
    with pytest.raises(gpu_guard.Refused, match="rdmap99s0, which is not an EFA device of this node"):
        gpu_guard.guard(spec(f"{EFA_VAR}=rdmap99s0"), settings)


def test_a_device_without_a_verbs_node_is_not_advertised_and_the_agent_says_why(agent, capsys, tmp_path):
    sysfs = with_verbs(fake_sysfs(tmp_path, efa=2), skip=("rdmap17s0",))
    rc, report, err = agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0)]), "--efa-sysfs", str(sysfs))
    assert rc == 0, err
    assert [r for r in agent.daemon()["node-generic-resources"] if r.startswith("AWS-EFA")] == ["AWS-EFA=rdmap16s0"]
    assert "efa.count=2" in agent.daemon()["labels"]  # the label says what the kernel shows
    assert any("EFA device rdmap17s0: cannot tell its verbs node" in w for w in report["warnings"])
    assert env_dict(agent.runtime_config.read_text())[RUNTIME_EFA_DEVICES_KEY] == \
        f"rdmap16s0:{EFA_VERBS_DIR}/uverbs0"


def test_without_efa_or_without_the_guard_nothing_is_advertised_or_written(agent, capsys, tmp_path):
    gpus = agent.inventory([inventory_gpu(0)])
    rc, _, err = agent.run(capsys, "--inventory", gpus, "--efa-sysfs", str(tmp_path / "none"))
    assert rc == 0, err
    assert agent.daemon()["node-generic-resources"] == [f"NVIDIA-GPU={uuid(0)}"]
    assert "EFA" not in agent.runtime_config.read_text()  # the file of a node without EFA, as before
    # --no-runtime: no guard gives the devices, so advertising them would promise what no task gets.
    sysfs = with_verbs(fake_sysfs(tmp_path / "efa", efa=2))
    rc, _, err = agent.run(capsys, "--inventory", gpus, "--efa-sysfs", str(sysfs), "--no-runtime")
    assert rc == 0, err
    assert agent.daemon()["node-generic-resources"] == [f"NVIDIA-GPU={uuid(0)}"]


# ---------------------------------------------------------------- the guard gives them


def decide(s: dict, **settings) -> gpu_guard.Decision:
    return gpu_guard.guard(copy.deepcopy(s), {**SETTINGS, "SHARED_KIND": "", "SLOTS_PER_GPU": "0", **EFA, **settings})


def docker_spec(*env: str) -> dict:
    """A bundle as dockerd writes it for a swarm task: no device of its own, the cgroup's deny-all first."""
    s = spec(*env)
    s["linux"]["resources"] = {"devices": [{"allow": False, "access": "rwm"},
                                           {"allow": True, "type": "c", "major": 5, "minor": 0, "access": "rwm"}]}
    return s


def test_a_task_gets_the_efa_devices_swarm_assigned_as_docker_run_device_gives_them():
    decision = decide(docker_spec(f"{WHOLE}={A}", f"{EFA_VAR}=rdmap16s0"))
    major, minor = NULL_NUMBERS
    assert decision.spec["linux"]["devices"] == [
        {"path": "/dev/null", "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}]
    assert decision.spec["linux"]["resources"]["devices"] == [
        {"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": 5, "minor": 0, "access": "rwm"},
        {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}]  # after the deny-all
    assert decision.claims == [A]  # the GPU is claimed; an EFA device is shared, never claimed
    assert decision.text == f"GPUs {A}; EFA rdmap16s0"
    both = decide(docker_spec(f"{EFA_VAR}=rdmap16s0,rdmap17s0"))
    zero = os.stat("/dev/zero").st_rdev
    assert [(d["path"], d["major"], d["minor"]) for d in both.spec["linux"]["devices"]] == [
        ("/dev/null", *NULL_NUMBERS), ("/dev/zero", os.major(zero), os.minor(zero))]
    assert both.text == "no GPU reserved: none given; EFA rdmap16s0,rdmap17s0"


def test_a_task_that_reserved_no_efa_is_left_as_it_was():
    """Nor does the EFA setting cost such a task anything but a look at one setting."""
    task = docker_spec(f"{WHOLE}={A}", "NVIDIA_VISIBLE_DEVICES=all")
    with_efa, without = decide(task), gpu_guard.guard(copy.deepcopy(task), {**SETTINGS, "SHARED_KIND": "",
                                                                            "SLOTS_PER_GPU": "0"})
    assert with_efa.spec == without.spec and with_efa.text == without.text == f"GPUs {A}"
    assert "devices" not in with_efa.spec["linux"]


def test_the_guard_gives_each_device_once_however_often_it_sees_the_bundle():
    once = decide(docker_spec(f"{EFA_VAR}=rdmap16s0")).spec
    assert decide(once).spec == once


@pytest.mark.parametrize("env, settings, message", [
    ([f"{EFA_VAR}=rdmap16s0", f"{EFA_VAR}=rdmap16s0"], {},
     f"{EFA_VAR} is set by the service as well as by swarm; remove it from the service's environment and "
     f"reserve {EFA_KIND} with generic_resources"),
    ([f"{EFA_VAR}=rdmap99s0"], {},
     f"{EFA_VAR} names rdmap99s0, which is not an EFA device of this node (rdmap16s0, rdmap17s0); remove it"),
    ([f"{EFA_VAR}=rdmap16s0"], {RUNTIME_EFA_DEVICES_KEY: "rdmap16s0:/nonexistent/uverbs0"},
     "the EFA device /nonexistent/uverbs0 is missing on this node (No such file or directory)"),
    ([f"{EFA_VAR}=rdmap16s0"], {RUNTIME_EFA_DEVICES_KEY: "rdmap16s0:/etc/hostname"},
     "/etc/hostname is not a character device"),
], ids=["set-twice", "not-this-nodes", "missing", "not-a-device"])
def test_efa_devices_the_guard_cannot_give_stop_the_container_with_the_fix(env, settings, message):
    with pytest.raises(gpu_guard.Refused) as refused:
        decide(docker_spec(*env), **settings)
    assert message in str(refused.value)


# ---------------------------------------------------------------- the same, through the sh front and the server


def efa_node(tmp_path: Path, **more: str) -> Node:
    return Node(tmp_path, **EFA, **more)


def devices_of(node: Node, container: str) -> list[dict]:
    return json.loads((node.bundle(container) / "config.json").read_text())["linux"]["devices"]


def test_the_runtime_hands_runc_a_bundle_with_the_reserved_devices(tmp_path):
    node = efa_node(tmp_path)
    try:
        result = node.create("c1", f"{WHOLE}={A}", f"{EFA_VAR}=rdmap16s0")
        assert result.returncode == 0, result.stderr
        assert node.created() == ["c1"] and node.claims() == {A: "c1"}
        assert [(d["path"], d["major"], d["minor"]) for d in devices_of(node, "c1")] == [("/dev/null", *NULL_NUMBERS)]
        # Shared: a second task on the same EFA device starts too.
        assert node.create("c2", f"{EFA_VAR}=rdmap16s0").returncode == 0
        refused = node.create("c3", f"{EFA_VAR}=rdmap99s0")
        assert refused.returncode == 1 and "rdmap99s0, which is not an EFA device of this node" in refused.stderr
        assert node.created() == ["c1", "c2"]
    finally:
        node.kill_inits()


def test_the_guards_server_decides_the_same(tmp_path):
    server = Server(tmp_path / "guard")
    node = efa_node(tmp_path, GUARD_SERVER=str(server.directory), GUARD_PYTHON="/nonexistent/python3")
    server.start()
    try:
        result = node.create("c1", f"{EFA_VAR}=rdmap17s0")  # succeeds only through the server: no Python here
        assert result.returncode == 0, result.stderr
        zero = os.stat("/dev/zero").st_rdev
        assert [(d["path"], d["major"], d["minor"]) for d in devices_of(node, "c1")] == [
            ("/dev/zero", os.major(zero), os.minor(zero))]
        twice = node.create("c2", f"{EFA_VAR}=rdmap17s0", f"{EFA_VAR}=rdmap17s0")
        assert twice.returncode == 1 and f"{EFA_VAR} is set by the service as well as by swarm" in twice.stderr
    finally:
        server.stop()
        node.kill_inits()


# ---------------------------------------------------------------- stacks reserve them


def stack(*reservations: tuple[str, int]) -> str:
    entries = "".join(f"            - discrete_resource_spec: {{kind: {k}, value: {v}}}\n" for k, v in reservations)
    return ("services:\n  train:\n    image: nvidia/cuda:12.6.3-base-ubuntu24.04\n    deploy:\n      resources:\n"
            "        reservations:\n          generic_resources:\n" + entries)


def check(text: str, efa_max: int, shared: str | None = None):
    return validate_stack_file(text, kind="NVIDIA-GPU", max_gpus_per_node=8, shared_kind=shared, efa_max=efa_max,
                               source="stacks/x.yml")


def test_a_service_reserves_gpus_and_efa_devices_together_on_an_efa_cluster():
    (service,) = check(stack(("NVIDIA-GPU", 8), ("AWS-EFA", 32)), efa_max=32).services
    assert (service.gpus, service.efa) == (8, 32)
    (service,) = check(stack(("AWS-EFA", 4), ("NVIDIA-GPU", 1)), efa_max=4).services  # either order
    assert (service.gpus, service.efa) == (1, 4)


PREFIX = "services.train.deploy.resources.reservations.generic_resources"


@pytest.mark.parametrize("reservations, efa_max, message", [
    ((("NVIDIA-GPU", 8), ("AWS-EFA", 32)), 0,
     f"{PREFIX}[1].discrete_resource_spec.kind: AWS-EFA are the EFA devices of pools with `efa: true` "
     "(gpu-swarm:gpuPools), and no pool has them"),
    ((("NVIDIA-GPU", 8), ("AWS-EFA", 33)), 32,
     f"{PREFIX}[1].discrete_resource_spec.value: 33 EFA devices per replica, but a node of the pools with efa: true "
     "has at most 32; the tasks would stay Pending forever. Reserve at most 32"),
    ((("AWS-EFA", 0),), 32, f"{PREFIX}[0].discrete_resource_spec.value: expected a whole number of EFA devices >= 1"),
    ((("AWS-EFA", 2), ("AWS-EFA", 2)), 32, f"{PREFIX}[1]: AWS-EFA is reserved twice in one service"),
    ((("AWS-EFA", 2), ("NVIDIA-GPU", 1), ("NVIDIA-GPU-SHARED", 1)), 32,
     f"{PREFIX}[2]: a service reserves whole GPUs or one slot of a shared GPU, not both"),
    ((("efa", 2),), 32, "advertise 'NVIDIA-GPU' (gpu-swarm:gpuKind) and 'NVIDIA-GPU-SHARED' "
                        "(gpu-swarm:sharedGpuKind) and 'AWS-EFA' (pools with efa: true)"),
], ids=["no-efa-pool", "over-the-pools-devices", "zero", "twice", "whole-and-slot-still-refused", "wrong-kind"])
def test_efa_reservations_the_cluster_cannot_meet_are_refused_with_the_fix(reservations, efa_max, message):
    with pytest.raises(StackFileError) as refused:
        check(stack(*reservations), efa_max=efa_max, shared="NVIDIA-GPU-SHARED")
    assert any(message in problem for problem in refused.value.problems), refused.value.problems


EXAMPLE = REPO / "stacks" / "nccl-efa.yml"


def test_the_nccl_example_reserves_every_gpu_and_efa_device_of_a_p5_and_passes_only_with_efa():
    info = check(EXAMPLE.read_text(), efa_max=32)
    assert [(s.name, s.gpus, s.efa) for s in info.services] == [("trainer-0", 8, 32), ("trainer", 8, 32)]
    assert info.content == EXAMPLE.read_text() and not info.rewrites  # deployed as written
    with pytest.raises(StackFileError, match="no pool has them"):
        check(EXAMPLE.read_text(), efa_max=0)


def test_the_docker_cli_loads_the_nccl_example_as_written():
    """`docker stack config`: the loader `docker stack deploy` uses; no engine needed."""
    done = subprocess.run([require_tool("docker"), "stack", "config", "-c", str(EXAMPLE)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("kind: AWS-EFA") >= 2 and "memlock: -1" in done.stdout and "target: /dev/shm" in done.stdout


def test_the_program_checks_efa_reservations_against_its_pools():
    """At preview: prod has a p5.48xlarge pool with efa: true (32 interfaces), dev has no EFA pool."""
    from settings import SettingsError, load_settings
    from tests.conftest import stack_config, use_mocks

    use_mocks(stack_config("prod", stacks=[{"name": "nccl", "file": "stacks/nccl-efa.yml"}]))
    (loaded,) = load_settings().stacks
    assert [s.efa for s in loaded.info.services] == [32, 32]
    use_mocks(stack_config("dev", stacks=[{"name": "nccl", "file": "stacks/nccl-efa.yml"}]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert any(p.startswith("gpu-swarm:stacks[0].file: stacks/nccl-efa.yml: services.trainer-0.deploy.resources."
                            "reservations.generic_resources[1].discrete_resource_spec.kind: AWS-EFA")
               for p in err.value.problems), err.value.problems


def test_the_guard_spells_the_contracts_runtime_keys():
    """The guard cannot import the contract; its source must use the keys the agent writes."""
    source = (REPO / "node" / "gpu_guard.py").read_text()
    assert f'settings.get("{RUNTIME_EFA_KIND_KEY}")' in source and f'settings.get("{RUNTIME_EFA_DEVICES_KEY}"' in source
