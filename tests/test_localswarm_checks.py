"""The rehearsal's checks that run before anything is created: root, the engine, the hints it prints."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from to_node.software import min_versions

from localswarm import host
from localswarm.host import RehearsalError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sudo, how", [("/usr/bin/sudo", "(sudo before the command, or a root shell)"),
                                       (None, "(a root shell)")])
def test_not_root_is_a_clear_error(monkeypatch, sudo, how):
    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(host.shutil, "which", lambda name: sudo if name == "sudo" else f"/usr/bin/{name}")
    with pytest.raises(RehearsalError, match="run it as root") as caught:
        host.check_host()
    assert str(caught.value).endswith(how)


@pytest.mark.parametrize("found", ["20.10.24+dfsg1", "29.8.1"])
def test_an_engine_of_another_release_names_the_pin_and_the_fix(monkeypatch, tmp_path, found):
    """The rehearsal runs the release every node runs: an older one and a newer one alike are not it."""
    old = tmp_path / "usr" / "sbin"
    old.mkdir(parents=True)
    (old / "dockerd").write_text(f"#!/bin/sh\necho 'Docker version {found}, build 297e128'\n")
    (old / "dockerd").chmod(0o755)
    monkeypatch.setattr(host, "ENGINE_PREFIX", tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RehearsalError) as err:
        host.find_engine()
    text = str(err.value)
    pinned = min_versions()["DOCKER_VERSION"]
    assert f"no Docker Engine {pinned} here" in text and found in text
    assert "DOCKER_VERSION" in text and "scripts/setup.sh" in text


def test_hints_name_the_command_as_the_readme_shows_it():
    readme = (REPO / "README.md").read_text()
    assert host.COMMAND == ".venv/bin/python -m localswarm" and host.COMMAND in readme
    assert "scripts/setup.sh" in readme and f"`{host.as_root('./scripts/setup.sh')}`" in host.SETUP_HINT
    # Root types it as the README shows it (a minimal image has no sudo); anyone else after sudo.
    assert host.CLI == host.as_root(host.COMMAND)
    assert host.as_root(host.COMMAND, euid=0) == ".venv/bin/python -m localswarm"
    assert host.as_root(host.COMMAND, euid=1000) == "sudo .venv/bin/python -m localswarm"
    assert (host.CLI == host.COMMAND) == (os.geteuid() == 0)


def test_cli_reports_errors_without_a_traceback():
    env = {**os.environ, "GPU_SWARM_PULUMI_ROOT": "/nonexistent"}  # no rehearsal's machines
    proc = subprocess.run([sys.executable, "-m", "localswarm", "node", "gpu-fault", "gpu-swarm-dev-nowhere-0"],
                          cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("localswarm: no machine of Pulumi's CLI is gpu-swarm-dev-nowhere-0")
    assert "Traceback" not in proc.stderr
