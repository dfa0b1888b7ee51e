"""One rehearsal node: a namespace with its own dockerd, configured by the real GPU agent."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from localswarm import api, lane
from localswarm.host import REPO, Engine, RehearsalError, run
from localswarm.network import BRIDGE_ADDR, netns_name, netns_pids, node_addr

STATE_ROOT, RUN_ROOT = lane.NAMESPACED_STATE, lane.NAMESPACED_RUN
REGISTRY = f"{BRIDGE_ADDR}:5000"
AGENT = REPO / "node" / "gpu_agent.py"
GUARD = REPO / "node" / "gpu-swarm-runtime"

# Keys the rehearsal owns in each node's daemon.json. The agent merges its keys into
# this file and must keep these, which the re-detection test checks.
BASE_DAEMON_CONFIG = {
    "insecure-registries": [REGISTRY],  # the local registry speaks plain HTTP
    "shutdown-timeout": 3,  # `down` should not wait 15 s per engine for sleeping tasks
    "log-opts": {"max-size": "1m"},
}


@dataclass(frozen=True)
class Node:
    name: str
    index: int  # its address on the bridge; a replaced node gets a new one, like a new instance
    role: str  # "manager" | "worker"
    pool: str = "rehearsal"

    @property
    def address(self) -> str:
        return node_addr(self.index)

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.name

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.name

    @property
    def daemon_json(self) -> Path:
        return self.state_dir / "daemon.json"

    @property
    def inventory(self) -> Path:
        return self.state_dir / "gpus.json"

    @property
    def toolkit_config(self) -> Path:
        # There is no toolkit here, but the agent still writes the swarm-resource key
        # where the toolkit would read it, so the rehearsal shows the whole configuration.
        return self.state_dir / "nvidia-container-runtime" / "config.toml"

    @property
    def runtime_config(self) -> Path:
        return self.state_dir / "runtime.env"

    @property
    def sock(self) -> str:
        return str(self.run_dir / "docker.sock")

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "dockerd.pid"

    @property
    def containerd_dir(self) -> Path:
        return self.run_dir / "containerd"

    @property
    def log(self) -> Path:
        return self.state_dir / "dockerd.log"

    def to_dict(self) -> dict:
        return asdict(self)


def simulated_gpus(count: int, model: str = "Simulated NVIDIA H100") -> list[dict]:
    """An inventory in the agent's --inventory format, with fresh full UUIDs."""
    return [{"index": i, "uuid": f"GPU-{uuid.uuid4()}", "name": model, "memory_mib": 81559, "mig": False}
            for i in range(count)]


def prepare(node: Node) -> None:
    for d in (node.state_dir, node.run_dir, node.toolkit_config.parent):
        d.mkdir(parents=True, exist_ok=True)
    if not node.daemon_json.exists():
        node.daemon_json.write_text(json.dumps(BASE_DAEMON_CONFIG, indent=2) + "\n")


def run_agent(node: Node, gpus: list[dict], kind: str, extra: tuple[str, ...] = ()) -> dict:
    """Write the node's inventory and let the real agent turn it into daemon.json."""
    node.inventory.write_text(json.dumps(gpus, indent=2) + "\n")
    # The runtime guard is the default runtime, as on a GPU node, but hands containers to runc:
    # there is no nvidia-container-runtime here. The stand-in nvidia-smi then shows what the
    # toolkit would have given each task.
    proc = run([sys.executable, str(AGENT), "--inventory", str(node.inventory),
                "--daemon-json", str(node.daemon_json), "--toolkit-config", str(node.toolkit_config),
                "--runtime-config", str(node.runtime_config), "--guard", str(GUARD),
                "--guard-ledger", str(node.run_dir / "gpu-claims"),  # the nodes share this host's /run
                "--runtime-delegate", shutil.which("runc") or "/usr/sbin/runc",
                "--kind", kind, *extra, "--json"], check=False)
    if proc.returncode != 0:
        raise RehearsalError(f"GPU agent failed on {node.name} (exit {proc.returncode}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def start_containerd(node: Node, engine: Engine, timeout: float = 30) -> int:
    """Start the node's containerd, in its namespace and under its hostname, and wait until it listens.

    A dockerd that starts its own containerd dials it before it listens, and gRPC retries
    only after its one-second backoff: a second of every engine start. So containerd starts
    first, as containerd.service does before docker.service on a real node.
    """
    pidfile, sock = node.containerd_dir / "containerd.pid", node.containerd_dir / "containerd.sock"
    pid = _pid_of(pidfile, "containerd")
    if pid:
        return pid
    node.containerd_dir.mkdir(parents=True, exist_ok=True)
    config = node.containerd_dir / "containerd.toml"
    # What dockerd writes for the containerd it manages: the same folders, the same plugins.
    config.write_text(f'version = 2\nroot = "{node.state_dir / "docker/containerd/daemon"}"\n'
                      f'state = "{node.run_dir / "exec/containerd/daemon"}"\noom_score = 0\n'
                      f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{sock}"\n')
    sock.unlink(missing_ok=True)
    cmd = ["nsenter", f"--net=/var/run/netns/{netns_name(node.name)}", "--",
           # A UTS namespace gives each node its own hostname (dockerd joins it), so `docker node ls` reads well.
           "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', node.name,
           "containerd", "--config", str(config)]
    with open(node.state_dir / "containerd.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=engine.env(), start_new_session=True)
    pidfile.write_text(f"{proc.pid}\n")  # nsenter, unshare and sh each exec the next: this is containerd's pid
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(str(sock)) == 0:
                return proc.pid
        time.sleep(0.01)
    raise RehearsalError(f"containerd on {node.name} did not start; see {node.state_dir / 'containerd.log'}")


def start_dockerd(node: Node, engine: Engine) -> int:
    """Start the node's engine (its containerd first) inside its namespaces."""
    if is_running(node):
        return read_pid(node)
    containerd = start_containerd(node, engine)
    for stale in (node.pidfile, Path(node.sock)):
        stale.unlink(missing_ok=True)
    cmd = ["nsenter", f"--net=/var/run/netns/{netns_name(node.name)}", f"--uts=/proc/{containerd}/ns/uts", "--",
           engine.dockerd, "--config-file", str(node.daemon_json),
           "--containerd", str(node.containerd_dir / "containerd.sock"),
           "--data-root", str(node.state_dir / "docker"), "--exec-root", str(node.run_dir / "exec"),
           "--pidfile", str(node.pidfile), "-H", f"unix://{node.sock}"]
    with open(node.log, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=engine.env(), start_new_session=True)
    return proc.pid


def wait_ready(node: Node, engine: Engine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if api.ping(node.sock):  # a `docker` process per try would take the CPU the engines need
            return
        time.sleep(0.02)
    tail = "\n".join(node.log.read_text(errors="replace").splitlines()[-15:]) if node.log.exists() else ""
    raise RehearsalError(f"dockerd on {node.name} did not come up in {timeout:.0f} s; last log lines:\n{tail}")


def _pid_of(pidfile: Path, comm: str) -> int | None:
    """The pid in `pidfile`, while that process is still `comm` and alive.

    A killed engine leaves its pidfile, and when this process started it, it stays a
    zombie named `comm` until reaped: that is an engine gone, not one running.
    """
    try:
        pid = int(pidfile.read_text().strip())
        if Path(f"/proc/{pid}/comm").read_text().strip() != comm:
            return None
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return None if state in ("Z", "X") else pid
    except (OSError, ValueError, IndexError):
        return None


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours: init reaps it
        pass


def read_pid(node: Node) -> int | None:
    try:
        return int(node.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def is_running(node: Node) -> bool:
    return _pid_of(node.pidfile, "dockerd") is not None


def _terminate(pidfile: Path, comm: str, timeout: float) -> None:
    pid = _pid_of(pidfile, comm)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    if not _gone(pidfile, comm, timeout):
        # An engine busy leaving its networks under load can take longer than `timeout`;
        # the next start must not find this one still dying and take it for running.
        os.kill(pid, signal.SIGKILL)
        _gone(pidfile, comm, 10)
    _reap(pid)


def _gone(pidfile: Path, comm: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _pid_of(pidfile, comm) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _pid_of(pidfile, comm) is None


def stop_dockerd(node: Node, timeout: float = 30, *, keep_containerd: bool = False) -> None:
    """Stop the node's engine by its own pid, then its containerd and anything left in its namespace."""
    _terminate(node.pidfile, "dockerd", timeout)
    if keep_containerd:
        return
    _terminate(node.containerd_dir / "containerd.pid", "containerd", timeout)
    # containerd shims outlive an engine that was killed; they are in the node's namespace.
    for leftover in netns_pids(netns_name(node.name)):
        try:
            os.kill(leftover, signal.SIGKILL)
        except ProcessLookupError:
            pass


def docker(node: Node, engine: Engine, *args: str, check: bool = True, input: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return run([engine.docker, "-H", f"unix://{node.sock}", *args], check=check, input=input,
               env=engine.env(), timeout=timeout)


def run_script(node: Node, engine: Engine, script: str, *, stdin: str = "", timeout: float = 600) -> str:
    """Run one of the swarm/ scripts against this node's engine, as SSH runs it on AWS.

    The scripts run as root on this host, which sees each node's data root, so the few
    that read a node's files (its swarm certificate) find them as they would on the node.
    """
    # A node runs the waiter of its installed software (stack deploys); here, the repository's.
    env = {**engine.env(node.sock), "GPU_SWARM_SOFTWARE": str(REPO / "node")}
    proc = run(["bash", "-c", script], env=env, input=stdin, check=False, timeout=timeout)
    if proc.returncode != 0:
        raise RehearsalError(f"on {node.name}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def restart_dockerd(node: Node, engine: Engine) -> None:
    """What the agent's unit does after changing daemon.json: dockerd reads its resources only at start.

    As `systemctl restart docker` on a real node, it leaves containerd running.
    """
    stop_dockerd(node, keep_containerd=True)
    start_dockerd(node, engine)
    wait_ready(node, engine)
