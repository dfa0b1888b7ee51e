"""The node software: its content hash, its bundle (the same bytes anywhere), each node's settings, steps and files.

The scripts that install it on a node run in real bash in tests/test_node_commands.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from to_node import software as node_software
from to_node.software import SOURCE_DIR, NodeRelease, software_hash

SOFTWARE = software_hash()
ENV = node_software.node_env(gpu=True, gpu_kind="NVIDIA-GPU", instance_type="g5.xlarge", image="ubuntu")


# ---------------------------------------------------------------- the version hash


def test_hash_is_what_sha256sum_computes_over_the_folder():
    listing = subprocess.run(
        "find . -type f ! -path '*/__pycache__/*' ! -path '*/.*' ! -name '*.pyc' ! -name '*~' -print0 "
        "| LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1",
        shell=True, cwd=SOURCE_DIR, capture_output=True, text=True, check=True).stdout.strip()
    assert listing == SOFTWARE


def test_hash_follows_content_only(tmp_path):
    copy = tmp_path / "node"
    shutil.copytree(SOURCE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert software_hash(copy) == SOFTWARE
    # Caches, editor leftovers, timestamps and modes are not the software.
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "gpu_agent.cpython-311.pyc").write_bytes(b"\0")
    (copy / ".bootstrap.sh.swp").write_text("x")
    (copy / "common.sh~").write_text("x")
    os.utime(copy / "bootstrap.sh", (0, 0))
    (copy / "bootstrap.sh").chmod(0o600)
    assert software_hash(copy) == SOFTWARE
    # One byte of a script is.
    (copy / "common.sh").write_text((copy / "common.sh").read_text() + "\n")
    assert software_hash(copy) != SOFTWARE


def test_hash_is_the_same_in_another_process_and_hash_seed():
    code = "from to_node import software as node_software; print(node_software.software_hash())"
    repo = SOURCE_DIR.parent
    seen = {subprocess.run([os.sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert seen == {SOFTWARE}


def test_every_step_script_ships_and_none_is_dead():
    used = set()
    for gpu, instance_type in ((True, "g5.xlarge"), (True, "p5.48xlarge"), (True, "p6-b200.48xlarge"),
                               (False, "m7i.large")):
        used |= {s.rstrip("&") for s in node_software.bootstrap_steps(gpu=gpu, instance_type=instance_type)}
    used |= {s.rstrip("&") for s in node_software.bootstrap_steps(gpu=True, instance_type="p5.48xlarge", efa=True)}
    used |= {s.rstrip("&") for s in node_software.bootstrap_steps(gpu=True, instance_type="g5.xlarge", elastic=True)}
    # Not steps: the runner, what the steps source, and what gpu-swarm-imds.service runs at each boot.
    scripts = {path.stem for path in SOURCE_DIR.glob("*.sh")} - {"bootstrap", "common", "imds-root-only"}
    assert used == scripts


def test_fifth_generation_nvlink_gets_its_subnet_manager_before_the_fabric_manager():
    steps = node_software.bootstrap_steps(gpu=True, instance_type="p6-b200.48xlarge")
    assert steps.index("install-nvlink-subnet-manager") == steps.index("install-fabric-manager") - 1
    assert "install-nvlink-subnet-manager" not in node_software.bootstrap_steps(gpu=True, instance_type="p5.48xlarge")


@pytest.mark.parametrize("instance_type, expected", [
    ("p5.48xlarge", True), ("p4d.24xlarge", True), ("p5.4xlarge", False), ("g6e.48xlarge", False),
    ("p5e.48xlarge", True), ("p6-b200.48xlarge", True),
])
def test_fabric_manager_only_on_nvswitch_sizes(instance_type, expected):
    assert node_software.needs_fabric_manager(instance_type) is expected
    assert ("install-fabric-manager" in node_software.bootstrap_steps(gpu=True, instance_type=instance_type)) is expected


@pytest.mark.parametrize("field, value, message", [
    ("image", "amazon-linux", "ubuntu, deep-learning, custom"),
    ("instance_type", "g5.xlarge; reboot", "instance_type"),
    ("gpu_kind", "NVIDIA GPU", "invalid GPU resource kind"),
    ("gpu", 1, "gpu: expected True or False"),
])
def test_bad_node_settings_are_refused(field, value, message):
    args = {"gpu": True, "gpu_kind": "NVIDIA-GPU", "instance_type": "g5.xlarge", "image": "ubuntu", field: value}
    with pytest.raises(ValueError, match=message):
        node_software.node_env(**args)


def test_node_env_values_that_a_shell_would_misread_are_refused():
    for value in ("a  b", " a", "$(reboot)", "a'b", 'a"b', "a\\b", "a\nb"):
        with pytest.raises(ValueError, match="cannot be written to an env file safely"):
            node_software.env_text({"GPU_SWARM_X": value})
    assert node_software.env_text({"GPU_SWARM_STEPS": "a b"}) == 'GPU_SWARM_STEPS="a b"\n'


@pytest.mark.parametrize("steps", ["secure-imds install-agent-venv& install-docker", "install-agent-venv&"])
def test_background_steps_read_back_the_same_in_bash(tmp_path, steps):
    """A & outside quotes would fork the line that bash sources (install.sh's `. release.env`)."""
    env = tmp_path / "release.env"
    env.write_text(node_software.env_text({"GPU_SWARM_STEPS": steps}))
    read = subprocess.run(["bash", "-c", f'. {env} && printf %s "$GPU_SWARM_STEPS"'], capture_output=True, text=True)
    assert read.returncode == 0 and read.stdout == steps, read


def test_min_versions_reads_versions_env():
    versions = node_software.min_versions()
    for pin in ("DOCKER_VERSION", "CONTAINERD_VERSION", "TOOLKIT_VERSION"):
        assert re.fullmatch(r"\d+\.\d+\.\d+", versions[pin]), pin
    # Generic resources on an overlay network need Docker >= 25.0.3 (moby#44378); 1.18.0-1.18.2 ignored
    # swarm-resource (toolkit#1599).
    assert tuple(map(int, versions["DOCKER_VERSION"].split("."))) >= (25, 0, 3)
    assert not versions["TOOLKIT_VERSION"].startswith("1.18.")
    assert re.fullmatch(r"\d+\.\d+\.\d+", versions["NVIDIA_ML_PY_VERSION"])
    shell = subprocess.run(
        ["bash", "-c", '. "$1"; for k in "${@:2}"; do echo "$k=${!k}"; done', "-",
         str(node_software.VERSIONS_ENV), *versions], capture_output=True, text=True, check=True)
    assert dict(line.split("=", 1) for line in shell.stdout.splitlines()) == versions


def test_min_versions_refuses_lines_the_shell_would_misread(monkeypatch, tmp_path):
    bad = tmp_path / "versions.env"
    bad.write_text("DOCKER_VERSION = 28.5.2\n")
    monkeypatch.setattr(node_software, "VERSIONS_ENV", bad)
    with pytest.raises(ValueError, match="versions.env:1"):
        node_software.min_versions()


def test_version_numbers_live_only_in_versions_env():
    pinned = set(node_software.min_versions().values())
    for source in [SOURCE_DIR.parent / "to_node" / "software.py", *SOURCE_DIR.glob("*.sh")]:
        text = source.read_text()
        for value in pinned:
            assert not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text), f"{value} in {source.name}"


def test_node_paths_match_the_shell_defaults():
    common = (SOURCE_DIR / "common.sh").read_text()
    defaults = dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', common))
    installer = dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', (node_software.CLOUD_INIT_DIR / "install.sh").read_text()))
    for name in set(defaults) & set(installer):
        assert installer[name] == defaults[name], name
    assert installer["GPU_SWARM_RELEASE_ENV"] == node_software.RELEASE_ENV_PATH
    assert installer["GPU_SWARM_SOFTWARE"] == node_software.SOFTWARE_DIR
    assert defaults["GPU_SWARM_LOG"] == node_software.BOOTSTRAP_LOG
    assert defaults["GPU_SWARM_STATE"] == node_software.STATE_DIR
    assert defaults["GPU_SWARM_VERSIONS"] == node_software.NODE_VERSIONS_ENV
    assert defaults["GPU_SWARM_NODE_ENV"] == node_software.NODE_ENV_PATH
    assert defaults["GPU_SWARM_VENV"] == node_software.AGENT_VENV
    for path in (node_software.BOOTSTRAP_TIMINGS, node_software.BOOTSTRAP_DONE, node_software.BOOTSTRAP_FAILED):
        assert Path(path).parent == Path(node_software.STATE_DIR)  # where bootstrap.sh writes them


def test_units_run_the_installed_software():
    unit = (SOURCE_DIR / "gpu-swarm-agent.service").read_text()
    assert f"{node_software.AGENT_VENV}/bin/python {node_software.AGENT_PATH}" in unit
    assert f"EnvironmentFile=-{node_software.NODE_ENV_PATH}" in unit



# ---------------------------------------------------------------- the bundle


def test_the_bundle_is_node_as_a_tar_with_fixed_owner_modes_and_times():
    import tarfile, io
    with tarfile.open(fileobj=io.BytesIO(node_software.bundle())) as tar:
        members = tar.getmembers()
    assert sorted(m.name for m in members) == sorted(rel for rel, _ in node_software.software_files())
    for m in members:
        assert (m.uid, m.gid, m.uname, m.gname, m.mtime) == (0, 0, "", "", 0), m.name
        executable = m.name.endswith((".sh", ".py")) or m.name == "gpu-swarm-runtime"
        assert m.mode == (0o755 if executable else 0o644), m.name


def test_the_bundle_is_the_same_bytes_in_another_process_and_follows_content_only(tmp_path):
    code = "from to_node import software as node_software; print(node_software.bundle_sha256())"
    seen = {subprocess.run([os.sys.executable, "-c", code], cwd=SOURCE_DIR.parent, capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert seen == {node_software.bundle_sha256()}
    copy = tmp_path / "node"
    shutil.copytree(SOURCE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bootstrap.sh").chmod(0o600)
    os.utime(copy / "common.sh", (0, 0))
    assert node_software.bundle_sha256(copy) == node_software.bundle_sha256()
    (copy / "common.sh").write_text((copy / "common.sh").read_text() + "\n")
    assert node_software.bundle_sha256(copy) != node_software.bundle_sha256()


def test_the_bundle_unpacks_with_gnu_tar_as_the_node_unpacks_it(tmp_path):
    (tmp_path / "b.tar").write_bytes(node_software.bundle())
    (tmp_path / "out").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "out"), "--no-same-owner", "-xf", str(tmp_path / "b.tar")], check=True)
    assert software_hash(tmp_path / "out") == SOFTWARE
    assert os.access(tmp_path / "out" / "bootstrap.sh", os.X_OK)


# ---------------------------------------------------------------- a release and its files

URL = "https://b-1.s3.us-east-1.amazonaws.com/node-software/x.tar"
STEPS = ("install-docker", "apply-docker-config")


def test_a_release_changes_with_the_bundle_settings_and_steps_but_not_the_url():
    sha = node_software.bundle_sha256()
    base = NodeRelease(URL, sha, ENV, STEPS)
    assert NodeRelease(URL.replace("b-1", "b-2"), sha, ENV, STEPS).id == base.id
    assert NodeRelease(URL, sha, {**ENV, "GPU_SWARM_IMAGE": "custom"}, STEPS).id != base.id
    assert NodeRelease(URL, sha, ENV, STEPS[:1]).id != base.id
    assert NodeRelease(URL, "0" * 64, ENV, STEPS).id != base.id


def test_a_release_writes_the_settings_the_installer_and_what_to_install():
    release = NodeRelease(URL, node_software.bundle_sha256(), ENV, STEPS)
    files = {f.path: f for f in release.files()}
    assert files[node_software.NODE_ENV_PATH].content == node_software.env_text(ENV)
    assert files[node_software.INSTALLER_PATH].mode == "0755"
    assert files[node_software.INSTALLER_PATH].content == (node_software.CLOUD_INIT_DIR / "install.sh").read_text()
    env = subprocess.run(["bash", "-c", 'set -a; . /dev/stdin; env'], input=files[node_software.RELEASE_ENV_PATH].content,
                         capture_output=True, text=True, check=True).stdout
    assert f"GPU_SWARM_BUNDLE_URL={URL}\n" in env and "GPU_SWARM_STEPS=install-docker apply-docker-config\n" in env
    assert f"GPU_SWARM_RELEASE={release.id}\n" in env
    assert f"GPU_SWARM_BUNDLE_SHA256={node_software.bundle_sha256()}\n" in env


@pytest.mark.parametrize("url, steps, message", [
    ("http://b.s3.amazonaws.com/x.tar", STEPS, "plain https URL"),
    ("https://b.s3.amazonaws.com/x.tar; reboot", STEPS, "plain https URL"),
    (URL, ("install-docker; reboot",), "not a script in node/"),
    (URL, ("install-nothing",), "not a script in node/"),
])
def test_a_release_refuses_what_a_node_could_not_install(url, steps, message):
    with pytest.raises(ValueError, match=message):
        NodeRelease(url, node_software.bundle_sha256(), ENV, steps).files()


def test_git_checks_the_node_software_out_with_lf_everywhere():
    """A Windows checkout with core.autocrlf=true would otherwise change the bytes, and the hash."""
    repo = SOURCE_DIR.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(repo)) for p in SOURCE_DIR.iterdir() if p.is_file()]
    out = subprocess.run(["git", "check-attr", "eol", "--", *files], cwd=repo, capture_output=True, text=True,
                         check=True).stdout
    assert out.count(": eol: lf") == len(files), out


@pytest.mark.parametrize("dist, prefix", [("nvidia_ml_py", "NVIDIA_ML_PY"), ("prometheus_client", "PROMETHEUS_CLIENT")])
def test_each_agent_wheel_pin_is_its_versions_pure_python_wheel_on_pypi_with_a_sha256(dist, prefix):
    """install-agent-venv.sh downloads <PREFIX>_WHEEL and unpacks it: it must be the pinned version's
    py3-none-any wheel (what unpacking installs, PEP 427), from PyPI over https, with the hash to check."""
    versions = node_software.min_versions()
    url, name, sha = node_software.pinned_wheel(prefix)
    assert url.startswith("https://files.pythonhosted.org/packages/"), url
    assert name == f"{dist}-{versions[f'{prefix}_VERSION']}-py3-none-any.whl", url
    assert re.fullmatch(r"[0-9a-f]{64}", sha), versions[f"{prefix}_WHEEL"]
