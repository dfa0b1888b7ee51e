"""The rendered user data: parsed back and checked, and validated by the real cloud-init."""
from __future__ import annotations

import base64
import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import node_software
from tests.tools import require_tool
from swarm.gpu_kind import validate_kind
from node_software import (AGENT_ENV_PATH, AGENT_PATH, AGENT_UNIT_PATH, AGENT_VENV, BOOTSTRAP_DIR,
                          BOOTSTRAP_SCRIPT, NODE_SOFTWARE_DIR, NODE_ENV_PATH, NODE_VERSIONS_ENV,
                          USER_DATA_LIMIT, render_cloud_config)

REPO = Path(__file__).resolve().parent.parent
NVIDIA_STEPS = {"install-nvidia-driver", "install-fabric-manager", "install-container-toolkit",
                "install-gpu-agent"}
GPU_NODE = {"gpu": True, "gpu_kind": "NVIDIA-GPU", "instance_type": "g5.xlarge", "image": "ubuntu"}
MANAGER = {"gpu": False, "gpu_kind": "NVIDIA-GPU", "instance_type": "m7i.large", "image": "ubuntu"}
# Room left under EC2's limit for what later changes add.
SIZE_MARGIN = 2048


def render(**overrides) -> str:
    return render_cloud_config(**{**GPU_NODE, **overrides})


def parse(user_data: str) -> dict:
    return yaml.safe_load(user_data)


def files(user_data: str) -> dict[str, dict]:
    return {entry["path"]: entry for entry in parse(user_data)["write_files"]}


def steps(user_data: str) -> list[str]:
    (command,) = parse(user_data)["runcmd"]
    assert command[:2] == ["bash", BOOTSTRAP_SCRIPT]
    return command[2:]


def env_file(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


ALL_NODES = [
    pytest.param({**GPU_NODE, "image": image}, id=f"gpu-{image}") for image in node_software.IMAGES
] + [
    pytest.param({**GPU_NODE, "instance_type": "p5.48xlarge"}, id="gpu-p5"),
    pytest.param(MANAGER, id="manager"),
    pytest.param({**MANAGER, "image": "deep-learning"}, id="manager-deep-learning"),
]


@pytest.mark.parametrize("node", ALL_NODES)
def test_header_is_the_first_line(node):
    user_data = render_cloud_config(**node)
    assert user_data.splitlines()[0] == "#cloud-config"
    assert parse(user_data)  # and the rest is a YAML mapping


@pytest.mark.parametrize("node", ALL_NODES)
def test_real_cloud_init_accepts_it(node, tmp_path):
    cloud_init = require_tool("cloud-init")
    path = tmp_path / "user-data"
    path.write_text(render_cloud_config(**node))
    result = subprocess.run([cloud_init, "schema", "--config-file", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_node_on_ubuntu_installs_everything():
    user_data = render()
    written = files(user_data)
    assert steps(user_data) == ["install-docker", "install-nvidia-driver", "install-container-toolkit",
                                "install-gpu-agent", "apply-docker-config"]
    for step in steps(user_data):
        script = written[f"{BOOTSTRAP_DIR}/{step}.sh"]
        assert script["content"] == (NODE_SOFTWARE_DIR / f"{step}.sh").read_text()
        assert script["permissions"] == "0755"
    assert written[BOOTSTRAP_SCRIPT]["content"] == (NODE_SOFTWARE_DIR / "bootstrap.sh").read_text()
    assert written[NODE_VERSIONS_ENV]["content"] == (NODE_SOFTWARE_DIR / "versions.env").read_text()
    assert env_file(written[NODE_ENV_PATH]["content"]) == {
        "GPU_SWARM_IMAGE": "ubuntu", "GPU_SWARM_INSTANCE_TYPE": "g5.xlarge", "NVIDIA_KERNEL_MODULES": "open"}


def test_gpu_node_on_deep_learning_ami_runs_the_same_checking_steps():
    # The AMI's driver, Docker and toolkit make those steps skip on the node itself.
    user_data = render(image="deep-learning")
    assert steps(user_data) == steps(render())
    assert env_file(files(user_data)[NODE_ENV_PATH]["content"])["GPU_SWARM_IMAGE"] == "deep-learning"


def test_gpu_agent_is_installed_verbatim_with_its_unit():
    written = files(render())
    assert written[AGENT_PATH]["content"] == (NODE_SOFTWARE_DIR / "gpu_agent.py").read_text()
    unit = written[AGENT_UNIT_PATH]["content"]
    assert unit == (NODE_SOFTWARE_DIR / "gpu-swarm-agent.service").read_text()
    # The unit must run the agent where we put it, from the venv install-gpu-agent.sh builds.
    assert f"{AGENT_VENV}/bin/python {AGENT_PATH} --json" in unit
    assert f"EnvironmentFile=-{AGENT_ENV_PATH}" in unit


def test_kind_lands_in_agent_env():
    written = files(render(gpu_kind="H100-80GB"))
    assert env_file(written[AGENT_ENV_PATH]["content"]) == {"GPU_SWARM_KIND": "H100-80GB"}


@pytest.mark.parametrize("instance_type, fabric_manager", [
    ("p4d.24xlarge", True), ("p4de.24xlarge", True), ("p5.48xlarge", True), ("p5e.48xlarge", True),
    ("p5en.48xlarge", True), ("p6-b200.48xlarge", True),
    ("p5.4xlarge", False),  # one H100, no NVSwitch
    ("g5.48xlarge", False), ("g6e.12xlarge", False), ("p3.16xlarge", False), ("g4dn.xlarge", False),
])
def test_fabric_manager_only_on_nvswitch_types(instance_type, fabric_manager):
    user_data = render(instance_type=instance_type)
    node_steps = steps(user_data)
    assert ("install-fabric-manager" in node_steps) is fabric_manager
    assert (f"{BOOTSTRAP_DIR}/install-fabric-manager.sh" in files(user_data)) is fabric_manager
    if fabric_manager:  # after the driver it must match, before anything runs CUDA
        assert node_steps.index("install-nvidia-driver") < node_steps.index("install-fabric-manager") \
            < node_steps.index("install-container-toolkit")


@pytest.mark.parametrize("instance_type, modules", [
    ("p3.2xlarge", "proprietary"), ("p3dn.24xlarge", "proprietary"), ("g3s.xlarge", "proprietary"),
    ("g4dn.xlarge", "open"), ("p5.48xlarge", "open"), ("p6-b200.48xlarge", "open"),
])
def test_kernel_modules_follow_the_gpu_generation(instance_type, modules):
    node_env = env_file(files(render(instance_type=instance_type))[NODE_ENV_PATH]["content"])
    assert node_env["NVIDIA_KERNEL_MODULES"] == modules


@pytest.mark.parametrize("image", node_software.IMAGES)
def test_cpu_manager_gets_docker_and_nothing_nvidia(image):
    user_data = render_cloud_config(**{**MANAGER, "image": image})
    written = files(user_data)
    assert steps(user_data) == ["install-docker", "apply-docker-config"]
    assert not NVIDIA_STEPS & set(steps(user_data))
    for path in (AGENT_PATH, AGENT_UNIT_PATH, AGENT_ENV_PATH):
        assert path not in written
    assert not any("nvidia" in path for path in written)
    assert "NVIDIA_KERNEL_MODULES" not in env_file(written[NODE_ENV_PATH]["content"])


def test_every_step_script_ships_and_none_is_dead():
    used = set()
    for node in (GPU_NODE, {**GPU_NODE, "instance_type": "p5.48xlarge"}, MANAGER):
        used |= set(steps(render_cloud_config(**node)))
    scripts = {path.stem for path in NODE_SOFTWARE_DIR.glob("*.sh")} - {"bootstrap", "common"}
    assert used == scripts


@pytest.mark.parametrize("node", ALL_NODES)
def test_same_inputs_same_bytes(node):
    assert render_cloud_config(**node) == render_cloud_config(**node)


def test_same_bytes_in_another_process():
    # A fresh interpreter with another hash seed: no set or dict ordering leaks into the output.
    code = ("import sys, node_software; sys.stdout.write(node_software.render_cloud_config("
            "gpu=True, gpu_kind='NVIDIA-GPU', instance_type='p5.48xlarge', image='ubuntu'))")
    outputs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outputs == {render(instance_type="p5.48xlarge")}


@pytest.mark.parametrize("node", ALL_NODES)
def test_scripts_stay_readable_blocks(node):
    # PyYAML silently falls back to one escaped "..." line (e.g. on trailing spaces).
    user_data = render_cloud_config(**node)
    assert len(re.findall(r"^  content: \|$", user_data, re.M)) == len(parse(user_data)["write_files"])


@pytest.mark.parametrize("image", ["", "Ubuntu", "ubuntu-24.04", "amazon-linux", "ami-0123456789abcdef0", None])
def test_unknown_image_is_refused(image):
    with pytest.raises(ValueError, match="ubuntu, deep-learning, custom"):
        render(image=image)


@pytest.mark.parametrize("kind", ["", "NVIDIA GPU", "GPU=1", "gpu\n", "x" * 65])
def test_bad_kind_is_refused_by_the_agents_rules(kind):
    with pytest.raises(ValueError):
        validate_kind(kind)
    with pytest.raises(ValueError):
        render(gpu_kind=kind)


@pytest.mark.parametrize("instance_type", ["", "g5", "G5.XLARGE", "g5.xlarge; reboot", "g5.xlarge\n", None])
def test_bad_instance_type_is_refused(instance_type):
    with pytest.raises(ValueError, match="instance_type"):
        render(instance_type=instance_type)


def test_manager_instance_type_is_checked_too():
    with pytest.raises(ValueError, match="instance_type"):
        render_cloud_config(**{**MANAGER, "instance_type": "m7i.large\nGPU_SWARM_IMAGE=x"})


@pytest.mark.parametrize("gpu", [1, "yes", None])
def test_gpu_must_be_a_bool(gpu):
    with pytest.raises(ValueError, match="gpu"):
        render(gpu=gpu)


def test_manager_user_data_fits_ec2_limit_with_margin():
    for image in node_software.IMAGES:
        size = len(render_cloud_config(**{**MANAGER, "image": image}).encode())
        assert size <= USER_DATA_LIMIT - SIZE_MARGIN, size


@pytest.mark.parametrize("instance_type", ["g5.xlarge", "p5.48xlarge"])
@pytest.mark.parametrize("image", node_software.IMAGES)
def test_gpu_user_data_fits_ec2_limit_gzipped(instance_type, image):
    """The GPU document (~46 KB) only fits gzipped; cloud-init inflates it before parsing."""
    encoded = node_software.render_user_data(gpu=True, gpu_kind="NVIDIA-GPU", instance_type=instance_type,
                                            image=image)
    raw = base64.b64decode(encoded)
    assert raw[:2] == b"\x1f\x8b"  # gzip magic, which cloud-init recognises
    assert len(raw) <= USER_DATA_LIMIT - 1024, len(raw)
    assert gzip.decompress(raw).decode() == render(instance_type=instance_type, image=image)
    assert encoded == node_software.render_user_data(gpu=True, gpu_kind="NVIDIA-GPU",
                                                    instance_type=instance_type, image=image)


def test_min_versions_reads_versions_env():
    versions = node_software.min_versions()
    assert versions["DOCKER_MIN_VERSION"] == "25.0.3"
    assert versions["TOOLKIT_MIN_VERSION"] == "1.19.0"
    assert versions["NVIDIA_DRIVER_BRANCH"].isdigit()
    # ...exactly as the shell steps see it when they source the file.
    shell = subprocess.run(
        ["bash", "-c", '. "$1"; for k in "${@:2}"; do echo "$k=${!k}"; done', "-",
         str(NODE_SOFTWARE_DIR / "versions.env"), *versions], capture_output=True, text=True, check=True)
    assert env_file(shell.stdout) == versions


def test_min_versions_refuses_lines_the_shell_would_misread(monkeypatch, tmp_path):
    bad = tmp_path / "versions.env"
    bad.write_text("DOCKER_MIN_VERSION = 25.0.3\n")
    monkeypatch.setattr(node_software, "VERSIONS_ENV", bad)
    with pytest.raises(ValueError, match="versions.env:1"):
        node_software.min_versions()


def test_version_numbers_live_only_in_versions_env():
    pinned = set(node_software.min_versions().values())
    sources = [REPO / "node_software.py", *NODE_SOFTWARE_DIR.glob("*.sh")]
    for source in sources:
        text = source.read_text()
        for value in pinned:
            assert not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text), f"{value} in {source.name}"


def test_node_paths_match_the_shell_defaults():
    common = (NODE_SOFTWARE_DIR / "common.sh").read_text()
    defaults = dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', common))
    assert defaults["GPU_SWARM_LOG"] == node_software.BOOTSTRAP_LOG
    assert defaults["GPU_SWARM_STATE"] == node_software.STATE_DIR
    assert defaults["GPU_SWARM_VERSIONS"] == NODE_VERSIONS_ENV
    assert defaults["GPU_SWARM_NODE_ENV"] == NODE_ENV_PATH
    assert defaults["GPU_SWARM_VENV"] == AGENT_VENV
    for path in (node_software.BOOTSTRAP_TIMINGS, node_software.BOOTSTRAP_DONE, node_software.BOOTSTRAP_FAILED):
        assert Path(path).parent == Path(node_software.STATE_DIR)  # where bootstrap.sh writes them
