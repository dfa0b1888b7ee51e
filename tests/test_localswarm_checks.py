"""The rehearsal's checks that run before anything is created: arguments, root, engine, stacks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from to_node.software import min_versions
import yaml

from localswarm import host, rehearsal
from localswarm.host import RehearsalError
from localswarm.stacks import _missing_programs, prepare_stack

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kwargs, message", [
    ({"n_nodes": 0}, "--nodes must be between 1 and 32"),
    ({"n_nodes": 40}, "--nodes must be between 1 and 32"),
    ({"gpus": -1}, "--gpus-per-node must be between 0 and 16"),
    ({"managers": 2}, "--managers must be 1, 3, 5 or 7"),
    ({"n_nodes": 2, "managers": 3}, "at most --nodes"),
    ({"kind": "NVIDIA GPU"}, "--kind: invalid GPU resource kind"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = {"n_nodes": 3, "gpus": 2, "managers": 1, "kind": "NVIDIA-GPU", **kwargs}
    with pytest.raises(RehearsalError, match=message):
        rehearsal._check_args(**args)


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


def test_a_misindented_stack_is_refused_before_deploy(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "services:\n  gpu:\n    image: x\n    deploy:\n      resources:\n        reservations:\n"
        "          generic_resources:\n            - discrete_resource_spec:\n"
        "              kind: NVIDIA-GPU\n              value: 1\n")
    with pytest.raises(RehearsalError, match="discrete_resource_spec"):
        prepare_stack(bad, "bad", "NVIDIA-GPU", 2, 6, scale=False, say=lambda m: None)


def test_the_default_stack_keeps_its_own_command_on_the_stand_in():
    said = []
    out = prepare_stack(REPO / "stacks" / "gpu-smoke.yml", "smoke", "NVIDIA-GPU", 2, 6, scale=True, say=said.append)
    svc = yaml.safe_load(out["text"])["services"]["gpu"]
    original = yaml.safe_load((REPO / "stacks" / "gpu-smoke.yml").read_text())["services"]["gpu"]
    assert svc["image"].endswith("/gpu-swarm/standin:1")
    assert svc["command"] == original["command"]  # sh -c 'nvidia-smi -L; exec sleep infinity' runs as written
    assert svc["deploy"]["replicas"] == 7
    assert any("not available offline" in m for m in said)


@pytest.mark.parametrize("service, missing", [
    ({"command": ["sh", "-c", "nvidia-smi -L; exec sleep infinity"]}, []),
    ({"command": "python3 train.py"}, ["python3"]),
    ({"entrypoint": ["/opt/conda/bin/python"], "command": ["x"]}, ["python"]),
    ({"command": ["bash", "-c", "FOO=1 torchrun --nproc 1 t.py && echo done"]}, ["bash", "torchrun"]),
    ({}, []),
])
def test_commands_the_stand_in_cannot_run_are_found(service, missing):
    assert _missing_programs(service) == missing


def test_a_command_the_stand_in_cannot_run_is_replaced_and_said(tmp_path):
    stack = tmp_path / "train.yml"
    stack.write_text("services:\n  train:\n    image: pytorch/pytorch\n    command: python3 train.py\n")
    said = []
    svc = yaml.safe_load(prepare_stack(stack, "train", "NVIDIA-GPU", 2, 6, scale=False, say=said.append)["text"])
    assert "command" not in svc["services"]["train"]
    assert any("needs python3, which the stand-in lacks" in m for m in said)


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
    proc = subprocess.run([sys.executable, "-m", "localswarm", "up", "--nodes", "0"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("localswarm: --nodes must be between 1 and 32")
    assert "Traceback" not in proc.stderr


def test_stack_names_from_files():
    assert rehearsal.stack_name(Path("stacks/gpu-smoke.yml")) == "smoke"
    assert rehearsal.stack_name(Path("My Train.yaml")) == "my-train"
    assert rehearsal.stack_name(Path("gpu-.yml")) == "gpu-"
