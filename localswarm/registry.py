"""The local registry the nodes pull from, and the stand-in image it serves.

Docker Hub is unreachable here, and a task whose image sits behind an
unreachable registry waits 30-40 s in Preparing. A registry on the bridge
answers at once, and the stand-in replaces images we cannot fetch. For the
rehearsal's machines, whose dockerds use this registry as their Docker Hub
mirror, push_standin_as() stores the stand-in under Docker Hub names
(nvidia/cuda:...) through the Registry HTTP API, with no engine on this host.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from localswarm.host import RehearsalError
from localswarm.nodes import REGISTRY, STATE_ROOT

REGISTRY_DIR = STATE_ROOT / "registry"
STANDIN_FILES = Path(__file__).resolve().parent / "standin"
STANDIN_SCRIPTS = ("nvidia-smi", "gpu-standin")
STANDIN_CMD = ["/usr/bin/gpu-standin"]
# NVIDIA_VISIBLE_DEVICES=all as in every nvidia/cuda image: the runtime guard must override it.
STANDIN_ENV = ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


@functools.cache
def busybox_applets() -> tuple[str, ...]:
    """Every applet of this machine's busybox: the stand-in links them all, so service commands run."""
    out = subprocess.run([shutil.which("busybox"), "--list"], capture_output=True, text=True, check=True).stdout
    return tuple(sorted(set(out.split()) - set(STANDIN_SCRIPTS) - {"busybox"}))


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


# --- the stand-in under Docker Hub names, without an engine on this host ------------------------

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"


def hub_repository(name: str) -> tuple[str, str]:
    """(repository, tag) of a Docker Hub image name, as a mirror is asked for it: busybox is library/busybox."""
    ref = name.removeprefix("docker.io/").removeprefix("index.docker.io/")
    if "@" in ref:
        raise RehearsalError(f"{name}: a digest reference cannot name the stand-in (its digest is its own); use a tag")
    repo, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first = repo.split("/", 1)[0]
    if "/" in repo and ("." in first or ":" in first or first == "localhost"):
        raise RehearsalError(f"{name}: only Docker Hub images can be mirrored; {first} is another registry (the "
                             "rehearsal's machines pull through a Docker Hub mirror: rehearse the stack with a Docker "
                             "Hub image in its place)")
    return (repo if "/" in repo else f"library/{repo}"), tag


def standin_blobs(name: str = "") -> tuple[bytes, bytes, bytes]:
    """The stand-in image as a registry stores it under `name`: (layer .tar.gz, config JSON, schema 2 manifest)."""
    tar, layer = _standin_layer()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [*STANDIN_ENV, *cuda_requirement(name)], "Cmd": STANDIN_CMD},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(tar).hexdigest()}"]},
        "history": [{"created_by": "gpu-swarm rehearsal stand-in: busybox + localswarm/standin/*"}],
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MANIFEST_V2,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                   "digest": _digest(config)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer),
                    "digest": _digest(layer)}],
    }, indent=3).encode()
    return layer, config, manifest


@functools.cache
def _standin_layer() -> tuple[bytes, bytes]:
    tar = _standin_rootfs()
    # Level 1: every `localswarm pulumi up` pushes this layer before its machines boot. On 2 cores level 9
    # took 0.27 s for 2 MB and level 1 0.04 s, for a layer 6% larger that nothing but this host pulls.
    return tar, gzip.compress(tar, compresslevel=1, mtime=0)


def cuda_requirement(name: str) -> tuple[str, ...]:
    """What an nvidia/cuda:X.Y.Z-... image's config says it needs (NVIDIA_REQUIRE_CUDA=cuda>=X.Y), so that
    preview's CUDA check (settings/cuda_checks.py) reads in the rehearsal what it reads from Docker Hub."""
    if not name:
        return ()
    repository, tag = hub_repository(name)
    version = re.match(r"(\d+)\.(\d+)\.", tag)
    return (f"NVIDIA_REQUIRE_CUDA=cuda>={version[1]}.{version[2]}",) if repository == "nvidia/cuda" and version else ()


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _ask(method: str, url: str, data: bytes | None = None, headers: dict | None = None):
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the bridge, never a proxy
    try:
        with opener.open(request, timeout=30) as answer:
            return answer.status, answer.headers
    except urllib.error.HTTPError as e:
        if method == "HEAD" and e.code == 404:
            return 404, e.headers
        detail = e.read().decode(errors="replace").strip()
        raise RehearsalError(f"the local registry refused {method} {url}: HTTP {e.code} {detail}")
    except OSError as e:
        raise RehearsalError(f"the registry does not answer {method} {url} ({e}); is the rehearsal up?")


def push_standin_as(names: list[str], registry: str = REGISTRY) -> list[str]:
    """Push the stand-in (the same busybox + localswarm/standin/* as push_standin) under Docker Hub
    names such as nvidia/cuda:12.6.3-base-ubuntu24.04, speaking the Registry HTTP API v2: the
    machines' dockerds, whose registry mirror this registry is, then pull it under that name. Under an
    nvidia/cuda name its config says what that image's says it needs (cuda_requirement).
    Returns the repository:tag pushed, in the order given."""
    base = f"http://{registry}/v2"
    pushed = []
    for name in names:
        repo, tag = hub_repository(name)
        layer, config, manifest = standin_blobs(name)
        for blob in (layer, config):
            digest = _digest(blob)
            if _ask("HEAD", f"{base}/{repo}/blobs/{digest}")[0] == 200:
                continue
            _, headers = _ask("POST", f"{base}/{repo}/blobs/uploads/", b"")
            location = urllib.parse.urljoin(f"http://{registry}/", headers["Location"])
            separator = "&" if "?" in location else "?"
            _ask("PUT", f"{location}{separator}digest={urllib.parse.quote(digest)}", blob,
                 {"Content-Type": "application/octet-stream"})
        _ask("PUT", f"{base}/{repo}/manifests/{tag}", manifest, {"Content-Type": MANIFEST_V2})
        pushed.append(f"{repo}:{tag}")
    return pushed
