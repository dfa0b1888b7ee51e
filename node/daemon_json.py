"""Docker's daemon.json on a GPU node: read it without ever clobbering it, and write it atomically.

Two programs rewrite it: the GPU agent at boot (resources, gpu.* labels, runtimes) and the
health watcher while the node runs (gpu-swarm.condition* labels). Each reads, changes its
own keys and writes back, under one lock, so neither writes back a copy without the other's
latest change.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile

from gpu_detect import BadInput, json_type


@contextlib.contextmanager
def locked(path: str, lock_dir: str = "/run/lock"):
    """Hold the lock of daemon.json for a read-change-write.

    The lock file lives in /run/lock (gone at reboot, nothing left in /etc/docker), named
    after the daemon.json it guards."""
    real = os.path.realpath(path)
    name = "gpu-swarm-" + hashlib.sha256(real.encode()).hexdigest()[:12] + ".lock"
    lock = os.path.join(lock_dir if os.path.isdir(lock_dir) else os.path.dirname(real), name)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        yield


def read_daemon_json(path: str) -> dict | None:
    """The current daemon.json, None when absent; BadInput (never a rewrite) when unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    fix = "the file was left untouched; fix it (or move it away) and run the agent again"
    try:
        text = raw.decode("utf-8")
        config = json.loads(text) if text.strip() else {}  # dockerd accepts an empty file too
    except (UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"{path}: not valid JSON ({e}); {fix}")
    if not isinstance(config, dict):
        raise BadInput(f"{path}: expected a JSON object at the top level, found {json_type(config)}; {fix}")
    for key, kind in (("node-generic-resources", list), ("labels", list), ("runtimes", dict),
                      ("default-runtime", str)):
        if key in config and not isinstance(config[key], kind):
            raise BadInput(f"{path}: {key!r} must be {json_type(kind())}, found {json_type(config[key])}; {fix}")
    for key in ("node-generic-resources", "labels"):
        if not all(isinstance(item, str) for item in config.get(key, [])):
            raise BadInput(f"{path}: {key!r} must be a list of \"key=value\" strings; {fix}")
    nvidia = config.get("runtimes", {}).get("nvidia", {})
    if not isinstance(nvidia, dict) or not isinstance(nvidia.get("path", ""), str):
        raise BadInput(f"{path}: runtimes.nvidia must be an object with a string \"path\"; {fix}")
    return config


def write_atomic(path: str, data: bytes) -> None:
    """Replace path with data via a temp file in the same dir, keeping its mode and owner."""
    path = os.path.realpath(path)  # a symlinked daemon.json stays a symlink
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    try:
        st = os.stat(path)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o644, None  # mkstemp's 0600 would hide daemon.json from non-root tools
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if owner and owner != (os.getuid(), os.getgid()):
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself survive a power cut
    finally:
        os.close(dir_fd)


def set_labels(labels: list[str], prefix: str, wanted: dict[str, str]) -> list[str]:
    """labels with every label whose key starts with prefix set to `wanted`: each stays where
    it was (or goes, when no longer wanted), new ones come last. Two programs own labels in
    one list (the agent gpu.*, the watcher gpu-swarm.condition*); keeping places means one
    of them rewriting its own never looks like a change to the other's."""
    out, done = [], set()
    for label in labels:
        key = label.split("=", 1)[0]
        if not key.startswith(prefix):
            out.append(label)
        elif key in wanted and key not in done:
            out.append(f"{key}={wanted[key]}")
            done.add(key)
    return out + [f"{key}={value}" for key, value in wanted.items() if key not in done]
