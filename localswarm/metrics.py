"""GPU metrics in the rehearsal: the real exporter (node/gpu_metrics.py) on every node, reading the fake NVML.

As the node software installs it (install-gpu-metrics), each node runs the exporter: inside
the node's network namespace, so that it listens on the node's own address and port 9835 as on
a GPU node, against the node's own engine. NVML is the pynvml stand-in
(localswarm/standins/pynvml.py), answering from the node's hardware file, which is written
from the node's simulated GPUs. simulate_load() plays a task that uses its GPU: it records one
of the task container's processes in that file with the memory it "allocated", and the
exporter maps it to the task through its cgroup, as it does on a node. Each node has a price, which
the exporter shares between its GPUs and their tasks: the rehearsal's nodes are no EC2 instance type, so
each GPU is priced at STANDIN_GPU_HOUR, written by the program's own script for a GPU node's price.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from localswarm import api
from localswarm.health import _alive, _pidfile, _stop
from localswarm.host import REPO, RehearsalError
from localswarm.network import netns_name
from localswarm.nodes import Node
from localswarm.standins import hardware
from swarm.gpu_kind import resource_env_name
from swarm.node_contract import COST_ENV_PATH, METRICS_PORT
from to_node.software import price_env

# USD per GPU-hour of a rehearsal node: a round stand-in, about what an H100 lists at on demand.
STANDIN_GPU_HOUR = 4.0

EXPORTER = REPO / "node" / "gpu_metrics.py"
STANDINS = REPO / "localswarm" / "standins"  # the pynvml stand-in, imported as pynvml


def hardware_file(node: Node) -> Path:
    return node.state_dir / "hardware.json"


def log_file(node: Node) -> Path:
    return node.state_dir / "metrics.log"


def url(node: Node) -> str:
    return f"http://{node.address}:{METRICS_PORT}/metrics"


def write_hardware(node: Node) -> None:
    """The node's hardware file, from its simulated GPUs (again after a re-detection)."""
    file = hardware_file(node)
    if file.exists() and file.stat().st_mtime_ns >= node.inventory.stat().st_mtime_ns:
        return
    _write(file, hardware.describe(json.loads(node.inventory.read_text())))


def _write(file: Path, description: dict) -> None:
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(description, indent=2) + "\n")
    tmp.replace(file)  # whole: the stand-in re-reads it as soon as it changes


def price_file(node: Node) -> Path:
    return node.state_dir / COST_ENV_PATH.lstrip("/")


def write_price(node: Node) -> str:
    """The node's price file, by the program's script for a GPU node's (to_node/commands.py price_settings),
    in real bash: "price changed" or "price unchanged"."""
    from to_node.commands import price_settings  # its import of settings/ is the program's, and slow
    gpus = len(json.loads(node.inventory.read_text()))
    env = price_env(STANDIN_GPU_HOUR * gpus if gpus else None, market="on-demand", date="", gpus=gpus,
                    instance_type="rehearsal")
    done = subprocess.run(["bash", "-c", price_settings(env, root=str(node.state_dir))], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        raise RehearsalError(f"{node.name}: its price script failed: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def start_exporter(node: Node, kind: str, shared_kind: str = "") -> None:
    if _alive(_pidfile(node, "metrics"), EXPORTER.name):
        return
    write_hardware(node)
    write_price(node)
    cmd = [sys.executable, str(EXPORTER), "--node-name", node.name, "--daemon-json", str(node.daemon_json),
           "--docker-socket", node.sock, "--kind", kind, "--cost-env", str(price_file(node))] + \
        (["--shared-kind", shared_kind] if shared_kind else [])
    env = {**os.environ, "PYTHONPATH": str(STANDINS), "GPU_SWARM_REHEARSAL_HARDWARE": str(hardware_file(node))}
    # Started again a second after it exits, as Restart=always does on a node; the loop itself
    # lives in the node's namespace, so that whatever removes the node's processes ends it too.
    pidfile = _pidfile(node, "metrics")
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file(node), "ab") as out:
        proc = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{netns_name(node.name)}", "--", "sh", "-c",
                                 'while :; do "$@"; sleep 1; done', "sh", *cmd], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, env=env, start_new_session=True, cwd=REPO)
    pidfile.write_text(f"{proc.pid}\n")  # nsenter execs the loop: this is its pid


def start_all(nodes: list[Node], kind: str, shared_kind: str = "") -> None:
    for node in nodes:
        start_exporter(node, kind, shared_kind)


def stop(node: Node) -> None:
    _stop(_pidfile(node, "metrics"), EXPORTER.name)


def exporting(node: Node) -> bool:
    return _alive(_pidfile(node, "metrics"), EXPORTER.name) is not None


def simulate_load(node: Node, container: str, kind: str, mib: int, utilization: int = 80) -> dict:
    """A task's container "allocates" mib MiB on its GPU and keeps it busy: its first process
    appears among its GPU's compute processes in the node's hardware file."""
    try:
        info = api.get(node.sock, f"/containers/{container}/json")
    except (OSError, api.ApiError) as e:
        raise RehearsalError(f"{node.name}: no container {container} ({e})") from None
    pid = info["State"]["Pid"]
    prefix = resource_env_name(kind) + "="
    held = [v for e in info["Config"]["Env"] or [] if e.startswith(prefix) for v in e[len(prefix):].split(",") if v]
    if not held or not pid:
        raise RehearsalError(f"{node.name}: container {container[:12]} holds no {kind} GPU or is not running")
    description = json.loads(hardware_file(node).read_text())
    gpu = next((g for g in description["gpus"] if g["uuid"] == held[0]), None)
    if gpu is None:
        raise RehearsalError(f"{node.name}: {held[0]} is not in {hardware_file(node)}")
    gpu["processes"] = [p for p in gpu.get("processes", []) if p["pid"] != pid] + [{"pid": pid, "used_mib": mib}]
    gpu["utilization"] = {"gpu": utilization, "memory": utilization // 2}
    _write(hardware_file(node), description)
    return {"node": node.name, "container": container[:12], "gpu": held[0], "pid": pid, "mib": mib}
