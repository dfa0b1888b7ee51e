"""Every shell script in the repo passes shellcheck and bash -n; the bootstrap runner and the
steps' already-done paths (the Deep Learning AMI fast path) run for real in bash, with the
node's paths pointed at a temp dir and fake nvidia-smi/dockerd/systemctl on PATH."""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from to_node import software as node_software
from tests.tools import files_git_lists, require_tool

REPO = Path(__file__).resolve().parent.parent
NODE_SRC = REPO / "node"
BOOTSTRAP = NODE_SRC / "bootstrap.sh"
COMMON = NODE_SRC / "common.sh"


def shell_scripts() -> list[Path]:
    """Every *.sh in the working tree that git does not ignore (so never .venv)."""
    return files_git_lists(REPO, "*.sh")


SCRIPTS = shell_scripts()


def test_our_scripts_are_found():
    assert {BOOTSTRAP, COMMON, NODE_SRC / "install-docker.sh"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck_clean(script):
    shellcheck = require_tool("shellcheck")
    # -x follows `source` (the steps source common.sh); paths resolve from the script's folder.
    result = subprocess.run([shellcheck, "-x", script.name], cwd=script.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", sorted(NODE_SRC.glob("*.sh")), ids=lambda p: p.name)
def test_bootstrap_scripts_are_strict(script):
    # Steps get `set -euo pipefail` from common.sh, which every one of them sources first.
    text = script.read_text()
    assert "set -euo pipefail" in text or '. "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in text


class Node:
    """A fake node in tmp_path: the bootstrap's paths, a steps folder and a bin of fakes."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path
        self.steps = tmp_path / "steps"
        self.state = tmp_path / "state"
        self.log = tmp_path / "log" / "bootstrap.log"
        self.bin = tmp_path / "bin"
        self.calls = tmp_path / "calls"
        self.daemon_json = tmp_path / "docker" / "daemon.json"
        self.node_env = tmp_path / "node.env"
        for folder in (self.steps, self.bin, tmp_path / "units", tmp_path / "run", tmp_path / "apt" / "sources.list.d",
                       tmp_path / "apt" / "keyrings"):
            folder.mkdir(parents=True)
        (tmp_path / "os-release").write_text("ID=ubuntu\nVERSION_ID=24.04\nVERSION_CODENAME=noble\n")
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "GPU_SWARM_LOG": str(self.log), "GPU_SWARM_STATE": str(self.state),
            "GPU_SWARM_VERSIONS": str(NODE_SRC / "versions.env"), "GPU_SWARM_NODE_ENV": str(self.node_env),
            "GPU_SWARM_STEPS": str(self.steps), "GPU_SWARM_VENV": str(tmp_path / "venv"),
            "DOCKER_DAEMON_JSON": str(self.daemon_json), "FAKE_CALLS": str(self.calls),
            "GPU_SWARM_UNIT_DIR": str(tmp_path / "units"), "GPU_SWARM_WHEEL_TMP": str(tmp_path / "run"),
            "GPU_SWARM_WHEELHOUSE": str(tmp_path / "wheelhouse"), "GPU_SWARM_APT_DIR": str(tmp_path / "apt"),
            "GPU_SWARM_OS_RELEASE": str(tmp_path / "os-release"),
        }
        self.env.pop("STEP_STATUS_FILE", None)

    def step(self, name: str, body: str) -> None:
        """A fake step that, like the real ones, sources common.sh."""
        self.write(self.steps / f"{name}.sh", f'#!/usr/bin/env bash\n. "{COMMON}"\n{body}\n')

    # Scripts a step runs from beside itself.
    RUNS = {"install-gpu-agent": ["install-agent-venv"]}

    def real_step(self, name: str) -> None:
        for script in [name, *self.RUNS.get(name, [])]:
            shutil.copy(NODE_SRC / f"{script}.sh", self.steps / f"{script}.sh")
        shutil.copy(COMMON, self.steps / "common.sh")
        for unit in NODE_SRC.glob("*.service"):  # steps install units from beside themselves
            shutil.copy(unit, self.steps / unit.name)

    def fake(self, command: str, body: str) -> None:
        """A fake command that records its arguments, then runs body."""
        self.write(self.bin / command, f'#!/usr/bin/env bash\necho "{command} $*" >>"$FAKE_CALLS"\n{body}\n')

    @staticmethod
    def write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)

    def bootstrap(self, *steps: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(BOOTSTRAP), *steps], env={**self.env, **env},
                              capture_output=True, text=True, timeout=60)

    def timings(self) -> dict:
        return json.loads((self.state / "bootstrap-timings.json").read_text())

    def statuses(self) -> dict[str, str]:
        return {name: record["status"] for name, record in self.timings().items()}

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def test_runner_records_logs_and_stops_at_the_first_failure(node):
    node.step("first", 'echo "first ran"')
    node.step("second", 'skip "nothing to do"')
    node.step("third", 'echo "third broke"; exit 3')
    node.step("fourth", 'echo "fourth ran"')

    result = node.bootstrap("first", "second", "third", "fourth")

    assert result.returncode == 1
    assert node.statuses() == {"first": "done", "second": "skipped", "third": "failed"}
    assert all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in node.timings().values())
    log = node.log.read_text()
    assert "first ran" in log and "skipped: nothing to do" in log and "third broke" in log
    assert "fourth ran" not in log
    assert (node.state / Path(node_software.BOOTSTRAP_FAILED).name).read_text() == "third\n"
    assert not (node.state / Path(node_software.BOOTSTRAP_DONE).name).exists()
    assert "third broke" in result.stderr  # the log's tail, for cloud-init-output.log


def test_runner_rerun_skips_done_work_and_marks_completion(node):
    made = node.root / "made"
    node.step("make", f'if [ -e "{made}" ]; then skip "already made"; fi; echo once >>"{made}"')
    node.step("flaky", f'[ -e "{node.root}/fixed" ] || exit 1')

    assert node.bootstrap("make", "flaky").returncode == 1
    (node.root / "fixed").touch()
    first = node.bootstrap("make", "flaky")
    second = node.bootstrap("make", "flaky")

    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert made.read_text() == "once\n"
    assert node.statuses() == {"make": "skipped", "flaky": "done"}
    assert (node.state / "bootstrap-done").exists()
    assert not (node.state / "bootstrap-failed").exists()
    assert node.log.read_text().count("== make: start") == 3  # the log keeps every run


def test_runner_times_each_step(node):
    node.step("slow", "sleep 0.3")
    assert node.bootstrap("slow").returncode == 0
    assert 0.3 <= node.timings()["slow"]["seconds"] < 10


def test_runner_refuses_unknown_steps_before_running_any(node):
    node.step("first", 'echo "first ran"')
    result = node.bootstrap("first", "no-such-step")
    assert result.returncode == 1
    assert "unknown step 'no-such-step'" in result.stderr
    assert not (node.state / "bootstrap-timings.json").exists()


def test_runner_runs_a_background_step_beside_the_steps_after_it_and_waits_for_it(node):
    """head& waits for a file that the next step makes: run in order, it could never finish."""
    go, ended = node.root / "go", node.root / "head-ended"
    node.step("head", f'for _ in $(seq 100); do '
                      f'[ -e "{go}" ] && break; sleep 0.05; done; [ -e "{go}" ]; sleep 0.3; touch "{ended}"')
    node.step("next", f'touch "{go}"')

    result = node.bootstrap("head&", "next")

    assert result.returncode == 0, node.log.read_text()
    assert ended.exists() and (node.state / "bootstrap-done").exists()  # waited for before the boot ended
    assert list(node.timings()) == ["head", "next"]  # the command line's order, whatever ended first
    assert node.statuses() == {"head": "done", "next": "done"}
    assert node.timings()["head"]["seconds"] >= 0.3


def test_runner_records_a_failed_background_step_and_goes_on(node):
    """Its work is a head start that a later step does again (bootstrap.sh): that step decides."""
    node.step("head", "exit 3")
    node.step("next", "true")
    assert node.bootstrap("head&", "next").returncode == 0
    assert node.statuses() == {"head": "failed", "next": "done"}
    assert (node.state / "bootstrap-done").exists()


def test_runner_waits_for_a_background_step_when_a_step_fails(node):
    ended = node.root / "head-ended"
    node.step("head", f'sleep 0.5; touch "{ended}"')
    node.step("next", "exit 1")
    result = node.bootstrap("head&", "next")
    assert result.returncode == 1
    assert ended.exists()  # its pip is not left running under the next install, which takes the lock
    assert node.statuses() == {"head": "done", "next": "failed"}
    assert (node.state / "bootstrap-failed").read_text() == "next\n"


def test_runner_refuses_to_run_twice_at_once(node):
    node.step("first", "true")
    node.state.mkdir()
    with open(node.state / "bootstrap.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = node.bootstrap("first")
    assert result.returncode == 1
    assert "another bootstrap" in result.stderr


@pytest.mark.parametrize("last, code", [("true", 0), ("exit 1", 1)])
def test_runner_reloads_systemd_once_for_the_units_its_steps_enabled(node, last, code):
    """Two new units: no reload before their starts (systemd loads a new unit when asked), one at
    the end for the enables' links, also when a later step failed."""
    shutil.copy(COMMON, node.steps / "common.sh")  # install_service takes units from beside common.sh
    for name in ("one", "two"):
        node.write(node.steps / f"{name}.service", "[Service]\nExecStart=/bin/true\n")
        node.write(node.steps / f"{name}.sh", f'. "{node.steps}/common.sh"\ninstall_service {name}.service\n')
    node.step("last", last)
    node.fake("systemctl", 'if [ "$1" = show ]; then echo not-found; fi')
    assert node.bootstrap("one", "two", "last").returncode == code
    calls = node.called()
    assert calls.count("systemctl daemon-reload") == 1 and calls[-1] == "systemctl daemon-reload", calls
    assert calls.index("systemctl enable --no-reload two.service") < calls.index("systemctl daemon-reload")
    assert not (node.state / "reload-pending").exists()


def test_runner_needs_no_reload_when_no_step_enabled_a_unit(node):
    node.step("first", "true")
    node.fake("systemctl", "exit 0")
    assert node.bootstrap("first").returncode == 0
    assert node.called() == []


def test_runner_paths_are_the_ones_cloud_config_exports(node):
    node.step("first", "true")
    assert node.bootstrap("first").returncode == 0
    for path in (node_software.BOOTSTRAP_TIMINGS, node_software.BOOTSTRAP_DONE):
        assert (node.state / Path(path).name).exists()


@pytest.mark.parametrize("have, need, ok", [
    ("25.0.3", "25.0.3", True), ("26.1.5", "25.0.3", True), ("25.0.10", "25.0.3", True),
    ("25.0.2", "25.0.3", False), ("20.10.24", "25.0.3", False),
    ("1.19.0", "1.19.0", True), ("1.20.0", "1.19.0", True), ("1.18.1", "1.19.0", False),
])
def test_version_ge(node, have, need, ok):
    result = subprocess.run(["bash", "-c", f'. "{COMMON}"; version_ge "$1" "$2"', "-", have, need], env=node.env)
    assert (result.returncode == 0) is ok


def fake_nvidia_smi(node: Node) -> None:
    node.fake("nvidia-smi", """case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb)" ;;
  *driver_version*) echo 580.95.05; echo 580.95.05 ;;
esac""")


def test_install_docker_starts_an_installed_engine_that_a_failed_install_left_stopped(node):
    """Found by the rehearsal's roll: a node whose docker hit systemd's start limit stayed down,
    and the next upgrade's steps that need docker failed one after the other."""
    node.real_step("install-docker")
    pins = node_software.min_versions()
    node.fake("dockerd", f'echo "Docker version {pins["DOCKER_VERSION"]}, build 3ef3c07"')
    node.fake("containerd", f'echo "containerd containerd.io v{pins["CONTAINERD_VERSION"]} fcd4322"')
    node.fake("systemctl", '[ "$1" != is-active ]')  # not running; everything else works
    assert node.bootstrap("install-docker").returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-docker": "skipped"}
    assert [c for c in node.called() if c.startswith("systemctl")] == ["systemctl is-active -q docker", "systemctl reset-failed docker",
                             "systemctl enable --now docker"]


INSTALLED = """ii  nvidia-utils-580-server
ii  libnvidia-compute-580-server
ii  linux-modules-nvidia-580-server-open-6.8.0-1021-aws
ii  nvidia-fabricmanager-580
ii  libnvidia-container1
ii  nvidia-container-toolkit
rc  nvidia-utils-570-server
ii  linux-image-6.8.0-1021-aws
ii  python3
"""


def fake_dpkg(node: Node) -> None:
    node.fake("dpkg-query", f"printf '%s' '{INSTALLED}'")
    node.fake("apt-mark", "exit 0")
    node.fake("dpkg", "exit 0")  # dpkg -s: the kernel's packages are installed


def test_install_driver_skips_a_working_driver_and_holds_its_packages(node):
    """A driver that came with the image (Deep Learning AMI) is held like one the step installs."""
    node.real_step("install-nvidia-driver")
    fake_nvidia_smi(node)
    fake_dpkg(node)
    assert node.bootstrap("install-nvidia-driver").returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-nvidia-driver": "skipped"}
    assert "NVIDIA driver 580.95.05" in node.log.read_text()
    # One nvidia-smi call proves the driver answers and names its version: it runs at every boot.
    assert [c for c in node.called() if c.startswith("nvidia-smi")] == [
        "nvidia-smi --query-gpu=driver_version --format=csv,noheader"]
    # Installed NVIDIA packages only: not a removed one (rc), not python3; then the kernel the driver is for.
    holds = [c for c in node.called() if c.startswith("apt-mark")]
    assert holds[0] == ("apt-mark hold nvidia-utils-580-server libnvidia-compute-580-server "
                        "linux-modules-nvidia-580-server-open-6.8.0-1021-aws nvidia-fabricmanager-580 "
                        "libnvidia-container1 nvidia-container-toolkit")
    assert "apt-mark hold linux-image-aws" in holds[1:]


# What nvidia-smi prints, and its exit code, when the driver's module is not loaded (exit 9).
NO_DRIVER = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver. Make sure that '
             'the latest NVIDIA driver is installed and running."; exit 9')


@pytest.mark.parametrize("loads, code", [(True, 0), (False, 1)])
def test_install_driver_loads_a_module_that_is_not_loaded_and_fails_when_the_driver_stays_out_of_reach(
        node, loads, code):
    node.real_step("install-nvidia-driver")
    fake_dpkg(node)
    node.fake("uname", "echo 6.8.0-1021-aws")
    node.fake("modprobe", f'[ "$1" = nvidia ] && {"touch " + str(node.root / "loaded") if loads else "exit 1"}')
    node.fake("nvidia-smi", f'if [ -e "{node.root}/loaded" ]; then echo 580.95.05; else {NO_DRIVER}; fi')
    assert node.bootstrap("install-nvidia-driver").returncode == code, node.log.read_text()
    called = node.called()
    assert called.index("modprobe nvidia") > called.index("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    if loads:
        assert node.statuses() == {"install-nvidia-driver": "skipped"} and "NVIDIA driver 580.95.05" in node.log.read_text()
    else:  # not the driver's error text taken for a version
        assert "nvidia-smi cannot reach the driver on kernel 6.8.0-1021-aws" in node.log.read_text()
        assert not [c for c in called if c.startswith(("apt-get", "apt-mark"))]


def test_install_driver_will_not_layer_a_driver_onto_a_deep_learning_ami(node):
    node.real_step("install-nvidia-driver")
    node.node_env.write_text("GPU_SWARM_IMAGE=deep-learning\n")
    env_path = ":".join(p for p in node.env["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    assert node.bootstrap("install-nvidia-driver", PATH=env_path).returncode == 1
    assert node.statuses() == {"install-nvidia-driver": "failed"}
    assert "Deep Learning AMI" in node.log.read_text()


def test_install_fabric_manager_skips_when_running(node):
    node.real_step("install-fabric-manager")
    fake_nvidia_smi(node)
    fake_dpkg(node)
    node.fake("systemctl", "exit 0")
    assert node.bootstrap("install-fabric-manager").returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-fabric-manager": "skipped"}


def test_toolkit_step_registers_the_runtime_once_and_keeps_other_keys(node):
    """The guard, not the toolkit, is the default runtime: the agent sets it after this step."""
    node.real_step("install-container-toolkit")
    node.fake("nvidia-ctk", """case "$1" in
  --version) echo "NVIDIA Container Toolkit CLI version $PIN"; echo "commit: 1a2b3c" ;;
  runtime) python3 - "$DOCKER_DAEMON_JSON" <<'PY'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["runtimes"] = {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}
json.dump(config, open(path, "w"), indent=4)
PY
  ;;
esac""")
    node.write(node.daemon_json, '{"log-driver": "json-file", "default-runtime": "gpu-swarm"}\n')
    node.env["PIN"] = node_software.min_versions()["TOOLKIT_VERSION"]
    fake_dpkg(node)

    assert node.bootstrap("install-container-toolkit").returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-container-toolkit": "done"}
    after = json.loads(node.daemon_json.read_text())
    assert after["log-driver"] == "json-file" and after["default-runtime"] == "gpu-swarm"
    assert node.bootstrap("install-container-toolkit").returncode == 0
    assert node.statuses() == {"install-container-toolkit": "skipped"}
    assert [c for c in node.called() if c.startswith("nvidia-ctk runtime")] == [
        "nvidia-ctk runtime configure --runtime=docker"]


PINNED_NVML = node_software.min_versions()["NVIDIA_ML_PY_VERSION"]
PINNED_PROMETHEUS = node_software.min_versions()["PROMETHEUS_CLIENT_VERSION"]
PINNED = f"nvidia-ml-py=={PINNED_NVML} prometheus-client=={PINNED_PROMETHEUS}"  # what the venv has, as the step asks


def test_gpu_agent_step_enables_and_runs_the_unit(node):
    node.real_step("install-gpu-agent")
    node.write(node.root / "venv" / "bin" / "python", f"#!/bin/sh\necho {PINNED}\n")  # pinned NVML installed
    # systemd never loaded the agent's unit (a first boot), and holds an older copy of the guard's.
    node.fake("systemctl", """if [ "$1" = show ]; then
  case $* in *agent*) echo not-found ;; *) echo loaded ;; esac
fi""")
    assert node.bootstrap("install-gpu-agent").returncode == 0, node.log.read_text()
    show = "systemctl show -p LoadState --value"
    assert node.called() == [f"{show} gpu-swarm-agent.service", "systemctl start gpu-swarm-agent.service",
                             "systemctl enable --no-reload gpu-swarm-agent.service",
                             f"{show} gpu-swarm-guard.service", "systemctl daemon-reload",
                             "systemctl restart gpu-swarm-guard.service",
                             "systemctl enable --no-reload gpu-swarm-guard.service",
                             "systemctl list-jobs --no-legend docker.service",
                             "systemctl daemon-reload"]  # bootstrap's one reload for the enables' links
    for unit in ("gpu-swarm-agent.service", "gpu-swarm-guard.service"):  # the guard's server: see guard_server.py
        assert (node.root / "units" / unit).read_text() == (NODE_SRC / unit).read_text()


@pytest.mark.parametrize("shown, reloads", [
    ("not-found", False),  # new, or found missing before: systemd loads it when it is next asked for
    ("loaded", True),  # an older copy loaded (an upgrade)
    ("error", True),  # a broken older copy
    ("", True),  # systemctl could not say
])
def test_install_service_reloads_systemd_only_when_it_held_an_older_unit(node, shown, reloads):
    """systemd 257 says NeedDaemonReload=yes of every unit once an enable changed a .wants folder, so
    the step asks only whether systemd holds the unit at all (LoadState), before it puts the file there."""
    node.real_step("install-health-watcher")
    node.fake("systemctl", f'if [ "$1" = show ]; then echo "{shown}"; fi')
    assert node.bootstrap("install-health-watcher").returncode == 0, node.log.read_text()
    calls = node.called()
    restart = calls.index("systemctl restart gpu-swarm-health.service")
    assert ("systemctl daemon-reload" in calls[:restart]) is reloads
    # Then the enable, and bootstrap's one reload at its end, which reads the enable's links.
    assert calls[restart:] == ["systemctl restart gpu-swarm-health.service",
                               "systemctl enable --no-reload gpu-swarm-health.service", "systemctl daemon-reload"]


def test_install_service_leaves_an_unchanged_unit_file_and_systemd_alone(node):
    """An upgrade whose node software left the unit as it was: no copy, no question, no reload
    before the restart (systemd read the file when the step put it there)."""
    node.real_step("install-health-watcher")
    unit = node.root / "units" / "gpu-swarm-health.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text((NODE_SRC / "gpu-swarm-health.service").read_text())
    os.utime(unit, (1, 1))
    node.fake("systemctl", 'if [ "$1" = show ]; then echo loaded; fi')
    assert node.bootstrap("install-health-watcher").returncode == 0, node.log.read_text()
    assert node.called() == ["systemctl restart gpu-swarm-health.service",
                             "systemctl enable --no-reload gpu-swarm-health.service", "systemctl daemon-reload"]
    assert unit.stat().st_mtime == 1


def test_gpu_agent_step_waits_for_the_docker_restart_the_agent_queued(node):
    """CI: MPS turned on for a running pool; the agent queued docker's restart (--no-block) and the
    next step, build-check-image, met a docker going down ("Cannot connect to the Docker daemon")."""
    node.real_step("install-gpu-agent")
    node.write(node.root / "venv" / "bin" / "python", f"#!/bin/sh\necho {PINNED}\n")
    # The restart job is listed for three asks, as systemd lists a queued, then running, job.
    node.fake("systemctl", f"""if [ "$1" = list-jobs ]; then
  n=$(cat {node.root}/asked 2>/dev/null || echo 0); echo $((n + 1)) >{node.root}/asked
  if [ "$n" -lt 3 ]; then echo "1234 docker.service restart running"; fi
fi""")
    assert node.bootstrap("install-gpu-agent").returncode == 0, node.log.read_text()
    calls = node.called()
    assert calls.count("systemctl list-jobs --no-legend docker.service") == 4
    # The guard's server, which needs no docker, is installed while docker restarts; the step ends after.
    assert calls.index("systemctl start gpu-swarm-agent.service") < calls.index(
        "systemctl restart gpu-swarm-guard.service") < calls.index("systemctl list-jobs --no-legend docker.service")
    assert calls[-2:] == ["systemctl list-jobs --no-legend docker.service", "systemctl daemon-reload"]  # bootstrap's


def wheel(dist: str, version: str, *, module: str, purelib: bool = True, extra: dict | None = None) -> bytes:
    """A real wheel of one module, as setuptools writes one: the module, and its .dist-info."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {module: b"LOADED = True\n", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: {str(purelib).lower()}\nTag: py3-none-any\n".encode(),
             **(extra or {})}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
    return buf.getvalue()


AGENT_WHEELS = {  # versions.env's prefix -> the distribution and the module its wheel installs
    "NVIDIA_ML_PY": ("nvidia-ml-py", "pynvml.py"), "PROMETHEUS_CLIENT": ("prometheus-client", "prometheus_client/__init__.py")}


def pinned_wheels(**versions: str) -> dict[str, bytes]:
    """versions.env's wheel file name -> a real wheel of that distribution at that version (the pin unless given)."""
    pins = node_software.min_versions()
    return {node_software.pinned_wheel(prefix)[1]: wheel(dist, versions.get(prefix, pins[f"{prefix}_VERSION"]), module=module)
            for prefix, (dist, module) in AGENT_WHEELS.items()}


def put(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def venv_has(node) -> str:
    """What the venv's own Python says is installed, as the step asks it."""
    return subprocess.run([str(node.root / "venv" / "bin" / "python"), "-c",
                           "from importlib.metadata import version as v; import pynvml, prometheus_client; "
                           "print(f'nvidia-ml-py=={v(\"nvidia-ml-py\")} prometheus-client=={v(\"prometheus-client\")}')"],
                          capture_output=True, text=True).stdout.strip()


def serve_wheels(node, served: dict[str, bytes], *, delay: float = 0) -> Path:
    """curl, as `curl -fsSL -o FILE URL` runs: FILE gets the served wheel of URL's file name, or curl exits
    22 as for an HTTP 404. Returns a versions.env whose wheel pins are those URLs, with the served bytes' sha256."""
    folder = node.root / "pypi"
    put(folder, served)
    node.fake("curl", f'sleep {delay}; out=$3 url=$4; [ -f "{folder}/${{url##*/}}" ] || exit 22; cp "{folder}/${{url##*/}}" "$out"')
    text = (NODE_SRC / "versions.env").read_text()
    for prefix in AGENT_WHEELS:
        url, name, pinned = node_software.pinned_wheel(prefix)
        sha = hashlib.sha256(served.get(name, b"")).hexdigest()
        text = text.replace(f"{url}#sha256={pinned}", f"https://files.pythonhosted.org/packages/aa/bb/cc/{name}#sha256={sha}")
    versions = node.root / "versions.env"
    versions.write_text(text)
    return versions


def test_agent_venv_installs_the_images_wheels_without_pip_or_a_download(node):
    """An image that carries the pinned wheels (the rehearsal's): unpacked into a new venv, no curl, no apt,
    and no pip: the venv's Python finds both at their pins, and the step's scratch folder is gone."""
    node.real_step("install-agent-venv")
    put(node.root / "wheelhouse", pinned_wheels())
    for tool in ("curl", "apt-get", "pip"):
        node.fake(tool, "exit 1")
    assert node.bootstrap("install-agent-venv").returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-agent-venv": "done"}
    # Compiled by the step, as pip compiles, not by the units' first imports (asked before any import here).
    assert list((node.root / "venv").glob("lib/python3*/site-packages/__pycache__/pynvml.cpython-*.pyc"))
    assert venv_has(node) == PINNED
    assert node.called() == []
    assert not (node.root / "venv" / "bin" / "pip").exists()
    assert list((node.root / "run").iterdir()) == []
    assert "from the image's wheelhouse" in node.log.read_text()


def test_agent_venv_downloads_each_pinned_wheel_and_checks_its_sha256(node):
    """No wheelhouse (the Deep Learning AMI, plain Ubuntu): each wheel from its pinned URL, checked, then unpacked."""
    node.real_step("install-agent-venv")
    versions = serve_wheels(node, pinned_wheels())
    result = node.bootstrap("install-agent-venv", GPU_SWARM_VERSIONS=str(versions))
    assert result.returncode == 0, node.log.read_text()
    assert venv_has(node) == PINNED
    calls = [c.split() for c in node.called()]
    assert [c[-1] for c in calls] == [f"https://files.pythonhosted.org/packages/aa/bb/cc/{name}" for name in pinned_wheels()]
    assert all(c[:3] == ["curl", "-fsSL", "-o"] and c[3].startswith(f"{node.root}/run/gpu-swarm-wheels.") for c in calls)
    assert list((node.root / "run").iterdir()) == []


def test_agent_venv_refuses_a_download_whose_sha256_is_not_the_pinned_one(node):
    node.real_step("install-agent-venv")
    versions = serve_wheels(node, pinned_wheels())
    served = node.root / "pypi" / next(iter(pinned_wheels()))
    served.write_bytes(pinned_wheels(NVIDIA_ML_PY="99.0.0")[served.name])  # another wheel under the pinned name
    assert node.bootstrap("install-agent-venv", GPU_SWARM_VERSIONS=str(versions)).returncode == 1
    assert node.statuses() == {"install-agent-venv": "failed"}
    assert f"/{served.name} does not have the sha256 pinned in versions.env" in node.log.read_text()
    assert not (node.root / "venv").exists()  # nothing made from it


def test_agent_venv_replaces_another_version_and_leaves_no_file_of_it(node):
    """Last release's pin (or an AMI's venv): the venv is made anew with the pins, nothing of the old one left."""
    node.real_step("install-agent-venv")
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(node.root / "venv")], check=True)
    old = wheel("nvidia-ml-py", "12.535.77", module="pynvml.py", extra={"pynvml_old_only.py": b""})
    site = subprocess.run([str(node.root / "venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    zipfile.ZipFile(io.BytesIO(old)).extractall(site)
    put(node.root / "wheelhouse", pinned_wheels())
    assert node.bootstrap("install-agent-venv").returncode == 0, node.log.read_text()
    assert venv_has(node) == PINNED
    assert not Path(site, "pynvml_old_only.py").exists() and not Path(site, "nvidia_ml_py-12.535.77.dist-info").exists()


def test_agent_venv_refuses_a_wheel_that_unpacking_would_not_install(node):
    """A pin bumped to a wheel with compiled parts (Root-Is-Purelib: false) or a .data folder: unpacked, it
    would be half installed, so the step fails and says what to pin."""
    node.real_step("install-agent-venv")
    wheels = pinned_wheels()
    name = next(iter(wheels))
    wheels[name] = wheel("nvidia-ml-py", PINNED_NVML, module="pynvml.py", purelib=False)
    put(node.root / "wheelhouse", wheels)
    assert node.bootstrap("install-agent-venv").returncode == 1
    assert f"{name}: not a pure-Python wheel" in node.log.read_text()


def test_agent_step_waits_for_the_background_venv_and_downloads_nothing_again(node):
    """The background run holds the venv's lock while it downloads; the agent step then finds the pins."""
    node.real_step("install-gpu-agent")
    versions = serve_wheels(node, pinned_wheels(), delay=0.3)
    node.fake("systemctl", "exit 0")
    # In a boot, steps stand between the two: here one that waits until the background run downloads.
    node.step("between", f'for _ in $(seq 500); do grep -q "^curl" "{node.calls}" 2>/dev/null && exit 0; sleep 0.02; done; exit 1')
    result = node.bootstrap("install-agent-venv&", "between", "install-gpu-agent", GPU_SWARM_VERSIONS=str(versions))
    assert result.returncode == 0, node.log.read_text()
    assert len([c for c in node.called() if c.startswith("curl")]) == 2  # one per wheel, once
    assert node.statuses() == {"install-agent-venv": "done", "between": "done", "install-gpu-agent": "done"}
    assert "skipped: the venv has" in node.log.read_text()  # the agent step's run found it made
    assert venv_has(node) == PINNED


def test_gpu_agent_step_fails_loudly_with_the_agents_journal(node):
    node.real_step("install-gpu-agent")
    node.write(node.root / "venv" / "bin" / "python", f"#!/bin/sh\necho {PINNED}\n")
    node.fake("systemctl", '[ "$1" != start ]')
    node.fake("journalctl", 'echo "agent: NVML failed"')
    assert node.bootstrap("install-gpu-agent").returncode == 1
    assert node.statuses() == {"install-gpu-agent": "failed"}
    assert "agent: NVML failed" in node.log.read_text()


@pytest.mark.parametrize("step,units", [("install-health-watcher", ["gpu-swarm-health.service"]),
                                        ("install-reconciler", ["gpu-swarm-reconciler.service",
                                                                "gpu-swarm-scaler.service"]),
                                        ("install-gpu-metrics", ["gpu-swarm-metrics.service"])])
def test_health_steps_install_enable_and_restart_their_unit(node, step, units):
    """Restart, not start: a node that gets new software runs the new watcher at once."""
    node.real_step(step)
    node.fake("systemctl", "exit 0")
    assert node.bootstrap(step).returncode == 0, node.log.read_text()
    assert node.called() == [call for unit in units for call in (
        f"systemctl show -p LoadState --value {unit}", "systemctl daemon-reload",  # systemctl said nothing: reload
        f"systemctl restart {unit}", f"systemctl enable --no-reload {unit}")] + ["systemctl daemon-reload"]
    for unit in units:
        assert (node.root / "units" / unit).read_text() == (NODE_SRC / unit).read_text()


def test_a_health_unit_that_does_not_start_fails_its_step_with_its_journal(node):
    node.real_step("install-health-watcher")
    node.fake("systemctl", '[ "$1" != restart ]')
    node.fake("journalctl", 'echo "gpu-swarm health: NVML failing"')
    assert node.bootstrap("install-health-watcher").returncode == 1
    assert node.statuses() == {"install-health-watcher": "failed"}
    log = node.log.read_text()
    assert "gpu-swarm health: NVML failing" in log and "gpu-swarm-health.service failed to start" in log


def test_apply_docker_config_drops_live_restore_and_restarts_only_on_change(node):
    node.real_step("apply-docker-config")
    node.fake("systemctl", "exit 0")
    node.write(node.daemon_json, '{"live-restore": true, "default-runtime": "nvidia"}\n')

    assert node.bootstrap("apply-docker-config").returncode == 0, node.log.read_text()
    assert json.loads(node.daemon_json.read_text()) == {"default-runtime": "nvidia"}
    assert node.statuses() == {"apply-docker-config": "done"}
    assert node.bootstrap("apply-docker-config").returncode == 0
    assert node.statuses() == {"apply-docker-config": "skipped"}
    node.write(node.daemon_json, '{"default-runtime": "nvidia", "node-generic-resources": []}\n')
    assert node.bootstrap("apply-docker-config").returncode == 0
    assert node.called().count("systemctl restart docker") == 2
    # Each deliberate restart first clears systemd's start limit (3 in 60 s for docker.service),
    # which a node's first boot (start, the agent's restart, this one) and an upgrade soon
    # after used to hit (found by `localswarm program up --bump-node-software`).
    calls = node.called()
    assert calls.count("systemctl reset-failed docker") == 2
    assert calls.index("systemctl reset-failed docker") < calls.index("systemctl restart docker")


@pytest.mark.parametrize("enabled", [True, False])
def test_apply_docker_config_enables_docker_only_when_it_is_not(node, enabled):
    """`systemctl enable docker` runs update-rc.d for the package's init script, 0.27 s each time:
    asked first, so a node whose docker is enabled (every boot after install-docker) skips it."""
    node.real_step("apply-docker-config")
    node.fake("systemctl", f'if [ "$1" = is-enabled ]; then exit {0 if enabled else 1}; fi')
    node.write(node.daemon_json, '{"default-runtime": "nvidia"}\n')
    assert node.bootstrap("apply-docker-config").returncode == 0, node.log.read_text()
    enables = [c for c in node.called() if c.startswith("systemctl enable")]
    assert enables == ([] if enabled else ["systemctl enable --no-reload -q docker"])


def test_apply_docker_config_leaves_docker_running_when_only_labels_changed(node):
    """The health watcher changes its engine labels while the node runs (dockerd reloads them
    on SIGHUP): an upgrade must not restart docker for them."""
    node.real_step("apply-docker-config")
    node.fake("systemctl", "exit 0")
    node.write(node.daemon_json, '{"default-runtime": "nvidia", "labels": ["gpu.count=1"]}\n')
    assert node.bootstrap("apply-docker-config").returncode == 0, node.log.read_text()
    node.write(node.daemon_json, '{"labels": ["gpu.count=1", "gpu-swarm.condition=healthy"], '
                                 '"default-runtime": "nvidia"}\n')
    assert node.bootstrap("apply-docker-config").returncode == 0
    assert node.statuses() == {"apply-docker-config": "skipped"}
    assert node.called().count("systemctl restart docker") == 1


@pytest.mark.parametrize("file_age_s,systemd_says,restarts", [(120, True, 0), (0, True, 1), (120, False, 1)])
def test_apply_docker_config_restarts_only_a_dockerd_older_than_the_file(node, file_age_s, systemd_says, restarts):
    """A dockerd that started after daemon.json last changed has read it (a first boot; the GPU
    agent's restart): no second restart. One started before, or when systemd cannot say: restart."""
    node.real_step("apply-docker-config")
    started = subprocess.run(["date", "-u", "-d", "1 minute ago", "+%a %Y-%m-%d %H:%M:%S.%6N UTC"],
                             capture_output=True, text=True, check=True).stdout.strip()
    node.fake("systemctl", f'if [ "$1" = show ]; then echo "{started if systemd_says else ""}"; fi')
    node.write(node.daemon_json, '{"default-runtime": "nvidia"}\n')
    os.utime(node.daemon_json, (time.time() - file_age_s,) * 2)
    assert node.bootstrap("apply-docker-config").returncode == 0, node.log.read_text()
    assert node.called().count("systemctl restart docker") == restarts
    assert node.statuses() == {"apply-docker-config": "done" if restarts else "skipped"}
    assert node.bootstrap("apply-docker-config").returncode == 0  # and the next time knows it by its stamp
    assert node.called().count("systemctl restart docker") == restarts


def test_apply_docker_config_creates_a_missing_daemon_json(node):
    node.real_step("apply-docker-config")
    node.fake("systemctl", "exit 0")
    assert node.bootstrap("apply-docker-config").returncode == 0, node.log.read_text()
    assert json.loads(node.daemon_json.read_text()) == {}


def test_nvlink_subnet_manager_loads_ib_umad_installs_nvlsm_and_holds_it(node, tmp_path):
    """p6-b200/b300: the fabric manager's precheck needs ib_umad loaded and nvlsm installed."""
    node.real_step("install-nvlink-subnet-manager")
    conf = tmp_path / "modules-load.conf"
    step = node.steps / "install-nvlink-subnet-manager.sh"
    step.write_text(step.read_text().replace("conf=/etc/modules-load.d/gpu-swarm-nvlsm.conf", f"conf={conf}"))
    have = tmp_path / "nvlsm-installed"
    node.fake("lsmod", f'[ -e {tmp_path}/loaded ] && echo "ib_umad 40960 0"; exit 0')
    node.fake("modprobe", f'touch {tmp_path}/loaded')
    node.fake("apt-get", "exit 0")
    node.fake("apt-cache", '[ "$2" = nvlsm ]')  # show nvlsm: it is in the sources
    node.fake("apt-mark", "exit 0")
    node.fake("dpkg-query", f'[ -e {have} ] && printf "ii  nvlsm\\n"; exit 0')
    # `command -v nvlsm` finds it once "installed": apt-get install drops it in the fakes' bin.
    node.fake("apt-get", f'case "$*" in *install*nvlsm*) touch {have}; printf "#!/bin/sh\\n" >{node.bin}/nvlsm; '
                         f'chmod +x {node.bin}/nvlsm ;; esac')
    assert node.bootstrap("install-nvlink-subnet-manager").returncode == 0, node.log.read_text()
    assert conf.read_text() == "ib_umad\n"
    calls = node.called()
    assert "modprobe ib_umad" in calls and any(c.startswith("apt-get") and "install" in c and "nvlsm" in c
                                               for c in calls)
    assert "apt-mark hold nvlsm" in calls
    assert node.bootstrap("install-nvlink-subnet-manager").returncode == 0
    assert node.statuses() == {"install-nvlink-subnet-manager": "skipped"}


def test_nvlink_subnet_manager_missing_from_the_sources_fails_with_what_to_do(node, tmp_path):
    node.real_step("install-nvlink-subnet-manager")
    step = node.steps / "install-nvlink-subnet-manager.sh"
    step.write_text(step.read_text().replace("conf=/etc/modules-load.d/gpu-swarm-nvlsm.conf",
                                             f"conf={tmp_path}/m.conf"))
    node.fake("lsmod", "exit 0")
    node.fake("modprobe", "exit 0")
    node.fake("apt-get", "exit 0")
    node.fake("apt-cache", "exit 100")  # apt-cache show: no such package
    assert node.bootstrap("install-nvlink-subnet-manager").returncode == 1
    assert "no nvlsm package in this node's apt sources" in node.log.read_text()
