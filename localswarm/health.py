"""GPU health in the rehearsal: the real watcher on every node, the real reconciler on every manager.

The watcher (node/gpu_health.py) reads the node's simulated GPUs and a faults file that
`node gpu-fault` writes, instead of NVML; its spot notices come from a fake IMDS
(fake_imds.py). It publishes the node's condition in the node's daemon.json and tells that
node's dockerd, exactly as on AWS. The reconciler (node/swarm_reconciler.py) talks to its
manager's engine. Only the timings differ from a real node: a check every second, and
RECOVERY_S instead of 300 s before a healed GPU counts as healthy again.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from localswarm import registry
from localswarm.fake_imds import notice_file, scheduled_event, spot_action
from localswarm.host import REPO, Engine, RehearsalError
from localswarm.nodes import RUN_ROOT, STATE_ROOT, Node

WATCHER = REPO / "node" / "gpu_health.py"
RECONCILER = REPO / "node" / "swarm_reconciler.py"
CHECK_INTERVAL_S = 1
RECOVERY_S = 5
RECONCILE_INTERVAL_S = 1
DEFAULT_XID = 79  # "GPU has fallen off the bus"
IMDS_PID, IMDS_PORT = RUN_ROOT / "imds.pid", RUN_ROOT / "imds.port"


def faults_file(node: Node) -> Path:
    return node.state_dir / "faults.json"


def _pidfile(node: Node, what: str) -> Path:
    return node.run_dir / f"{what}.pid"


def _spawn(cmd: list[str], log: Path, pidfile: Path, env: dict | None = None) -> None:
    """A process that outlives this command, in its own session, started again a second after
    it exits, as its systemd unit (Restart=always) runs it on a node: the watcher exits on
    purpose when the node's GPUs change."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(["sh", "-c", 'while :; do "$@"; sleep 1; done', "sh", *cmd], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, env=env, start_new_session=True, cwd=REPO)
    pidfile.write_text(f"{proc.pid}\n")


def _alive(pidfile: Path, program: str) -> int | None:
    """The pid in pidfile, if that process is still the program it was started as."""
    try:
        pid = int(pidfile.read_text())
        if program.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    except (OSError, ValueError):
        pass
    return None


def _stop(pidfile: Path, program: str) -> None:
    pid = _alive(pidfile, program)
    if pid:
        os.killpg(pid, signal.SIGTERM)  # the loop and the program: one process group
        for _ in range(50):
            if not _alive(pidfile, program):
                break
            time.sleep(0.1)
        else:
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def imds_url(node: Node) -> str:
    if not _alive(IMDS_PID, "fake_imds"):
        IMDS_PORT.unlink(missing_ok=True)
        _spawn([sys.executable, "-m", "localswarm.fake_imds", "--root", str(STATE_ROOT), "--port-file", str(IMDS_PORT)],
               STATE_ROOT / "imds.log", IMDS_PID)
    for _ in range(100):
        if IMDS_PORT.exists():
            return f"http://127.0.0.1:{IMDS_PORT.read_text().strip()}/{node.name}"
        time.sleep(0.05)
    raise RehearsalError(f"the fake IMDS did not start; see {STATE_ROOT / 'imds.log'}")


def start_watcher(node: Node, kind: str, shared_kind: str = "") -> None:
    if _alive(_pidfile(node, "health"), WATCHER.name):
        return
    cmd = [sys.executable, str(WATCHER), "--json", "--daemon-json", str(node.daemon_json), "--kind", kind,
           "--inventory", str(node.inventory), "--faults", str(faults_file(node)),
           "--state-file", str(node.state_dir / "health-state.json"), "--dockerd-pidfile", str(node.pidfile),
           "--interval", str(CHECK_INTERVAL_S), "--recovery-seconds", str(RECOVERY_S),
           "--spot", "--imds", imds_url(node),  # every rehearsal node may get a spot notice
           "--docker-socket", str(node.sock)]
    if shared_kind:
        cmd += ["--shared-kind", shared_kind]
    _spawn(cmd, log_file(node), _pidfile(node, "health"))


def start_all(nodes: list[Node], engine: Engine, kind: str, shared_kind: str = "") -> None:
    """What the node software installs: a watcher on every node, a reconciler on every manager."""
    for node in nodes:
        start_watcher(node, kind, shared_kind)
        if node.role == "manager":
            start_reconciler(node, engine)


def watching(node: Node) -> bool:
    return _alive(_pidfile(node, "health"), WATCHER.name) is not None


def log_file(node: Node) -> Path:
    return node.state_dir / "health.log"


def start_reconciler(node: Node, engine: Engine) -> None:
    if _alive(_pidfile(node, "reconciler"), RECONCILER.name):
        return
    # The sentinel runs the stand-in, which every node pulled for its post-join check as a GPU node builds CHECK_IMAGE.
    _spawn([sys.executable, str(RECONCILER), "--json", "--interval", str(RECONCILE_INTERVAL_S),
            "--docker", engine.docker, "--sentinel-image", registry.STANDIN_IMAGE], node.state_dir / "reconciler.log", _pidfile(node, "reconciler"),
           env=engine.env(node.sock))


def stop(node: Node) -> None:
    """The node's health processes (a removed or replaced node: its instance is gone)."""
    _stop(_pidfile(node, "health"), WATCHER.name)
    _stop(_pidfile(node, "reconciler"), RECONCILER.name)


def stop_imds() -> None:
    _stop(IMDS_PID, "fake_imds")
    IMDS_PORT.unlink(missing_ok=True)


def gpu_fault(node: Node, gpu: str | None = None, xid: int = DEFAULT_XID) -> dict:
    """Make one of the node's simulated GPUs report an XID, as NVML would."""
    gpus = [g["uuid"] for g in json.loads(node.inventory.read_text())]
    gpu = gpu or gpus[0]
    if gpu not in gpus:
        raise RehearsalError(f"{node.name} has no GPU {gpu}; its GPUs are {', '.join(gpus)}")
    if not 0 <= xid <= 1023:
        raise RehearsalError(f"--xid {xid} is not an XID (0 to 1023)")
    faults = _faults(node)
    faults[gpu] = {"xid": xid}
    faults_file(node).write_text(json.dumps(faults, indent=2) + "\n")
    return {"node": node.name, "gpu": gpu, "xid": xid}


def gpu_heal(node: Node) -> dict:
    """Clear the node's faults and spot notices; the watcher calls it healthy after RECOVERY_S."""
    healed = sorted(_faults(node))
    faults_file(node).write_text("{}\n")
    notices = [f for f in (notice_file(STATE_ROOT, node.name), notice_file(STATE_ROOT, node.name, "rebalance"),
                           notice_file(STATE_ROOT, node.name, "maintenance-scheduled")) if f.exists()]
    for f in notices:
        f.unlink()
    return {"node": node.name, "healed": healed, "notices_cleared": len(notices)}


def spot_notice(node: Node, action: str = "terminate") -> dict:
    """What EC2's IMDS says two minutes before it reclaims a spot instance."""
    notice = spot_action(action)
    file = notice_file(STATE_ROOT, node.name)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(notice) + "\n")
    return {"node": node.name, **notice}


def maintenance_notice(node: Node, code: str = "system-reboot", starts_in_s: int = 60) -> dict:
    """What EC2's IMDS lists when AWS schedules maintenance for the instance (here: soon enough to drain)."""
    event = scheduled_event(node.name, code, starts_in_s)
    file = notice_file(STATE_ROOT, node.name, "maintenance-scheduled")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps([event]) + "\n")
    return {"node": node.name, **event}


def _faults(node: Node) -> dict:
    try:
        return json.loads(faults_file(node).read_text() or "{}")
    except (OSError, ValueError):
        return {}
