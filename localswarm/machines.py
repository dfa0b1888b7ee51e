"""The rehearsal's machines: local stand-ins for EC2 instances, each with its own root filesystem,
systemd as PID 1, sshd, cloud-init (NoCloud) and dockerd, booted from the node image.

A machine is a network namespace on the rehearsal bridge (localswarm/network.py: its address
is node_addr(index)), an overlay root (the node image below, its own disk above) and
systemd-nspawn --boot in the background, its console in a log. API:
  launch(name, index, *, user_data, meta_data, gpus, hosts, image=None) -> Machine
      non-blocking, like RunInstances: returns once nspawn runs. meta_data: {"instance-id",
      "ami-id", "local-hostname", "public-keys": [...]}; gpus: [{"uuid", "name", "memory_mib"}] become
      the hardware file (localswarm/standins); hosts: {"name": "address"} added to /etc/hosts
  wait_booted(machine, timeout) -> "running" | "degraded"   (systemctl is-system-running --wait)
  wait_cloud_init(machine, timeout) -> dict                  (cloud-init status --wait --format json)
  wait_sshd(machine, timeout) -> float                       (seconds until port 22 sends its banner)
  run(machine, argv | script, *, input=None, timeout=60) -> CompletedProcess   (as root, nsenter)
  console(machine) -> str;  running(machine) -> bool;  machine(name) -> Machine;  machines() -> list
  stop(machine) / start(machine): a clean shutdown and a boot again, disk, address and instance-id kept
  terminate(machine): everything of it gone;  teardown_all(): every machine gone (idempotent, for `down`)
  set_gpus(machine, gpus) / set_gpu_fault(machine, uuid, fault | None): rewrite its hardware file
A reboot inside a machine boots it again (nspawn exits 133); a poweroff stops it. How its
processes are started and found: localswarm/nspawn.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from localswarm import lane, network, node_image, nspawn, standins
from localswarm.host import SETUP_HINT, RehearsalError, parallel, run as host_run
from localswarm.standins import hardware

# Apart from the namespaced rehearsal's /var/lib/localswarm, whose `down` removes that folder
# whole: a machine's disk must go only with the machine (terminate, teardown_all).
STATE = lane.MACHINES_STATE
MACHINES = STATE / "machines"
_bridge_lock = threading.Lock()
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


@dataclass(frozen=True)
class Machine:
    name: str
    index: int

    @property
    def address(self) -> str:
        return network.node_addr(self.index)

    @property
    def dir(self) -> Path:
        return MACHINES / self.name

    @property
    def root(self) -> Path:  # the overlay, mounted while it runs
        return self.dir / "root"

    @property
    def disk(self) -> Path:  # its own files: the overlay's upper layer
        return self.dir / "disk"

    @property
    def docker_dir(self) -> Path:  # /var/lib/docker: a plain folder (overlay on overlay fails)
        return self.dir / "docker"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def netns(self) -> str:
        return network.netns_name(self.name)


def machine(name: str) -> Machine:
    try:
        data = json.loads((MACHINES / name / "machine.json").read_text())
    except (OSError, ValueError):
        raise RehearsalError(f"there is no machine {name!r}")
    return Machine(data["name"], data["index"])


def machines() -> list[Machine]:
    found = []
    for path in sorted(MACHINES.glob("*/machine.json")):
        try:
            found.append(machine(path.parent.name))
        except RehearsalError:
            pass
    return found


def etc_hosts(m: Machine, hostname: str, hosts: dict[str, str]) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", "ff02::1\tip6-allnodes",
             "ff02::2\tip6-allrouters", f"{m.address}\t{hostname}"]
    lines += [f"{address}\t{name}" for name, address in hosts.items()]
    return "\n".join(lines) + "\n"


def _write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, mode)
    tmp.replace(path)


def launch(name: str, index: int, *, user_data: str, meta_data: dict, gpus: list[dict],
           hosts: dict[str, str] | None = None, image: node_image.Image | None = None) -> Machine:
    """A new machine, booting: returns as soon as nspawn runs (sshd answers some seconds later)."""
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", name):
        raise RehearsalError(f"machine name {name!r}: use a hostname, lower-case letters, digits and '-'")
    if not 0 <= index <= 244:
        raise RehearsalError(f"machine index {index}: must be 0 to 244 (its address is .10 + index in {network.SUBNET})")
    if os.geteuid() != 0:
        raise RehearsalError("machines need root (namespaces, mounts, systemd-nspawn)")
    if not shutil.which("systemd-nspawn"):
        raise RehearsalError(f"`systemd-nspawn` is not installed (Debian package systemd-container); {SETUP_HINT}")
    image = image or node_image.ensure_image()
    m = Machine(name, index)
    if m.dir.exists():
        raise RehearsalError(f"machine {name!r} exists already; terminate it first")
    taken = {other.name for other in machines() if other.index == index}
    if taken:
        raise RehearsalError(f"address {m.address} (index {index}) belongs to machine {taken.pop()} already")
    # A namespaced rehearsal node (localswarm/nodes.py) may hold the name or the address: never take theirs.
    veth = network._veth(index)
    if m.netns in network.our_netns() or (Path("/sys/class/net") / veth).exists():
        raise RehearsalError(f"network namespace {m.netns} or link {veth} exists already; pick another name or "
                             "index, or remove the rehearsal (`down`)")
    try:
        for folder in (m.disk, m.dir / "work", m.root, m.docker_dir):
            folder.mkdir(parents=True)
        _write(m.dir / "machine.json", json.dumps({"name": name, "index": index, "lowerdir": image.lowerdir}))
        with _bridge_lock:
            if host_run(["ip", "link", "show", network.BRIDGE], check=False).returncode != 0:
                network.create_bridge()
        network.create_node_netns(name, index)
        hostname = meta_data.get("local-hostname", name)
        seed = m.disk / "var/lib/cloud/seed/nocloud"
        _write(seed / "meta-data", json.dumps(meta_data, indent=1) + "\n", 0o600)
        _write(seed / "user-data", user_data, 0o600)
        _write(m.disk / "etc/hosts", etc_hosts(m, hostname, hosts or {}))
        for path, text in node_image.lane_files().items():
            _write(m.disk / path, text)
        _write(m.disk / standins.HARDWARE_FILE.lstrip("/"), _hardware_json(gpus))
        # That file gave the disk a /usr of its own, dated now. Dated as the image's, /usr is unchanged
        # since the image was baked, as on an instance's first boot: systemd runs no ConditionNeedsUpdate
        # unit (node_image writes /etc/.updated and /var/.updated).
        usr = next(p for p in (image.layer / "usr", image.base / "usr") if p.is_dir()).stat()
        os.utime(m.disk / "usr", ns=(usr.st_atime_ns, usr.st_mtime_ns))
        start(m)
    except BaseException:
        terminate(m)
        raise
    return m


def _hardware_json(gpus: list[dict]) -> str:
    return json.dumps(hardware.describe(gpus), indent=1) + "\n"


def start(m: Machine) -> None:
    """Boot a stopped machine (its disk as it was); returns once nspawn runs."""
    if running(m):
        return
    lowerdir = json.loads((m.dir / "machine.json").read_text())["lowerdir"]
    if not all(Path(p).is_dir() for p in lowerdir.split(":")):
        raise RehearsalError(f"machine {m.name}'s image ({lowerdir}) is gone; terminate it and launch a new one")
    if not nspawn.mounted(m.root):
        host_run(["mount", "-t", "overlay", "overlay", "-o",
                  f"lowerdir={lowerdir},upperdir={m.disk},workdir={m.dir / 'work'}", str(m.root)])
    proc = nspawn.spawn(m, m.netns)
    # Until the fork has exec'd, /proc shows our own command line: wait for nspawn itself.
    deadline = time.monotonic() + 10
    while nspawn.nspawn_pid(m) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RehearsalError(f"machine {m.name} did not start (exit {proc.poll()}); its console:\n{_tail(m)}")
        time.sleep(0.005)
    # Then for its systemd to have made its manager (its private bus socket): one that cannot, for a limit of
    # this host's ("Failed to allocate manager object: Too many open files", at 128 inotify instances per
    # user), exits at once, and the machine would otherwise be a port 22 that never answers. Slow is not dead:
    # after 30 s the boot waits tell the rest.
    deadline = time.monotonic() + 30
    while not _manager_up(m) and time.monotonic() < deadline:
        if not running(m):
            raise RehearsalError(f"machine {m.name}'s systemd exited as it started; its console:\n{_tail(m)}")
        time.sleep(0.02)


def _manager_up(m: Machine) -> bool:
    pid = nspawn.init_pid(m)
    return bool(pid) and Path(f"/proc/{pid}/root/run/systemd/private").exists()


def running(m: Machine) -> bool:
    return nspawn.launcher_pid(m) is not None


def run(m: Machine, command: list[str] | str, *, input: str | None = None, timeout: float = 60,
        check: bool = False) -> subprocess.CompletedProcess:
    """A command in the machine, as root (a string runs in bash); its output captured as text."""
    pid = nspawn.init_pid(m)
    if pid is None:
        raise RehearsalError(f"machine {m.name} is not running")
    argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
    env = {"PATH": nspawn.PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
    proc = subprocess.run(["nsenter", "-t", str(pid), "-a", "--", *argv], input=input, capture_output=True,
                          text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RehearsalError(f"on {m.name}: `{argv[-1] if isinstance(command, str) else ' '.join(argv)}` failed "
                             f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


def _remaining(deadline: float, m: Machine, what: str) -> float:
    left = deadline - time.monotonic()
    if not running(m):
        raise RehearsalError(f"machine {m.name} stopped while waiting for {what}; its console:\n{_tail(m)}")
    if left <= 0:
        raise RehearsalError(f"machine {m.name}: no {what} in time; its console:\n{_tail(m)}")
    return left


def wait_booted(m: Machine, timeout: float = 120) -> str:
    """systemd's verdict once the boot is done: "running", or "degraded" (some unit failed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = _remaining(deadline, m, "finished boot")
        if nspawn.init_pid(m):
            try:
                state = run(m, ["systemctl", "is-system-running", "--wait"], timeout=left).stdout.strip()
            except subprocess.TimeoutExpired:
                continue
            if state in ("running", "degraded"):
                return state
        time.sleep(0.1)  # nspawn has not forked PID 1 yet, or its bus is not up


def wait_cloud_init(m: Machine, timeout: float = 300) -> dict:
    """cloud-init's JSON status once it has finished: "status" is "done" or "error" ("done" with
    "recoverable_errors" is what cloud-init >= 23.4 reports with exit 2, a success for the program)."""
    deadline = time.monotonic() + timeout
    while True:
        left = _remaining(deadline, m, "cloud-init result")
        if nspawn.init_pid(m):
            try:
                proc = run(m, ["cloud-init", "status", "--wait", "--format", "json"], timeout=left)
                return json.loads(proc.stdout)
            except subprocess.TimeoutExpired:
                continue
            except ValueError:
                pass  # its Python was not ready to answer yet
        time.sleep(0.1)


def wait_sshd(m: Machine, timeout: float = 120) -> float:
    """Seconds until sshd on the machine's address sends its banner, as a client first sees it."""
    t0 = deadline = time.monotonic()
    deadline += timeout
    while True:
        _remaining(deadline, m, "sshd on port 22")
        try:
            with socket.create_connection((m.address, 22), timeout=1) as conn:
                conn.settimeout(2)
                if conn.recv(64).startswith(b"SSH-"):
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.1)


def console(m: Machine) -> str:
    try:
        return _ANSI.sub("", m.console_log.read_text(errors="replace"))
    except FileNotFoundError:
        return ""


def _tail(m: Machine, lines: int = 25) -> str:
    return "\n".join(console(m).splitlines()[-lines:])


def stop(m: Machine, timeout: float = 60) -> None:
    """A clean shutdown (nspawn turns SIGTERM into the machine's poweroff); killed after timeout."""
    pid = nspawn.nspawn_pid(m)
    if m.dir.exists():
        (m.dir / "stopping").touch()  # a reboot under way must not boot it again
    if pid:
        os.kill(pid, signal.SIGTERM)
    elif running(m):
        nspawn.kill(m)  # not booting yet: nothing to shut down cleanly
    deadline = time.monotonic() + timeout
    while running(m) and time.monotonic() < deadline:
        time.sleep(0.05)
    if running(m):
        nspawn.kill(m)
    if nspawn.mounted(m.root):
        host_run(["umount", "-l", str(m.root)], check=False)


def terminate(m: Machine, timeout: float = 20) -> None:
    """Everything of the machine gone: processes, mounts, cgroups, namespace, disk."""
    stop(m, timeout)
    nspawn.kill(m)  # nothing should be left; a machine that never booted may have a half-started nspawn
    try:
        nspawn.remove_cgroups(m)
    except OSError as e:
        raise RehearsalError(f"machine {m.name}: its cgroup still holds processes ({e})")
    for point in nspawn.mounts_under(m.dir):
        host_run(["umount", "-l", point], check=False)
    if m.dir.exists():  # else the namespace of that name is not this machine's
        network.remove_node_netns(m.name)
        # The kernel frees the namespace's veth a moment later; its address is free only then.
        veth, deadline = Path("/sys/class/net") / network._veth(m.index), time.monotonic() + 10
        while veth.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    shutil.rmtree(m.dir, ignore_errors=True)
    shutil.rmtree(Path("/run/systemd/nspawn/propagate") / m.name, ignore_errors=True)


def teardown_all() -> list[str]:
    """Terminate every machine (those whose folder is left, and stray cgroups); the names removed."""
    found = machines()
    parallel(terminate, found)
    names = {m.name for m in found}
    # A machine whose folder was removed under it (a namespaced rehearsal's `down` once did so)
    # still has its cgroup, its namespace and maybe its root mounted.
    for root in nspawn.cgroup_roots():
        for stray in sorted(p for p in root.glob("*") if p.is_dir()) if root.exists() else []:
            m = Machine(stray.name, 0)
            nspawn.kill(m)
            nspawn.remove_cgroups(m)
            network.remove_node_netns(m.name)
            names.add(m.name)
    for point in nspawn.mounts_under(MACHINES):
        host_run(["umount", "-l", point], check=False)
    for folder in MACHINES.glob("*") if MACHINES.exists() else []:
        shutil.rmtree(folder, ignore_errors=True)  # a half-made machine, without machine.json
    return sorted(names)


def hardware_file(m: Machine) -> Path:
    return (m.root if nspawn.mounted(m.root) else m.disk) / standins.HARDWARE_FILE.lstrip("/")


def set_gpus(m: Machine, gpus: list[dict]) -> None:
    """Other GPUs in the machine (seen by NVML at once; the agent advertises them at its next run)."""
    _write(hardware_file(m), _hardware_json(gpus))


def write_hardware(m: Machine, description: dict) -> None:
    """The machine's stand-in hardware, whole (its NVML stand-in re-reads it as soon as it changes)."""
    _write(hardware_file(m), json.dumps(description, indent=1) + "\n")


def set_gpu_fault(m: Machine, uuid: str, fault: dict | None) -> None:
    """Make one GPU fail ({"xid": 79}, {"ecc": "double"}, {"missing": true}, {"pending_retirement": true}),
    or heal it (None). The stand-ins read the file at once: see localswarm/standins/pynvml.py."""
    try:
        description = hardware.with_fault(hardware.load(str(hardware_file(m))), uuid, fault)
    except KeyError:
        raise RehearsalError(f"machine {m.name} has no GPU {uuid}")
    write_hardware(m, description)
