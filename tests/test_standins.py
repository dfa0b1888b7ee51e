"""The rehearsal's hardware stand-ins (localswarm/standins), run here without a machine: each reads a
hardware file under tmp_path (GPU_SWARM_REHEARSAL_HARDWARE) and answers as its real counterpart."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from localswarm import standins
from localswarm.standins import hardware
from to_node import software as node_software
from tests.tools import require_tool

HERE = standins.HERE
UUIDS = [f"GPU-{n:08x}-aaaa-bbbb-cccc-{n:012x}" for n in range(3)]


def gpus(count: int = 2) -> list[dict]:
    return [{"uuid": UUIDS[n], "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559} for n in range(count)]


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A hardware file and a toolkit config under tmp_path, as the stand-ins find them in a machine."""
    hw = tmp_path / "hardware.json"
    hw.write_text(json.dumps(hardware.describe(gpus())))
    toolkit = tmp_path / "config.toml"
    toolkit.write_text((HERE / "config.toml").read_text())
    monkeypatch.setenv("GPU_SWARM_REHEARSAL_HARDWARE", str(hw))
    monkeypatch.setenv("GPU_SWARM_REHEARSAL_TOOLKIT_CONFIG", str(toolkit))
    monkeypatch.delenv("FAKE_PYNVML", raising=False)
    return tmp_path


def fault(hw: Path, index: int, value: dict | None) -> None:
    description = json.loads(hw.read_text())
    description["gpus"][index].pop("fault", None)
    if value:
        description["gpus"][index]["fault"] = value
    hw.write_text(json.dumps(description))


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the one list -----------------------------------------------------------------------------

def test_every_standin_says_why_and_ships_files_that_exist():
    assert len({s.name for s in standins.STANDINS}) == len(standins.STANDINS)
    for standin in standins.STANDINS:
        assert len(standin.reason) > 40, standin.name
        for name in standin.files + tuple(source for _, source in standin.etc):
            assert (HERE / name).is_file(), name
        for name in standin.node_files:
            assert (standins.REPO / "node" / name).is_file(), name
        assert set(standin.commands) <= set(standin.files)
    files = standins.image_files()
    assert f"{standins.WHEELHOUSE}/{node_software.pinned_wheel('NVIDIA_ML_PY')[1]}" in files  # under the pinned wheel's name, where install-agent-venv.sh looks
    assert "/etc/pip.conf" not in files  # no pip runs on a node
    assert set(standins.image_links()) == {"/usr/bin/nvidia-smi", "/usr/bin/nvidia-ctk", "/usr/bin/nv-fabricmanager",
                                           "/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-cuda-mps-control"}


@pytest.mark.parametrize("script", ["nvidia-container-runtime", "nv-fabricmanager"])
def test_shell_standins_pass_shellcheck(script):
    shellcheck = require_tool("shellcheck")
    result = subprocess.run([shellcheck, str(HERE / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_generated_nvidia_smi_passes_shellcheck(tmp_path):
    shellcheck = require_tool("shellcheck")
    (tmp_path / "nvidia-smi").write_text(hardware.smi_script(gpus(), "580.159.04"))
    result = subprocess.run([shellcheck, "nvidia-smi"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# --- nvidia-smi ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shell", ["dash", "busybox sh"])
def test_nvidia_smi_answers_what_node_scripts_and_the_agent_ask(tmp_path, shell):
    if not shutil.which(shell.split()[0]):
        pytest.skip(f"{shell} is not installed")
    script = tmp_path / "nvidia-smi"
    script.write_text(hardware.smi_script(gpus(), "580.159.04"))

    def smi(*args):
        return subprocess.run([*shell.split(), str(script), *args], capture_output=True, text=True)

    assert smi("-L").stdout.splitlines() == [f"GPU {n}: NVIDIA H100 80GB HBM3 (UUID: {UUIDS[n]})" for n in range(2)]
    assert smi("--query-gpu=driver_version", "--format=csv,noheader").stdout == "580.159.04\n580.159.04\n"
    # node/gpu_detect.py's fallback
    rows = smi("--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits").stdout.splitlines()
    assert rows == [f"{n}, {UUIDS[n]}, NVIDIA H100 80GB HBM3, 81559" for n in range(2)]
    assert smi("--query-gpu=name,memory.total", "--format=csv").stdout.splitlines()[:2] == [
        "name, memory.total [MiB]", "NVIDIA H100 80GB HBM3, 81559 MiB"]
    bad = smi("--query-gpu=name,bogus", "--format=csv")
    assert (bad.returncode, bad.stdout) == (2, "") and 'Field "bogus"' in bad.stderr
    script.write_text(hardware.smi_script([], "580.159.04"))
    none = smi("-L")
    assert (none.returncode, none.stdout) == (6, "No devices were found\n")


def test_machine_nvidia_smi_leaves_out_a_gpu_that_fell_off_the_bus(machine):
    smi = [sys.executable, str(HERE / "nvidia-smi"), "-L"]
    env = dict(os.environ)
    assert len(subprocess.run(smi, capture_output=True, text=True, env=env).stdout.splitlines()) == 2
    fault(machine / "hardware.json", 0, {"missing": True})
    assert subprocess.run(smi, capture_output=True, text=True, env=env).stdout == \
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {UUIDS[1]})\n"


def test_machine_nvidia_smi_sets_compute_modes_which_nvml_and_queries_then_report(machine):
    smi = [sys.executable, str(HERE / "nvidia-smi")]
    query = [*smi, "--query-gpu=uuid,compute_mode", "--format=csv,noheader"]
    assert subprocess.run([*smi, "-i", UUIDS[1], "-c", "EXCLUSIVE_PROCESS"]).returncode == 0
    assert subprocess.run(query, capture_output=True, text=True).stdout == \
        f"{UUIDS[0]}, Default\n{UUIDS[1]}, Exclusive_Process\n"
    assert [g.get("compute_mode", 0) for g in hardware.load()["gpus"]] == [0, 3]  # what pynvml.py reads
    assert subprocess.run([*smi, "-c", "DEFAULT"]).returncode == 0  # gpu-swarm-mps stop: every GPU
    assert [g["compute_mode"] for g in hardware.load()["gpus"]] == [0, 0]
    wrong = subprocess.run([*smi, "-i", "GPU-nope", "-c", "3"], capture_output=True, text=True)
    assert (wrong.returncode, wrong.stderr) == (6, "No devices were found matching GPU-nope\n")
    wrong = subprocess.run([*smi, "-c", "PROHIBITED"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "compute mode PROHIBITED" in wrong.stderr


@pytest.fixture
def mps_daemon(tmp_path):
    from tests.mps_standin import Daemon
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="mps", dir="/tmp")))  # socket paths under 108 bytes
    yield daemon
    daemon.kill()
    shutil.rmtree(daemon.pipe.parent.parent, ignore_errors=True)


def test_mps_control_daemonizes_under_its_name_and_its_server_keeps_the_ceiling_it_started_with(mps_daemon):
    from tests.mps_standin import cuda_client, gone
    d = mps_daemon
    assert Path(f"/proc/{d.pid}/comm").read_text().startswith("nvidia-cuda-mps")  # as gpu-swarm-mps checks
    assert {p.name for p in d.pipe.iterdir()} >= {"control", "control_privileged", "nvidia-cuda-mps-control.pid"}
    d.control("set_default_device_pinned_mem_limit 0 7680M")
    d.control("set_default_active_thread_percentage 25")
    assert d.control("get_default_device_pinned_mem_limit 0") == "7680M"
    assert d.control("get_server_list") == ""
    d.control("start_server -uid 0")
    (server,) = d.servers()
    assert d.control("get_server_list") == str(server)
    assert Path(f"/proc/{server}/comm").read_text().startswith("nvidia-cuda-mps")
    assert cuda_client(d.pipe / "control") == 7680  # the server's ceiling, handed to the client
    d.control("set_default_device_pinned_mem_limit 0 200G")  # a running server keeps the one it started with
    assert cuda_client(d.pipe / "control") == 7680
    d.control(f"set_device_pinned_mem_limit {server} 0 4G")  # a server's own ceiling, through the daemon
    assert d.control(f"get_device_pinned_mem_limit {server} 0") == "4G" and cuda_client(d.pipe / "control") == 4096
    d.control("quit")
    assert gone(d.pid) and gone(server)


def test_mps_control_takes_default_changes_on_control_privileged_only(mps_daemon):
    from tests.mps_standin import ui
    d = mps_daemon
    assert "Insufficient privileges" in ui(d.pipe / "control", "set_default_device_pinned_mem_limit 0 200G")
    assert d.control("get_default_device_pinned_mem_limit 0") == ""
    assert ui(d.pipe / "control_privileged", "set_default_device_pinned_mem_limit 0 2G") == ""
    assert d.control("get_default_device_pinned_mem_limit 0") == "2G"


def test_mps_control_serves_one_connection_at_a_time_and_waits_for_credentials_forever(mps_daemon):
    """As measured: one idle peer holds the daemon; pending peers past its backlog are refused at once."""
    from tests.mps_standin import connect, cuda_client
    d = mps_daemon
    idle = connect(d.pipe / "control")  # connects, never speaks
    with pytest.raises(subprocess.TimeoutExpired):
        d.control("get_server_list", timeout=1.5)
    pending, refused = [], 0
    for _ in range(200):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(str(d.pipe / "control"))
            pending.append(sock)
        except BlockingIOError:
            refused += 1
            sock.close()
    assert 100 <= len(pending) <= 140 and refused == 200 - len(pending)  # the backlog: 128, give or take
    idle.close()
    for sock in pending:
        sock.close()
    deadline = time.monotonic() + 20
    while True:  # the daemon goes on once it has accepted (and dropped) the connections that are gone
        try:
            assert cuda_client(d.pipe / "control") > 0
            break
        except BlockingIOError:  # its backlog is still full of them: a client is refused at once
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.parametrize("how", ["drop", "mute"])
def test_a_client_that_drops_or_never_uses_its_server_descriptor_stops_the_server_for_good(mps_daemon, how):
    """As measured on an H200: later clients get nothing; get_server_list answers, a command that needs the
    server blocks the daemon; killing daemon and server by pid and starting again brings it back."""
    from tests.mps_standin import CLIENT, CRED, CUFD, HELLO, Daemon, connect, cuda_client, gone, receive
    d = mps_daemon
    d.control("set_default_device_pinned_mem_limit 0 4G")
    d.control("start_server -uid 0")
    (server,) = d.servers()
    assert cuda_client(d.pipe / "control") == 4096
    held = None
    if how == "drop":
        cuda_client(d.pipe / "control", drop=True)
    else:  # the whole handshake, and the descriptor kept without a word
        with connect(d.pipe / "control") as sock:
            assert receive(sock)[0] == HELLO
            sock.send(CRED)
            sock.send(CLIENT)
            data, fds = receive(sock)
            assert data == CUFD
            sock.send(b"\0\0\0\0")
        held = socket.socket(fileno=fds[0])
    with pytest.raises(OSError):
        cuda_client(d.pipe / "control", timeout=1.5)
    assert d.control("get_server_list") == str(server)
    with pytest.raises(subprocess.TimeoutExpired):
        d.control(f"get_device_pinned_mem_limit {server} 0", timeout=1.5)
    assert "User did not send valid credentials" in (d.log / "server.log").read_text() or how == "mute"
    d.kill()
    assert gone(d.pid) and gone(server)
    if held:
        held.close()
    again = Daemon(d.pipe.parent.parent, script=d.script)
    again.control("set_default_device_pinned_mem_limit 0 4G")
    assert cuda_client(again.pipe / "control") == 4096
    again.kill()


# --- nvidia-container-runtime ----------------------------------------------------------------

@pytest.fixture
def runtime():
    return load("nvidia_container_runtime_standin", HERE / "nvidia_container_runtime.py")


@pytest.mark.parametrize("toml, names", [
    ('swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n[nvidia-container-runtime]\n', ["DOCKER_RESOURCE_NVIDIA-GPU"]),
    ('swarm-resource = "A,B"  # two\n', ["A", "B"]),
    ('#swarm-resource = "DOCKER_RESOURCE_GPU"\n', []),
    ('[nvidia-container-runtime]\nswarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n', []),  # ignored there (FACTS)
])
def test_swarm_resource_is_read_only_at_the_top_level(runtime, toml, names):
    assert runtime.swarm_resource_names(toml) == names


@pytest.mark.parametrize("env, chosen", [
    (["NVIDIA_VISIBLE_DEVICES=all", f"DOCKER_RESOURCE_NVIDIA-GPU={UUIDS[1]}"], [UUIDS[1]]),  # swarm's wins
    (["NVIDIA_VISIBLE_DEVICES=all"], UUIDS[:2]),
    ([f"NVIDIA_VISIBLE_DEVICES={UUIDS[0]},{UUIDS[1]}"], UUIDS[:2]),
    (["NVIDIA_VISIBLE_DEVICES=1"], [UUIDS[1]]),
    (["NVIDIA_VISIBLE_DEVICES=void"], []),
    (["NVIDIA_VISIBLE_DEVICES=none"], []),
    (["NVIDIA_VISIBLE_DEVICES="], []),
    ([], []),
])
def test_a_container_gets_the_gpus_the_toolkit_would_give_it(runtime, env, chosen):
    value = runtime.requested(env, ["DOCKER_RESOURCE_NVIDIA-GPU"])
    present = hardware.present(hardware.describe(gpus()))
    assert [g["uuid"] for g in runtime.select(value, present)] == chosen


def test_an_unknown_gpu_stops_the_container(runtime):
    with pytest.raises(runtime.DeviceError, match=f"{UUIDS[2]}: unknown device"):
        runtime.select(UUIDS[2], hardware.present(hardware.describe(gpus())))


def _bundle(folder: Path, env: list[str]) -> Path:
    bundle = folder / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": env}, "mounts": [
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}]}))
    return bundle


def test_create_mounts_devices_and_nvidia_smi_then_runs_runc_with_the_same_call(machine):
    (machine / "config.toml").write_text('swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n')
    bundle = _bundle(machine, ["NVIDIA_VISIBLE_DEVICES=all", f"DOCKER_RESOURCE_NVIDIA-GPU={UUIDS[1]}"])
    fake = machine / "bin"
    fake.mkdir()
    (fake / "runc").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >"{machine}/runc-args"\n')
    (fake / "runc").chmod(0o755)
    (fake / "python3").symlink_to(sys.executable)  # the sh front runs `python3 -I` on create
    args = ["--root", "/run/x", "--log", str(machine / "log.json"), "--log-format", "json", "create",
            "--bundle", str(bundle), "--pid-file", "/run/x/pid", "cid"]
    env = {**os.environ, "PATH": f"{fake}:/usr/bin:/bin"}
    done = subprocess.run([str(HERE / "nvidia-container-runtime"), *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (machine / "runc-args").read_text().splitlines() == args
    mounts = json.loads((bundle / "config.json").read_text())["mounts"]
    assert [m["destination"] for m in mounts] == ["/dev", "/usr/bin/nvidia-smi", "/dev/nvidia1"]
    assert "ro" in mounts[1]["options"] and mounts[2]["source"] == "/dev/null"
    listed = subprocess.run(["sh", mounts[1]["source"], "-L"], capture_output=True, text=True).stdout
    assert listed == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {UUIDS[1]})\n"
    # Every other call goes to runc untouched, without Python.
    subprocess.run([str(HERE / "nvidia-container-runtime"), "--root", "/run/x", "start", "cid"], env=env, check=True)
    assert (machine / "runc-args").read_text().splitlines() == ["--root", "/run/x", "start", "cid"]


def _image_lib(folder: Path) -> Path:
    """The stand-ins' folder as the image has it: only what image_files() puts under LIB."""
    lib = folder / "lib"
    for path, (data, mode) in standins.image_files().items():
        if path.startswith(standins.LIB + "/"):
            target = lib / path[len(standins.LIB) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode)
    return lib


@pytest.mark.parametrize("where", ["checkout", "image"])
def test_create_refusal_is_written_where_containerd_reads_it(machine, where):
    """Read with the guard's helpers (node/gpu_guard.py): in the image they are installed beside the stand-in."""
    bundle = _bundle(machine, [f"NVIDIA_VISIBLE_DEVICES={UUIDS[2]}"])
    log = machine / "log.json"
    folder = HERE if where == "checkout" else _image_lib(machine)
    done = subprocess.run([sys.executable, "-I", str(folder / "nvidia_container_runtime.py"), "--log", str(log),
                           "--log-format", "json", "create", "--bundle", str(bundle), "cid"],
                          capture_output=True, text=True)
    assert done.stderr.strip() == f"nvidia-container-cli: device error: {UUIDS[2]}: unknown device"
    assert done.returncode == 1
    assert json.loads(log.read_text())["msg"] == f"nvidia-container-cli: device error: {UUIDS[2]}: unknown device"


# --- nvidia-ctk and the fabric manager ------------------------------------------------------------

def ctk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "nvidia-ctk"), *args], capture_output=True, text=True)


def test_nvidia_ctk_says_the_pinned_version_as_node_common_sh_parses_it():
    """The rehearsal's nodes then keep their toolkit, as a node whose image has the pinned one does."""
    from to_node.software import min_versions
    out = ctk("--version").stdout
    assert out.splitlines()[0] == f"NVIDIA Container Toolkit CLI version {min_versions()['TOOLKIT_VERSION']}"


def test_nvidia_ctk_registers_the_runtime_and_keeps_other_keys(tmp_path):
    daemon = tmp_path / "daemon.json"
    daemon.write_text(json.dumps({"registry-mirrors": ["http://m"], "runtimes": {"other": {"path": "x"}}}))
    assert ctk("runtime", "configure", "--runtime=docker", f"--config={daemon}").returncode == 0
    config = json.loads(daemon.read_text())
    assert config == {"registry-mirrors": ["http://m"], "runtimes": {
        "other": {"path": "x"}, "nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
    assert '"nvidia": {' in daemon.read_text()  # what install-container-toolkit.sh greps for
    assert ctk("runtime", "configure", "--runtime=docker", "--set-as-default", "--config", str(daemon)).returncode == 0
    assert json.loads(daemon.read_text())["default-runtime"] == "nvidia"
    assert ctk("runtime", "configure", "--runtime=containerd").returncode == 1


def test_nvidia_ctk_sets_a_top_level_toolkit_key(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text((HERE / "config.toml").read_text())
    assert ctk("config", "--in-place", "--set", "swarm-resource=DOCKER_RESOURCE_NVIDIA-GPU",
               f"--config={config}").returncode == 0
    runtime = load("ncr", HERE / "nvidia_container_runtime.py")
    assert runtime.swarm_resource_names(config.read_text()) == ["DOCKER_RESOURCE_NVIDIA-GPU"]
    assert "[nvidia-container-runtime]" in config.read_text()


def test_fabric_manager_stays_up_until_told_to_stop():
    proc = subprocess.Popen([str(HERE / "nv-fabricmanager")])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.3)
        proc.terminate()
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()


# --- NVML: the pynvml stand-in on a hardware file -------------------------------------------------

@pytest.fixture
def nvml(machine, monkeypatch):
    module = load("pynvml_on_hardware_file", HERE / "pynvml.py")
    monkeypatch.setattr(module, "FAULT_REPEAT_S", 0.3)
    module.nvmlInit()
    yield module
    module.nvmlShutdown()


def test_nvml_enumerates_the_hardware_file(nvml):
    assert nvml.nvmlDeviceGetCount() == 2
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetUUID(handle) == UUIDS[1]
    assert nvml.nvmlDeviceGetMemoryInfo(handle).total == 81559 * 1024 * 1024
    assert nvml.nvmlSystemGetDriverVersion() == "580.159.04"


def test_nvml_without_a_hardware_file_is_a_machine_without_the_driver(machine, monkeypatch):
    monkeypatch.setenv("GPU_SWARM_REHEARSAL_HARDWARE", str(machine / "absent.json"))
    module = load("pynvml_no_driver", HERE / "pynvml.py")
    with pytest.raises(module.NVMLError_LibraryNotFound):
        module.nvmlInit()


def test_a_fault_written_into_the_file_reaches_a_waiting_event_set(nvml, machine):
    events = nvml.nvmlEventSetCreate()
    for n in range(2):
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(n), 0xB, events)
    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(events, 100)
    fault(machine / "hardware.json", 1, {"xid": 79})
    data = nvml.nvmlEventSetWait_v2(events, 2000)
    assert (nvml.nvmlDeviceGetUUID(data.device), data.eventType, data.eventData) == (UUIDS[1], 0x8, 79)
    with pytest.raises(nvml.NVMLError_Timeout):  # a failing GPU raises it again, but not at once
        nvml.nvmlEventSetWait_v2(events, 100)
    assert nvml.nvmlEventSetWait_v2(events, 2000).eventData == 79
    fault(machine / "hardware.json", 1, {"ecc": "double"})
    assert nvml.nvmlEventSetWait_v2(events, 2000).eventType == 0x2
    fault(machine / "hardware.json", 1, None)
    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(events, 500)


def test_missing_and_retirement_faults_change_what_nvml_answers(nvml, machine):
    fault(machine / "hardware.json", 0, {"pending_retirement": True})
    handle = nvml.nvmlDeviceGetHandleByUUID(UUIDS[0])
    assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED
    fault(machine / "hardware.json", 0, {"missing": True})
    assert nvml.nvmlDeviceGetCount() == 1
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID(UUIDS[0])
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMemoryInfo(handle)


def test_nvml_wheel_installs_as_nvidia_ml_py_at_the_pin(tmp_path):
    name, data = standins.nvml_wheel()
    assert name == f"nvidia_ml_py-{standins.nvml_version()}-py3-none-any.whl"
    assert standins.nvml_wheel()[1] == data  # the same bytes every time: the image's hash is stable
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / name).write_bytes(data)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                           str(tmp_path / "wheels"), "--target", str(tmp_path / "site"), "--disable-pip-version-check",
                           f"nvidia-ml-py=={standins.nvml_version()}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "pynvml.py").read_bytes() == (HERE / "pynvml.py").read_bytes()
    with zipfile.ZipFile(tmp_path / "wheels" / name) as whl:
        assert "pynvml.py" in whl.namelist()
