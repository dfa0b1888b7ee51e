"""How a rehearsal machine's processes run on this host: systemd-nspawn, started by a small launcher
in the machine's own cgroup, and found again (launcher -> nspawn -> the machine's PID 1) by pid.

The host's PID 1 need not be systemd and its cgroups may be a v1 hybrid, so nothing here asks
systemd for a unit: localswarm/machines.py calls these with a Machine (its name, dir and root).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

CGROUP = "gpu-swarm-machines"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# nspawn must give the machine cgroup2 (runc cannot use the read-only v1 controllers inside)
# and a writable /proc/sys/net (dockerd sets ip_forward).
NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1", "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "network"}
# Runs nspawn in the machine's own cgroup (else two machines share one and their systemds fight
# over it), boots it again when it reboots, and unmounts its root when it stops.
LAUNCHER = r'''root=$1 cgroups=$2 stopping=$3
shift 3
rc=133
# 133: the machine rebooted (systemd-nspawn(1)); boot it again, unless stop() asked for a poweroff.
while [ "$rc" -eq 133 ] && [ ! -e "$stopping" ]; do
  sh -c 'for d in $1; do mkdir -p "$d" && echo $$ >"$d/cgroup.procs" || exit 1; done; shift; exec "$@"' \
    launcher "$cgroups" "$@"
  rc=$?
  echo "gpu-swarm machine launcher: systemd-nspawn exited with $rc"
done
umount "$root" 2>/dev/null
exit "$rc"
'''


def nspawn_command(m, netns: str) -> list[str]:
    return ["systemd-nspawn", "-D", str(m.root), "--boot", "--register=no", "--keep-unit",
            f"--network-namespace-path=/run/netns/{netns}", f"--machine={m.name}", "--capability=all",
            "--system-call-filter=@keyring bpf",  # dockerd and runc need them; nspawn's filter denies them
            f"--bind={m.docker_dir}:/var/lib/docker",  # a plain folder: overlay2 on an overlay fails
            "--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=read-only"]


def spawn(m, netns: str) -> subprocess.Popen:
    """The launcher, in the background, its output (the machine's console) appended to its log."""
    (m.dir / "stopping").unlink(missing_ok=True)
    cgroups = " ".join(str(p) for p in cgroups_of(m))
    with open(m.console_log, "ab") as log:
        proc = subprocess.Popen(["sh", "-c", LAUNCHER, "launcher", str(m.root), cgroups, str(m.dir / "stopping"),
                                 *nspawn_command(m, netns)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env={**os.environ, **NSPAWN_ENV, "PATH": PATH})
    (m.dir / "launcher.pid").write_text(f"{proc.pid}\n")
    return proc


def cgroup_roots() -> list[Path]:
    """Where machines' cgroups go: under cgroup2, and under v1's name=systemd on a hybrid host."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base / CGROUP]  # cgroup2 only
    return [base / h / CGROUP for h in ("systemd", "unified") if (base / h / "cgroup.procs").exists()]


def cgroups_of(m) -> list[Path]:
    return [root / m.name for root in cgroup_roots()]


def launcher_pid(m) -> int | None:
    try:
        pid = int((m.dir / "launcher.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    zombie = stat.rsplit(")", 1)[-1].split()[0] == "Z"
    return pid if not zombie and str(m.root).encode() in cmdline else None


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def nspawn_pid(m) -> int | None:
    launcher = launcher_pid(m)
    for child in _children(launcher) if launcher else []:
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "systemd-nspawn":
                return child
        except OSError:
            pass  # it just exited
    return None


def init_pid(m) -> int | None:
    """The machine's PID 1 (its systemd), as the host sees it."""
    nspawn = nspawn_pid(m)
    children = _children(nspawn) if nspawn else []
    return children[0] if children else None


def kill(m) -> None:
    """SIGKILL to the launcher, nspawn and every process left in the machine's cgroups."""
    for pid in filter(None, (launcher_pid(m), nspawn_pid(m))):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for cgroup in cgroups_of(m):
        if (cgroup / "cgroup.kill").exists():
            (cgroup / "cgroup.kill").write_text("1")
        for procs in cgroup.rglob("cgroup.procs") if cgroup.exists() else []:
            for pid in procs.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + 10
    while launcher_pid(m) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_cgroups(m) -> None:
    for cgroup in cgroups_of(m):
        if cgroup.exists():
            for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                d.rmdir()
            cgroup.rmdir()


def mounted(path: Path) -> bool:
    return str(path) in mounts()


def mounts() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def mounts_under(folder: Path) -> list[str]:
    """Mount points below folder, deepest first (the order to unmount them in)."""
    return sorted((p for p in mounts() if p.startswith(f"{folder}/")), key=len, reverse=True)
