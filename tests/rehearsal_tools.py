"""What the rehearsal's integration tests share: the engine prerequisite, the CLI and waiting on status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from localswarm.host import REPO, RehearsalError, find_engine

KIND = "NVIDIA-GPU"


def require_engine():
    """Root and an engine >= 25.0.3: in CI a missing one fails the run instead of skipping it."""
    missing = "needs root" if os.geteuid() != 0 else None
    if not missing:
        try:
            return find_engine()
        except RehearsalError as e:
            missing = str(e)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the rehearsal tests: {missing}")
    pytest.skip(missing)


def rehearsal_up(*args: str):
    """A module's rehearsal, for `yield from` in a fixture: what an interrupted run left is
    removed first (it must not fail the suite), and `down` runs when the module is done."""
    cli("down")
    yield cli_json("up", *args)
    cli("down")


def cli(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"localswarm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli_json(*args: str) -> dict:
    return json.loads(cli(*args, "--json").stdout)


def status() -> dict:
    return cli_json("status")


def until(condition, timeout: float, what: str, interval: float = 0.5):
    """condition()'s first true value, asked every `interval` s; an AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_for(predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = status()
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{json.dumps(view, indent=1)}")
        time.sleep(0.5)


def tasks_of(view: dict, service: str) -> list[dict]:
    return next((s["tasks"] for s in view["services"] if s["name"] == service), [])


def node_of(view: dict, name: str) -> dict:
    return next(n for n in view["nodes"] if n["name"] == name)


def advertised(view: dict) -> dict[str, set[str]]:
    return {n["name"]: set(n["gpus"]) for n in view["nodes"]}


def running_pairs(view: dict, service: str) -> set[tuple[str, str]]:
    return {(t["node"], g) for t in tasks_of(view, service) if t["state"] == "running" for g in t["gpus"]}
