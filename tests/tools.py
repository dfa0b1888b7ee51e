"""Real tools the tests run: present in CI (which installs them), optional elsewhere."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def require_tool(name: str) -> str:
    """The tool's path; without it the test fails in CI (CI=true) and skips elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian package {name})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return path


def files_git_lists(repo: Path, pattern: str) -> list[Path]:
    """Every file matching pattern that git tracks or would track (so never .venv)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", pattern],
                                cwd=repo, capture_output=True, text=True, check=True).stdout
        paths = [repo / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        paths = [p for p in repo.rglob(pattern) if not {".git", ".venv"} & set(p.relative_to(repo).parts)]
    return sorted(p for p in paths if p.is_file())


@contextlib.contextmanager
def docker_registry(root: Path):
    """A real docker-registry on 127.0.0.1 storing under root: yields its host:port, stops it after."""
    binary = require_tool("docker-registry")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog: {{level: warn}}\n"
                      f"storage: {{filesystem: {{rootdirectory: {root / 'data'}}}}}\n"
                      f"http: {{addr: '{address}'}}\n")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://{address}/v2/", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "docker-registry did not start"
                time.sleep(0.05)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)
