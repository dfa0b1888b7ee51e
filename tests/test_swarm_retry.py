"""The retry every manager-side script runs its `docker` through (swarm/script.py), in real bash.

A stub `docker` on PATH fails its first calls the way the real CLI does (exit 1, the daemon's
message on stderr), then succeeds; it counts its calls in a file.
"""
from __future__ import annotations

import subprocess

import pytest

from swarm.script import RETRY_TRANSIENT_SWARM_ERRORS, script

STUB = """#!/bin/bash
n=$(( $(cat "$STUB_DIR/calls" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$STUB_DIR/calls"
if [ "$n" -le "$FAILS" ]; then echo "$MESSAGE" >&2; exit 1; fi
echo "updated $*"
"""


def run_with_stub(tmp_path, fails: int, message: str) -> tuple[subprocess.CompletedProcess, int]:
    stub = tmp_path / "docker"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), "FAILS": str(fails), "MESSAGE": message}
    done = subprocess.run(["bash", "-c", script(RETRY_TRANSIENT_SWARM_ERRORS, "docker node update --label-add a=b n1")],
                          env=env, capture_output=True, text=True, timeout=60)
    return done, int((tmp_path / "calls").read_text())


@pytest.mark.parametrize("message", [
    # What dockerd 26 answers when the node changed between the CLI's read and its write.
    "Error response from daemon: rpc error: code = Unknown desc = update out of sequence",
    # The same refusal, should a CLI or daemon ever word it without the gRPC prefix.
    "Error response from daemon: update out of sequence",
    "Error response from daemon: rpc error: code = Unknown desc = The swarm does not have a leader.",
])
def test_a_write_that_lost_a_race_or_a_leader_is_tried_again(tmp_path, message):
    done, calls = run_with_stub(tmp_path, 1, message)
    assert done.returncode == 0, done.stderr
    assert calls == 2 and done.stdout == "updated node update --label-add a=b n1\n"
    assert done.stderr == ""  # what a retry overcame is not shown as an error


def test_a_lasting_refusal_is_not_tried_again_and_its_message_is_kept(tmp_path):
    done, calls = run_with_stub(tmp_path, 5, "Error response from daemon: node n1 not found")
    assert (done.returncode, calls) == (1, 1)
    assert done.stderr.strip() == "Error response from daemon: node n1 not found"
