"""Sharing GPUs by MPS and spreading slots: the settings, the agent, the node's MPS daemons, the watcher.

The guard's side (mounts, limits, the daemon check) is in test_gpu_guard*.py; the rehearsal's
in test_sharing_rehearsal.py. Here the MPS daemons' script runs in real bash with a fake
nvidia-cuda-mps-control and nvidia-smi on PATH; the agent and the watcher run as on a node.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from to_node import software as node_software
from settings import SettingsError, load_settings
from swarm.node_contract import (GUARD_LEDGER_PATH, GUARD_PATH, MPS_DIR, MPS_UNIT, RUNTIME_ENV_PATH,
                                 SHARING_MODE_ENV)
from tests.conftest import stack_config, use_mocks
from tests.test_gpu_agent import Node as AgentNode, agent, inventory_gpu, uuid
from tests.test_gpu_health import Node as WatcherNode
from tests.rehearsal_tools import until
from tests.test_shell_scripts import Node as ShellNode
from tests.tools import require_tool

REPO = Path(__file__).resolve().parent.parent
T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}


def pools(*entries):
    return list(entries)

sys.path.insert(0, str(REPO / "node"))
import gpu_resources  # noqa: E402
import health_mps  # noqa: E402


# ---------------------------------------------------------------- settings


def test_a_pool_shares_by_mps_when_it_says_so():
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "sharing": {"slotsPerGpu": 4, "mode": "mps"}}), stacks=[]))
    (pool,) = load_settings().gpu_pools
    assert (pool.slots_per_gpu, pool.sharing_mode) == (4, "mps")
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "sharing": {"slotsPerGpu": 4}}), stacks=[]))
    assert load_settings().gpu_pools[0].sharing_mode == "time-slicing"


@pytest.mark.parametrize("sharing, message", [
    ({"slotsPerGpu": 4, "mode": "MPS"}, "gpu-swarm:gpuPools[0].sharing.mode: 'MPS' is not a sharing mode; use "
                                        "time-slicing"),
    ({"slotsPerGpu": 4, "mode": "mig"}, "gpu-swarm:gpuPools[0].sharing.mode: 'mig' is not a sharing mode"),
    ({"mode": "mps"}, "gpu-swarm:gpuPools[0].sharing.slotsPerGpu: required"),
    ({"slotsPerGpu": 1, "mode": "mps"}, "gpu-swarm:gpuPools[0].sharing.slotsPerGpu: 1 is out of range"),
    ({"mode": "mps", "slots": [{"memoryMiB": 40960, "count": 1}, {"memoryMiB": 10240, "count": 4}]},
     "gpu-swarm:gpuPools[0].sharing.slots: slots of different sizes on one GPU are not offered: MPS (driver r580) "
     "holds one memory ceiling for all of a GPU's tasks"),
    ({"slotsPerGpu": 4, "moed": "mps"}, "gpu-swarm:gpuPools[0].sharing.moed: is not a sharing setting; did you "
                                        "mean mode?"),
])
def test_a_bad_sharing_setting_is_refused_at_preview_naming_its_key(sharing, message):
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "sharing": sharing}), stacks=[]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert message in str(err.value)


def test_only_an_mps_pool_has_the_mode_in_its_node_env():
    """node.env changes roll a node: time-slicing pools keep the file they had."""
    env = dict(gpu=True, gpu_kind="NVIDIA-GPU", instance_type="g6e.12xlarge", image="ubuntu", slots_per_gpu=4,
               shared_kind="NVIDIA-GPU-SHARED")
    assert SHARING_MODE_ENV not in node_software.node_env(**env)
    assert node_software.node_env(**env, sharing_mode="mps")[SHARING_MODE_ENV] == "mps"
    assert SHARING_MODE_ENV not in node_software.node_env(**{**env, "slots_per_gpu": 0}, sharing_mode="mps")


def test_the_program_boots_an_mps_pool_with_the_mode_and_its_step():
    """What a node of each pool boots with (its user data): only the MPS pool's node.env names the mode."""
    from tests.conftest import request_inputs, run_program, unwrap
    config = stack_config("dev", stacks=[], gpuPools=pools(
        {**T4, "name": "mps", "sharing": {"slotsPerGpu": 4, "mode": "mps"}},
        {**T4, "name": "sliced", "sharing": {"slotsPerGpu": 4}}))
    run = run_program(config, stack="dev")
    user_data = {}
    for request in run.monitor.requests.values():
        if request.type == "aws:ec2/instance:Instance":
            inputs = request_inputs(request)
            user_data[inputs["tags"]["gpu-swarm:pool"]] = unwrap(inputs["userData"])
    assert f"{SHARING_MODE_ENV}=mps" in user_data["mps"] and SHARING_MODE_ENV not in user_data["sliced"]
    for pool in ("mps", "sliced"):  # every GPU node has the step: it removes the unit where MPS is off
        steps = re.search(r'GPU_SWARM_STEPS="([^"]+)"', user_data[pool])[1].split()
        # Before the agent, which checks the compute mode the MPS unit sets.
        assert steps.index("install-container-toolkit") < steps.index("install-mps") < steps.index("install-gpu-agent")


# ---------------------------------------------------------------- spreading: the order of the slots


def swarmkit_places(advertised: list[str], replicas: int) -> list[str]:
    """What swarmkit's scheduler hands `replicas` one-slot tasks on one node: each takes the first
    free entry in the node's order (selectNodeResources), the free list rebuilt in that order."""
    free, taken = list(advertised), []
    for _ in range(replicas):
        taken.append(free.pop(0).split("=", 1)[1])
    return taken


@pytest.mark.parametrize("gpus, slots, replicas", [(4, 4, 4), (4, 4, 6), (2, 8, 2), (8, 2, 8), (3, 4, 12)])
def test_slots_are_advertised_so_that_tasks_spread_over_the_gpus_first(gpus, slots, replicas):
    entries = gpu_resources.slot_entries("K", [uuid(n) for n in range(gpus)], slots)
    per_gpu = {}
    for slot in swarmkit_places(entries, replicas):
        per_gpu[gpu_resources.slot_gpu(slot)] = per_gpu.get(gpu_resources.slot_gpu(slot), 0) + 1
    assert len(per_gpu) == min(gpus, replicas) and max(per_gpu.values()) - min(per_gpu.values()) <= 1
    assert sorted(entries) == sorted(f"K={uuid(n)}-s{k}" for n in range(gpus) for k in range(slots))


# ---------------------------------------------------------------- the agent on an MPS pool


@pytest.fixture
def node(tmp_path, monkeypatch):
    return AgentNode(tmp_path, monkeypatch)


def runtime_env(node) -> dict:
    return dict(line.split("=", 1) for line in node.runtime_config.read_text().splitlines()
                if line and not line.startswith("#"))


def test_an_mps_pool_advertises_slots_of_exclusive_process_gpus_and_tells_the_guard_the_limits(node, capsys):
    gpus = [inventory_gpu(0, compute_mode=3, memory_mib=81559), inventory_gpu(1, compute_mode=3, memory_mib=81559)]
    rc, report, _ = node.run(capsys, "--inventory", node.inventory(gpus), "--slots-per-gpu", "4",
                             "--sharing-mode", "mps", "--mps-dir", "/run/x/mps", "--guard-ledger", "/run/x/claims")
    assert rc == 0 and len(report["resources"]) == 8
    assert report["labels"]["gpu.sharing"] == "mps" and report["labels"]["gpu.replicas"] == "4"
    env = runtime_env(node)
    assert (env["SHARING"], env["MPS_DIR"], env["LEDGER"]) == ("mps", "/run/x/mps", "/run/x/claims")
    assert env["MPS_MEMORY_MIB"] == str((81559 - 1024) // 4) and env["MPS_THREAD_PERCENT"] == "25"


def test_the_guards_share_is_the_ceiling_gpu_swarm_mps_gives_the_daemons(mps_node):
    """One rule: what the guard tells a task is what its GPU's daemon holds it to (the node's smallest GPU)."""
    text = agent.runtime_settings(kind="NVIDIA-GPU", shared_kind="NVIDIA-GPU-SHARED", slots=4,
                                  guard="/s/gpu-swarm-runtime",
                                  gpus=[{"uuid": A, "memory_mib": 81559}, {"uuid": B, "memory_mib": 46068}],
                                  delegate="/usr/bin/nvidia-container-runtime", allow_docker_run_gpus=True, mode="mps")
    env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    done = mps(mps_node, "start")  # its nvidia-smi: the same two GPUs, of 81559 and 46068 MiB
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"each client at most {env['MPS_MEMORY_MIB']} MiB and {env['MPS_THREAD_PERCENT']} %") == 2


@pytest.mark.parametrize("mode", [0, None])  # Default, or NVML could not say
def test_an_mps_pool_refuses_a_gpu_that_is_not_exclusive_process(node, capsys, mode):
    gpus = [inventory_gpu(0, compute_mode=3), inventory_gpu(1, **({} if mode is None else {"compute_mode": mode}))]
    rc, report, _ = node.run(capsys, "--inventory", node.inventory(gpus), "--slots-per-gpu", "2",
                             "--sharing-mode", "mps")
    assert rc == 0 and report["resources"] == [f"NVIDIA-GPU-SHARED={uuid(0)}-s0", f"NVIDIA-GPU-SHARED={uuid(0)}-s1"]
    assert report["labels"]["gpu.sharing"] == "refused-compute-mode"
    assert any(f"GPU {uuid(1)} is in compute mode {mode}, not Exclusive_Process" in w and
               "systemctl restart gpu-swarm-mps" in w for w in report["warnings"])


def test_a_time_slicing_pool_writes_no_mps_settings_but_a_ledger(node, capsys):
    rc, _, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), "--slots-per-gpu", "2")
    env = runtime_env(node)
    assert rc == 0 and "SHARING" not in env and "MPS_DIR" not in env and env["LEDGER"] == GUARD_LEDGER_PATH


def test_a_bad_sharing_mode_writes_nothing(node, capsys):
    rc, _, err = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), "--slots-per-gpu", "2",
                          "--sharing-mode", "mig")
    assert rc == 2 and "--sharing-mode 'mig'" in err and not node.daemon_json.exists()


def test_the_sharing_mode_comes_from_node_env(node):
    env = {"PATH": str(node.bin), "PYTHONPATH": str(REPO / "node"), "GPU_SWARM_SLOTS_PER_GPU": "2",
           SHARING_MODE_ENV: "mps"}
    done = subprocess.run([sys.executable, str(REPO / "node" / "gpu_agent.py"), *node.paths(), "--json",
                           "--inventory", node.inventory([inventory_gpu(0, compute_mode=3)]), "--toolkit-version",
                           "1.19.0"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["labels"]["gpu.sharing"] == "mps" and runtime_env(node)["SHARING"] == "mps"


def test_on_a_node_the_runtime_is_called_without_a_wrapper():
    """runtimeArgs make dockerd run the runtime through a /bin/sh script of its own, on every call."""
    warnings = []
    on_node = agent.merge_daemon_config({}, ["K=x"], {}, {"path": GUARD_PATH, "config": RUNTIME_ENV_PATH}, warnings)
    assert on_node["runtimes"]["gpu-swarm"] == {"path": GUARD_PATH}
    elsewhere = agent.merge_daemon_config({}, ["K=x"], {}, {"path": GUARD_PATH, "config": "/r/runtime.env"}, warnings)
    assert elsewhere["runtimes"]["gpu-swarm"]["runtimeArgs"] == ["--gpu-swarm-config", "/r/runtime.env"]


# ---------------------------------------------------------------- the node's MPS daemons

A, B = uuid(10), uuid(11)
FAKE_MPS = """
if [ "${1:-}" = -d ]; then  # the control daemon: this script again, in the background, under its name
  echo "daemon gpu=$CUDA_VISIBLE_DEVICES pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >>"$FAKE_CALLS"
  [ -z "${FAKE_MPS_BROKEN:-}" ] || exit 0
  "$0" --run </dev/null >/dev/null 2>&1 &
  echo $! >"$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  exit 0
fi
if [ "${1:-}" = --run ]; then while :; do sleep 0.1; done; fi
read -r command
echo "command $command pipe=$CUDA_MPS_PIPE_DIRECTORY" >>"$FAKE_CALLS"
if [ "$command" = quit ] && [ -n "${FAKE_MPS_STUCK:-}" ]; then sleep 3600; fi  # a stuck server: quit never returns
if [ "$command" = quit ]; then kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"; fi
"""
FAKE_SMI = f"""
case "$*" in
--query-gpu=uuid,memory.total*) printf '%s, %s\\n' {A} 81559 {B} 46068 ;;
*--query-gpu=compute_mode*) echo "${{FAKE_FOUND_MODE:-Default}}" ;;
esac
"""


@pytest.fixture
def mps_node(tmp_path):
    made = ShellNode(tmp_path)
    # #!/bin/bash, not Node.fake's /usr/bin/env: env's exec of bash would rename the process "bash".
    made.write(made.bin / "nvidia-cuda-mps-control", "#!/bin/bash\n" + FAKE_MPS)
    made.fake("nvidia-smi", FAKE_SMI)
    made.env["GPU_SWARM_MPS_DIR"] = str(tmp_path / "mps")
    made.env["GPU_SWARM_SLOTS_PER_GPU"] = "4"  # node.env, which the unit loads
    yield made
    subprocess.run(["bash", str(REPO / "node" / "gpu-swarm-mps"), "stop"], env=made.env, capture_output=True)


def mps(node: ShellNode, action: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "node" / "gpu-swarm-mps"), action], env={**node.env, **env},
                          capture_output=True, text=True, timeout=60)


def daemon_pid(node: ShellNode, gpu: str) -> int:
    return int((node.root / "mps" / gpu / "daemon.pid").read_text())


def test_each_gpu_gets_its_own_exclusive_daemon_with_a_slots_ceilings_and_a_server_for_root(mps_node):
    done = mps(mps_node, "start")
    assert done.returncode == 0, done.stderr
    calls = mps_node.called()
    # The node's smallest GPU (46068 MiB) sets the share, as the agent tells the guard.
    ceiling, threads = gpu_resources.mps_daemon_limits([81559, 46068], 4)
    assert (ceiling, threads) == ((46068 - 1024) // 4, 25)
    for gpu in (A, B):
        pipe, log = mps_node.root / "mps" / gpu / "pipe", mps_node.root / "mps" / gpu / "log"
        assert stat.S_IMODE(pipe.stat().st_mode) == 0o700 and log.is_dir()
        # the daemon's files are in its own mount namespace: outside it, its pipe folder is empty
        assert list(pipe.iterdir()) == [] and (mps_node.root / "mps" / gpu / "namespace").read_text().startswith("mnt:")
        assert (Path(f"/proc/{daemon_pid(mps_node, gpu)}/root") / str(pipe).lstrip("/") /
                "nvidia-cuda-mps-control.pid").exists()
        # the mode first, then the daemon on that GPU alone, its ceilings, and only then its server:
        # a server keeps the defaults it started with, and no client can raise them
        order = [calls.index(f"nvidia-smi -i {gpu} -c EXCLUSIVE_PROCESS"),
                 calls.index(f"daemon gpu={gpu} pipe={pipe} log={log}"),
                 calls.index(f"command set_default_device_pinned_mem_limit 0 {ceiling}M pipe={pipe}"),
                 calls.index(f"command set_default_active_thread_percentage {threads} pipe={pipe}"),
                 calls.index(f"command start_server -uid 0 pipe={pipe}")]
        assert order == sorted(order)
        assert f"{gpu}: MPS daemon and server started ({pipe}, in the daemon's own mount namespace), each client " \
            f"at most {ceiling} MiB" in done.stdout
        assert Path(f"/proc/{daemon_pid(mps_node, gpu)}/comm").read_text().startswith("nvidia-cuda-mps")
    # then the relay, the only way a slot task reaches a daemon: a socket per GPU, where the guard mounts it
    assert "MPS relay started" in done.stdout
    assert all(stat.S_ISSOCK((mps_node.root / "mps" / gpu / "tasks" / "control").stat().st_mode) for gpu in (A, B))
    again = mps(mps_node, "start")  # a restart of the unit's start finds them running
    assert again.returncode == 0 and again.stdout.count("already running") == 2 and "MPS relay: running" in again.stdout


def test_stop_quits_every_daemon_and_gives_the_gpus_back_in_default_mode(mps_node):
    assert mps(mps_node, "start").returncode == 0
    import guard_files
    mps_dir = str(mps_node.root / "mps")
    assert all(guard_files.mps_daemon_alive(mps_dir, gpu) for gpu in (A, B)) and guard_files.mps_relay_alive(mps_dir)
    done = mps(mps_node, "stop")
    assert done.returncode == 0, done.stderr
    assert not any(guard_files.mps_daemon_alive(mps_dir, gpu) for gpu in (A, B))
    assert not guard_files.mps_relay_alive(mps_dir) and "MPS relay stopped" in done.stdout
    assert not list((mps_node.root / "mps").glob("*/tasks/control"))
    assert mps_node.called()[-2:] == [f"nvidia-smi -i {A} -c DEFAULT", f"nvidia-smi -i {B} -c DEFAULT"]


def test_stop_gives_each_gpu_back_the_compute_mode_start_found(mps_node):
    assert mps(mps_node, "start", FAKE_FOUND_MODE="Exclusive_Process").returncode == 0
    assert mps(mps_node, "start", FAKE_FOUND_MODE="Default").returncode == 0  # noted once: not what start set
    assert mps(mps_node, "stop").returncode == 0
    assert mps_node.called()[-2:] == [f"nvidia-smi -i {A} -c EXCLUSIVE_PROCESS", f"nvidia-smi -i {B} -c EXCLUSIVE_PROCESS"]


def test_stop_kills_a_daemon_that_never_quits_and_still_gives_the_gpus_back(mps_node):
    """A stuck server never lets `quit` return (measured on an H200: stop hung for 90 s, mode never restored)."""
    assert mps(mps_node, "start").returncode == 0
    daemons = [daemon_pid(mps_node, gpu) for gpu in (A, B)]
    done = mps(mps_node, "stop", FAKE_MPS_STUCK="1", GPU_SWARM_MPS_QUIT_S="1")
    assert done.returncode == 0, done.stderr
    assert f"{A}: the MPS daemon (pid {daemons[0]}) did not quit within 1 s" in done.stdout
    assert f"{A}: killed what was left of its MPS daemon's namespace" in done.stdout
    assert all(not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text() for pid in daemons)
    assert mps_node.called()[-2:] == [f"nvidia-smi -i {A} -c DEFAULT", f"nvidia-smi -i {B} -c DEFAULT"]


def test_stop_kills_nothing_of_a_namespace_whose_number_the_kernel_gave_again(mps_node):
    """A freed mount namespace's number is given to the next new one at once. GPU A's daemon gone, its noted
    mnt:[N] can be another process's namespace (another GPU's new daemon, on a node): stop kills none of it."""
    assert mps(mps_node, "start").returncode == 0
    assert mps(mps_node, "stop").returncode == 0
    other = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "600"])
    try:
        until(lambda: os.readlink(f"/proc/{other.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"), 10,
              "the other process's own namespace", interval=0.05)
        folder = Path(mps_node.env["GPU_SWARM_MPS_DIR"]) / A
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "namespace").write_text(os.readlink(f"/proc/{other.pid}/ns/mnt") + "\n")  # as if reused
        done = mps(mps_node, "stop", GPU_SWARM_MPS_QUIT_S="1")
        assert done.returncode == 0, done.stderr
        assert other.poll() is None, "stop killed a process of another namespace that had the same number"
        assert "killed what was left" not in done.stdout
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("slots", ["", "0", "1"])
def test_without_a_slots_share_no_daemon_starts(mps_node, slots):
    """No ceiling, no server: a server without one would let every client take the whole GPU."""
    done = mps(mps_node, "start", GPU_SWARM_SLOTS_PER_GPU=slots)
    assert done.returncode == 1 and "no MPS server starts" in done.stderr
    assert f"GPU_SWARM_SLOTS_PER_GPU={slots} in /etc/gpu-swarm/node.env" in done.stderr
    assert not any(c.startswith("daemon ") for c in mps_node.called())


def test_a_daemon_that_does_not_start_fails_the_unit(mps_node):
    done = mps(mps_node, "start", FAKE_MPS_BROKEN="1", GPU_SWARM_MPS_WAIT_S="1")
    assert done.returncode == 1 and f"{A}: the MPS control daemon did not start" in done.stderr


def test_the_scripts_default_is_the_contracts():
    assert "mps_dir=${GPU_SWARM_MPS_DIR:-" + MPS_DIR + "}" in (REPO / "node" / "gpu-swarm-mps").read_text()
    unit = (REPO / "node" / MPS_UNIT).read_text()
    assert "Before=gpu-swarm-agent.service docker.service" in unit and "/opt/gpu-swarm/software/gpu-swarm-mps" in unit


@pytest.fixture
def standin_node(tmp_path):
    """gpu-swarm-mps with the stand-in daemon and server (localswarm/standins) and the real relay."""
    import shutil
    import tempfile
    from tests import mps_standin
    made = ShellNode(tmp_path)
    mps_standin.install(made.bin)
    made.fake("nvidia-smi", FAKE_SMI)
    mps_dir = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))  # its sockets' paths under 108 bytes
    made.env.update(GPU_SWARM_MPS_DIR=str(mps_dir), GPU_SWARM_SLOTS_PER_GPU="4", GPU_SWARM_PYTHON=sys.executable)
    made.mps_dir = mps_dir
    yield made
    subprocess.run(["bash", str(REPO / "node" / "gpu-swarm-mps"), "stop"], env={**made.env, "GPU_SWARM_MPS_QUIT_S": "1"},
                   capture_output=True)
    shutil.rmtree(mps_dir, ignore_errors=True)


def test_no_process_outside_a_daemons_namespace_finds_its_sockets_and_clients_pass_through_the_relay(standin_node):
    """Container root has CAP_DAC_OVERRIDE: no file mode keeps it from a socket it can name. The pipe folder is
    a tmpfs in the daemon's own mount namespace, which no bind of any host path reaches."""
    from tests import mps_standin
    done = mps(standin_node, "start")
    assert done.returncode == 0, done.stderr + done.stdout
    ceiling, _ = gpu_resources.mps_daemon_limits([81559, 46068], 4)
    for gpu in (A, B):
        folder = standin_node.mps_dir / gpu
        assert list((folder / "pipe").iterdir()) == []  # what any host path, so any container's mount, shows
        pid = int((folder / "daemon.pid").read_text())
        inside = Path(f"/proc/{pid}/root") / str(folder / "pipe").lstrip("/")
        assert stat.S_ISSOCK((inside / "control_privileged").stat().st_mode)  # there, for the node's root only
        assert mps_standin.cuda_client(folder / "tasks" / "control") == ceiling  # through the relay
    # a process in a mount namespace of its own that binds the whole host tree (as `-v /:/host` would): nothing
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mkdir -p /tmp/host-view-$$ && mount --rbind / /tmp/host-view-$$ && "
                            f"ls -A /tmp/host-view-$${standin_node.mps_dir}/{A}/pipe; echo listed"],
                           capture_output=True, text=True, timeout=30)
    assert probe.stdout == "listed\n", probe.stdout + probe.stderr


def test_a_client_that_comes_while_a_daemon_is_started_again_never_gets_a_server_without_its_ceiling(standin_node):
    """A daemon starts a server for the first client it sees, with the defaults it has then. The watchdog starts
    daemons again while the relay runs, so the relay must not pass a client before the ceilings are set."""
    import threading
    from tests import mps_standin
    assert mps(standin_node, "start").returncode == 0
    ceiling, _ = gpu_resources.mps_daemon_limits([81559, 46068], 4)
    folder = standin_node.mps_dir / A
    stop, got = threading.Event(), []

    def clients():
        while not stop.is_set():
            try:
                got.append(mps_standin.cuda_client(folder / "tasks" / "control", timeout=2))
            except (OSError, AssertionError):
                time.sleep(0.01)
    threading.Thread(target=clients, daemon=True).start()
    try:
        for _ in range(3):  # what the watchdog does: everything in the namespace killed, then start
            import health_mps
            health_mps.kill_namespace(str(folder))
            assert mps(standin_node, "start").returncode == 0
            time.sleep(0.5)
    finally:
        stop.set()
    daemon = int((folder / "daemon.pid").read_text())
    (server,) = mps_standin.children(daemon)
    inside = subprocess.run(["nsenter", "--target", str(daemon), "--mount", "--", str(standin_node.bin /
                            "nvidia-cuda-mps-control")], input=f"get_device_pinned_mem_limit {server} 0\n",
                            capture_output=True, text=True, timeout=10,
                            env={**standin_node.env, "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe")})
    assert inside.stdout.strip() == f"{ceiling}M"
    assert got and set(got) == {ceiling}, sorted(set(got))


def test_stop_ends_a_daemon_stuck_behind_a_stalled_server_and_gives_the_gpus_back(standin_node):
    """A client that drops its server descriptor stalls the server; `quit` then never returns (H200, 90 s)."""
    from tests import mps_standin
    assert mps(standin_node, "start").returncode == 0
    folder = standin_node.mps_dir / A
    daemon = int((folder / "daemon.pid").read_text())
    servers = mps_standin.children(daemon)
    mps_standin.cuda_client(folder / "tasks" / "control", drop=True)
    done = mps(standin_node, "stop", GPU_SWARM_MPS_QUIT_S="2")
    assert done.returncode == 0, done.stderr
    assert f"{A}: the MPS daemon (pid {daemon}) did not quit within 2 s" in done.stdout
    assert f"{B}: MPS daemon stopped" in done.stdout
    assert all(mps_standin.gone(pid, 1) for pid in [daemon, *servers])
    assert standin_node.called()[-2:] == [f"nvidia-smi -i {A} -c DEFAULT", f"nvidia-smi -i {B} -c DEFAULT"]


def test_the_units_descriptor_limit_holds_the_relays_connections_and_a_reload_starts_what_is_missing():
    """600 idle connections exhausted the default 1024; the watchdog restarts a daemon with a reload, in this
    unit's cgroup (a start from the watcher's own would die with the watcher)."""
    sys.path.insert(0, str(REPO / "node"))
    import health_mps
    import mps_relay
    from contract import MPS_RELAY_MAX_CONNECTIONS
    unit = (REPO / "node" / MPS_UNIT).read_text()
    assert int(re.search(r"^LimitNOFILE=(\d+)$", unit, re.M)[1]) >= MPS_RELAY_MAX_CONNECTIONS + mps_relay.RESERVE_FDS
    assert "ExecReload=/bin/bash /opt/gpu-swarm/software/gpu-swarm-mps start" in unit
    assert health_mps.RESTART == ("systemctl", "reload", MPS_UNIT)


@pytest.fixture
def step_node(tmp_path):
    made = ShellNode(tmp_path)
    made.real_step("install-mps")
    made.fake("systemctl", "")
    made.fake("nvidia-cuda-mps-control", "")
    return made


def test_the_step_installs_the_unit_on_an_mps_pool(step_node):
    step_node.node_env.write_text(f"{SHARING_MODE_ENV}=mps\n")
    done = step_node.bootstrap("install-mps")
    assert done.returncode == 0, step_node.log.read_text()
    assert (step_node.root / "units" / MPS_UNIT).read_text() == (REPO / "node" / MPS_UNIT).read_text()
    assert f"systemctl restart {MPS_UNIT}" in step_node.called()


def test_the_step_removes_the_unit_when_the_pool_stops_sharing_by_mps(step_node):
    (step_node.root / "units" / MPS_UNIT).write_text("old")
    assert step_node.bootstrap("install-mps").returncode == 0
    assert not (step_node.root / "units" / MPS_UNIT).exists()
    assert f"systemctl disable --now {MPS_UNIT}" in step_node.called()
    assert step_node.bootstrap("install-mps").returncode == 0 and step_node.statuses() == {"install-mps": "skipped"}


# ---------------------------------------------------------------- the watcher


def test_a_dead_mps_daemon_makes_its_gpu_unhealthy(tmp_path):
    watcher = WatcherNode(tmp_path)
    watcher.write_daemon({"node-generic-resources": [f"NVIDIA-GPU-SHARED={uuid(n)}-s{k}" for k in range(2)
                                                     for n in range(2)]})
    mps_dir = tmp_path / "mps"
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_bytes(Path("/bin/sleep").read_bytes())
    binary.chmod(0o755)
    daemons = []
    for n in range(2):
        (mps_dir / uuid(n) / "pipe").mkdir(parents=True)
        daemons.append(subprocess.Popen([str(binary), "600"]))
        (mps_dir / uuid(n) / "daemon.pid").write_text(f"{daemons[-1].pid}\n")
    relay = tmp_path / "mps_relay"  # named as node/mps_relay.py runs, its pid file where it writes it
    relay.write_bytes(Path("/bin/sleep").read_bytes())
    relay.chmod(0o755)
    daemons.append(subprocess.Popen([str(relay), "600"]))
    (mps_dir / "relay.pid").write_text(f"{daemons[-1].pid}\n")
    try:
        args = ("--sharing-mode", "mps", "--mps-dir", str(mps_dir))
        report, _ = watcher.once(*args)
        assert report["condition"] == "healthy"
        daemons[1].kill()
        daemons[1].wait()
        report, _ = watcher.once(*args)
        assert (report["condition"], report["reason"], report["gpu"]) == \
            ("unhealthy", f"mps_daemon_down_on_{uuid(1)}", uuid(1))
        report, _ = watcher.once()  # a time-slicing pool has no daemons to look at
        assert report["condition"] == "healthy"
        report, _ = watcher.once(env={SHARING_MODE_ENV: "mps"}, *args[2:])  # the mode from node.env
        assert report["condition"] == "unhealthy"
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def test_without_the_mps_relay_every_gpu_is_unhealthy(tmp_path):
    """No slot task reaches its daemon, and the guard starts none: the reconciler drains the node."""
    watcher = WatcherNode(tmp_path)
    watcher.write_daemon({"node-generic-resources": [f"NVIDIA-GPU-SHARED={uuid(0)}-s0"]})
    mps_dir = tmp_path / "mps"
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_bytes(Path("/bin/sleep").read_bytes())
    binary.chmod(0o755)
    (mps_dir / uuid(0) / "pipe").mkdir(parents=True)
    daemon = subprocess.Popen([str(binary), "600"])
    (mps_dir / uuid(0) / "daemon.pid").write_text(f"{daemon.pid}\n")
    (mps_dir / "relay.pid").write_text(f"{daemon.pid}\n")  # a pid file naming a process that is not the relay
    try:
        report, _ = watcher.once("--sharing-mode", "mps", "--mps-dir", str(mps_dir))
        assert (report["condition"], report["reason"], report["gpu"]) == ("unhealthy", "mps_relay_down", uuid(0))
    finally:
        daemon.kill()
        daemon.wait()


def test_a_stalled_mps_server_is_found_drained_named_and_started_again(standin_node, tmp_path):
    """The measured stall (H200): a slot task took its server descriptor and dropped it; every later client got
    nothing, and nothing recovered by itself. The watcher finds it within seconds, names who got the last
    descriptor, kills daemon and server by pid, starts them again, and gives the GPU back once they serve."""
    import threading
    from tests import mps_standin
    assert mps(standin_node, "start").returncode == 0
    folder, other = standin_node.mps_dir / A, standin_node.mps_dir / B
    relayed = folder / "tasks" / "control"
    before = {gpu: int((standin_node.mps_dir / gpu / "daemon.pid").read_text()) for gpu in (A, B)}
    servers = mps_standin.children(before[A])
    (tmp_path / "watcher").mkdir()
    watcher = WatcherNode(tmp_path / "watcher")
    watcher.inventory.write_text(json.dumps([{**inventory_gpu(0), "uuid": A}, {**inventory_gpu(1), "uuid": B}]))
    watcher.write_daemon({"node-generic-resources": [f"NVIDIA-GPU-SHARED={g}-s{k}" for g in (A, B) for k in range(2)]})
    proc = subprocess.Popen([sys.executable, str(REPO / "node" / "gpu_health.py"), *watcher.sim(), "--json",
                             "--no-maintenance", "--sharing-mode", "mps", "--mps-dir", str(standin_node.mps_dir),
                             "--interval", "1", "--mps-probe-interval", "0.3", "--mps-probe-timeout", "1",
                             "--mps-hold", "1", "--mps-restart", f"bash {REPO / 'node' / 'gpu-swarm-mps'} start"],
                            env=standin_node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports: list[dict] = []
    logged: list[str] = []
    threading.Thread(target=lambda: reports.extend(json.loads(line) for line in proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: logged.extend(proc.stderr), daemon=True).start()

    def seen(condition: str, after: int = 0, within: float = 30) -> dict:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [r for r in reports[after:] if r["condition"] == condition]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no {condition} report in {reports}; the watcher said: {''.join(logged)}")
    try:
        assert seen("healthy")["reason"] == "ok"
        # Its first ask answered: until then it names no task (a stall may predate every descriptor it saw).
        deadline = time.monotonic() + 30
        while not any(f"{A}: {health_mps.FIRST_ANSWER}" in line for line in logged) and time.monotonic() < deadline:
            time.sleep(0.1)
        mps_standin.cuda_client(relayed, drop=True)  # a valid handshake, and the descriptor dropped
        stalled = seen("unhealthy")
        assert (stalled["reason"], stalled["gpu"]) == (f"mps_server_stuck_after_pid_{os.getpid()}_on_{A}", A)
        assert stalled["gpus"][B] == {"condition": "healthy", "reason": "ok"}
        back = seen("healthy", after=reports.index(stalled))
        assert back["gpus"][A]["condition"] == "healthy"
        after = int((folder / "daemon.pid").read_text())
        assert after != before[A] and all(mps_standin.gone(pid, 1) for pid in [before[A], *servers])
        assert int((other / "daemon.pid").read_text()) == before[B]  # its neighbour GPU's daemon untouched
        ceiling, _ = gpu_resources.mps_daemon_limits([81559, 46068], 4)
        assert mps_standin.cuda_client(relayed) == ceiling  # through the same relay, which never stopped
    finally:
        proc.terminate()
        proc.wait(30)
    err = "".join(logged)
    assert f"{A}: the MPS daemon or its server no longer serves" in err and "starting it again" in err, err
    assert f"{A}: the MPS daemon and its server serve again" in err


def test_the_mps_script_passes_shellcheck_and_is_strict():
    shellcheck = require_tool("shellcheck")
    script = REPO / "node" / "gpu-swarm-mps"
    result = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert script.read_text().startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script.read_text()


def test_the_mps_bench_says_how_to_run_it():
    """It runs whole in tests/test_gpu_mps_bench.py (integration), on a stand-in GPU."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mps.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--out" in done.stdout and "--slots" in done.stdout
