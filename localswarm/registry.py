"""The local registry the nodes pull from, and the stand-in image it serves.

Docker Hub is unreachable here, and a task whose image sits behind an
unreachable registry waits 30-40 s in Preparing. A registry on the bridge
answers at once, and the stand-in replaces images we cannot fetch.
"""
from __future__ import annotations

import functools
import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from localswarm.host import Engine, RehearsalError
from localswarm.nodes import REGISTRY, STATE_ROOT, Node, docker

REGISTRY_DIR = STATE_ROOT / "registry"
STANDIN_IMAGE = f"{REGISTRY}/gpu-swarm/standin:1"
STANDIN_FILES = Path(__file__).resolve().parent / "standin"
STANDIN_SCRIPTS = ("nvidia-smi", "gpu-standin")


@functools.cache
def busybox_applets() -> tuple[str, ...]:
    """Every applet of this machine's busybox: the stand-in links them all, so service commands run."""
    out = subprocess.run([shutil.which("busybox"), "--list"], capture_output=True, text=True, check=True).stdout
    return tuple(sorted(set(out.split()) - set(STANDIN_SCRIPTS) - {"busybox"}))


def standin_programs() -> set[str]:
    return {*busybox_applets(), *STANDIN_SCRIPTS}


def start_registry() -> int:
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    config = REGISTRY_DIR / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {REGISTRY_DIR / 'data'}}}}}\n"
        f"http: {{addr: '{REGISTRY}'}}\n"
    )
    with open(REGISTRY_DIR / "registry.log", "ab") as log:
        proc = subprocess.Popen([shutil.which("docker-registry"), "serve", str(config)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    (REGISTRY_DIR / "registry.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=1).close()
            return proc.pid
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    raise RehearsalError(f"the local registry did not start; see {REGISTRY_DIR / 'registry.log'}")


def stop_registry() -> None:
    pidfile = REGISTRY_DIR / "registry.pid"
    try:
        pid = int(pidfile.read_text())
        if Path(f"/proc/{pid}/cmdline").read_bytes().find(b"docker-registry") >= 0:
            os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass
    pidfile.unlink(missing_ok=True)


def _standin_rootfs() -> bytes:
    """A busybox root filesystem plus our stand-in nvidia-smi, as a tar stream for `docker import`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "usr", "usr/bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(shutil.which("busybox"), "bin/busybox")
        for applet in busybox_applets():
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        for script in STANDIN_SCRIPTS:
            tar.add(STANDIN_FILES / script, f"usr/bin/{script}")
    return buf.getvalue()


def push_standin(node: Node, engine: Engine) -> str:
    """Build the stand-in on one node's engine and push it, so every node can pull it."""
    proc = subprocess.run([engine.docker, "-H", f"unix://{node.sock}", "import",
                           "--change", 'CMD ["/usr/bin/gpu-standin"]', "--change", "ENV PATH=/usr/bin:/bin",
                           # As in every nvidia/cuda image: the runtime guard must override it.
                           "--change", "ENV NVIDIA_VISIBLE_DEVICES=all",
                           "--change", "ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                           "-", STANDIN_IMAGE], input=_standin_rootfs(), capture_output=True,
                          env=engine.env(), timeout=60)
    if proc.returncode != 0:
        raise RehearsalError(f"could not build the stand-in image: {proc.stderr.decode().strip()}")
    docker(node, engine, "push", "-q", STANDIN_IMAGE, timeout=60)
    return STANDIN_IMAGE


def pull_standin(nodes: list[Node], engine: Engine) -> None:
    """Put the pushed stand-in on these nodes, as a GPU node builds its check image at boot.

    The post-join GPU check and the stacks run it; pulled beforehand, while the swarm forms,
    no admission waits for its download (a second under load), only for a manifest check.
    """
    if nodes:
        with ThreadPoolExecutor(max_workers=min(8, len(nodes))) as pool:
            list(pool.map(lambda n: docker(n, engine, "pull", "-q", STANDIN_IMAGE, timeout=60), nodes))
