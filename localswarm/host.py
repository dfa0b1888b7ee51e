"""What the rehearsal needs from this machine: root, kernel features and a new enough engine.

Each check fails with a message that says what is missing and how to get it,
before anything is created.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from localswarm import lane
from to_node.software import min_versions

REPO = Path(__file__).resolve().parent.parent
ENGINE_PREFIX = Path(os.environ.get("GPU_SWARM_ENGINE_PREFIX", "/opt/gpu-swarm/docker"))


def as_root(command: str, euid: int | None = None) -> str:
    """`command` as this user must type it: as it is for root (a minimal image has no sudo at all),
    after sudo for anyone else."""
    return command if (os.geteuid() if euid is None else euid) == 0 else f"sudo {command}"


# How the rehearsal is run from a checkout, as the README shows it: as root.
COMMAND = ".venv/bin/python -m localswarm"
# What every hint names: COMMAND, as this user runs it.
CLI = as_root(COMMAND)
SETUP_HINT = f"run `{as_root('./scripts/setup.sh')}` (it installs everything the rehearsal needs)"


class RehearsalError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


def run(cmd: list[str], *, check: bool = True, env: dict | None = None, input: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command, capturing output; a failure raises RehearsalError with its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise RehearsalError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {detail}")
    return proc


def pinned_docker_version() -> tuple[int, ...]:
    """The Docker Engine release every node runs (node/versions.env): the rehearsal runs it too."""
    return _version(min_versions()["DOCKER_VERSION"])


def _version(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(p) for p in match.groups()) if match else (0, 0, 0)


@dataclass(frozen=True)
class Engine:
    """A dockerd/docker pair and the PATH that lets dockerd find its containerd and runc."""

    dockerd: str
    docker: str
    version: str
    path: str

    def env(self, sock: str | None = None) -> dict:
        env = dict(os.environ, PATH=self.path)
        if sock:
            env["DOCKER_HOST"] = f"unix://{sock}"
        return env


def find_engine() -> Engine:
    """The first dockerd of the pinned release: our own install under ENGINE_PREFIX, then PATH."""
    pinned = pinned_docker_version()
    seen = []
    candidates = [ENGINE_PREFIX / "usr/sbin/dockerd", ENGINE_PREFIX / "usr/bin/dockerd"]
    if shutil.which("dockerd"):
        candidates.append(Path(shutil.which("dockerd")))
    for dockerd in candidates:
        if not dockerd.exists():
            continue
        out = run([str(dockerd), "--version"], check=False).stdout.strip()
        if _version(out) != pinned:
            seen.append(f"{dockerd} ({out or 'unknown version'})")
            continue
        bin_dirs = [str(dockerd.parent), str(dockerd.parent.parent / "bin")]
        path = os.pathsep.join(dict.fromkeys(bin_dirs + os.environ.get("PATH", "").split(os.pathsep)))
        docker = shutil.which("docker", path=path)
        if not docker:
            raise RehearsalError(f"found {dockerd} but no docker CLI next to it; {SETUP_HINT}")
        return Engine(str(dockerd), docker, out, path)
    want = ".".join(map(str, pinned))
    found = "; found only " + ", ".join(seen) if seen else ""
    raise RehearsalError(
        f"no Docker Engine {want} here{found}: the rehearsal runs the release node/versions.env pins for "
        f"every node (DOCKER_VERSION). {SETUP_HINT}"
    )


def check_host() -> None:
    """Root, the tools we call, and the kernel features a swarm of namespaces needs."""
    if os.geteuid() != 0:
        how = "sudo before the command, or a root shell" if shutil.which("sudo") else "a root shell"
        raise RehearsalError(f"the rehearsal creates network namespaces and engines: run it as root ({how})")
    for tool in ("ip", "iptables", "nsenter", "unshare", "docker-registry", "busybox"):
        if not shutil.which(tool):
            raise RehearsalError(f"`{tool}` is not installed; {SETUP_HINT}")
    if "overlay" not in Path("/proc/filesystems").read_text():
        raise RehearsalError("the kernel has no overlay filesystem (modprobe overlay), which dockerd needs")
    # Overlay networks are VXLAN; without it every `docker stack deploy` fails later, obscurely.
    # Its name and VNI are the lane's: two lanes probing at once must not collide.
    probe = lane.name("lswprobe") + "0"
    made = run(["ip", "link", "add", probe, "type", "vxlan", "id", str(4242 + lane.LANE), "dstport", "4789"],
               check=False)
    if made.returncode != 0:
        raise RehearsalError(f"the kernel cannot create VXLAN links (modprobe vxlan): {made.stderr.strip()}")
    run(["ip", "link", "del", probe], check=False)


def parallel(work, items: list) -> list:
    """work(item) for every item, at most 8 at a time; the results in the items' order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
        return list(pool.map(work, items))
