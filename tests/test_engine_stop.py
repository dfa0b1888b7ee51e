"""Stopping a rehearsal node's engine: what a restart finds must be the truth about the old one."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from localswarm import nodes


def _execed(proc, comm: str) -> None:
    """Until the child runs `comm`: just after the fork it is still this Python."""
    deadline = time.monotonic() + 10
    while open(f"/proc/{proc.pid}/comm").read().strip() != comm:
        assert time.monotonic() < deadline, f"{comm} did not start"
        time.sleep(0.01)


def _zombie(tmp_path):
    proc = subprocess.Popen(["sleep", "0"])
    pidfile = tmp_path / "sleep.pid"
    pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + 10
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "sleep 0 did not exit"
        time.sleep(0.01)
    return proc, pidfile


def test_a_killed_engine_left_as_a_zombie_with_its_pidfile_is_not_running(tmp_path):
    # What a SIGKILLed dockerd leaves: its pidfile, and a zombie still named after it.
    proc, pidfile = _zombie(tmp_path)
    try:
        assert nodes._pid_of(pidfile, "sleep") is None
    finally:
        proc.wait()


def test_a_live_process_of_the_pidfile_is_found_and_another_name_is_not(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    pidfile = tmp_path / "sleep.pid"
    pidfile.write_text(str(proc.pid))
    _execed(proc, "sleep")
    try:
        assert nodes._pid_of(pidfile, "sleep") == proc.pid
        assert nodes._pid_of(pidfile, "dockerd") is None
    finally:
        proc.kill()
        proc.wait()


def test_an_engine_that_outlives_its_stop_timeout_is_killed_reaped_and_gone_before_the_stop_returns(tmp_path):
    # A dockerd leaving its swarm networks under load ignores SIGTERM for longer than the timeout.
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; while :; do sleep 0.05; done"])
    pidfile = tmp_path / "bash.pid"
    pidfile.write_text(str(proc.pid))
    _execed(proc, "bash")
    time.sleep(0.2)  # the trap is set
    nodes._terminate(pidfile, "bash", timeout=0.3)
    assert nodes._pid_of(pidfile, "bash") is None
    assert not os.path.exists(f"/proc/{proc.pid}")  # reaped, not a zombie
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
