"""How a rehearsal machine's processes run on this host: systemd-nspawn, started by a small launcher
in the machine's own cgroup, and found again (launcher -> nspawn -> the machine's PID 1) by pid.

The host's PID 1 need not be systemd and its cgroups may be a v1 hybrid, so nothing here asks
systemd for a unit: localswarm/machines.py calls these with a Machine (its name, dir and root).
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

from localswarm import lane

CGROUP = lane.name("gpu-swarm-machines")
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


def procs(m) -> list[int]:
    """The pids in any of the machine's cgroups (deepest ones included)."""
    pids: set[int] = set()
    for cgroup in cgroups_of(m):
        for listing in cgroup.rglob("cgroup.procs") if cgroup.exists() else []:
            try:
                pids.update(int(p) for p in listing.read_text().split())
            except (OSError, ValueError):
                pass  # the cgroup was removed meanwhile
    return sorted(pids)


def _sigkill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill(m, timeout: float = 30) -> None:
    """SIGKILL to the launcher, nspawn and every process in the machine's cgroups, and a wait until
    they have exited. A killed process stays in its cgroup until its exit is done, which for one
    with a lot of memory (a machine's dockerd) takes a while under load: 0.15 s for 1 GiB here."""
    _sigkill(filter(None, (launcher_pid(m), nspawn_pid(m))))
    for cgroup in cgroups_of(m):
        if (cgroup / "cgroup.kill").exists():
            (cgroup / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = procs(m)
        if not left and not launcher_pid(m):
            return
        _sigkill(left)  # v1 has no cgroup.kill; and one forked after the last listing
        time.sleep(0.05)


def describe(pids) -> str:
    """pid (comm, state) for each, as /proc tells, for an error that says what is stuck."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            out.append(f"{pid} ({stat[stat.index('(') + 1:stat.rindex(')')]}, state {stat.rsplit(')', 1)[1].split()[0]})")
        except (OSError, ValueError):
            out.append(f"{pid} (gone)")
    return ", ".join(out) or "no process listed"


def remove_cgroups(m, timeout: float = 10) -> None:
    """Every cgroup of the machine removed, deepest first. A cgroup whose last process is still
    exiting refuses (EBUSY) for a moment, so this tries again until timeout; then the error names
    what is still in it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for cgroup in cgroups_of(m):
                if cgroup.exists():
                    for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                                    reverse=True):
                        d.rmdir()
                    cgroup.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise OSError(e.errno, f"{e.strerror}; in it: {describe(procs(m))}", e.filename) from e
        time.sleep(0.05)


def mounted(path: Path) -> bool:
    return str(path) in mounts()


def mounts() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def mounts_under(folder: Path) -> list[str]:
    """Mount points below folder, deepest first (the order to unmount them in)."""
    return sorted((p for p in mounts() if p.startswith(f"{folder}/")), key=len, reverse=True)
