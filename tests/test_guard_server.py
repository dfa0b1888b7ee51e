"""The runtime guard's server (node/guard_server.py) behind the real sh front: the same decisions, no Python start per create.

A real server process listens in a scratch folder; the front finds it through GUARD_SERVER
in the settings. The settings name a GUARD_PYTHON that does not exist, so a create that
succeeds went through the server: the front's own Python path would fail to start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_gpu_guard_ledger import A, B, WHOLE, Node, refused

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "node" / "guard_server.py"


class Server:
    def __init__(self, directory: Path):
        self.directory, self.proc = directory, None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(SERVER), str(self.directory)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 10
        while not self.serving():
            assert time.monotonic() < deadline and self.proc.poll() is None, "the server did not start"
            time.sleep(0.02)

    def serving(self) -> bool:
        try:
            return int((self.directory / "server.pid").read_text()) == self.proc.pid
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served(tmp_path):
    server = Server(tmp_path / "guard")
    node = Node(tmp_path, GUARD_SERVER=str(server.directory), GUARD_PYTHON="/nonexistent/python3")
    server.start()
    yield node, server
    server.stop()
    node.kill_inits()


def test_a_create_goes_through_the_server_and_gets_its_gpu(served):
    node, server = served
    assert Path(f"/proc/{server.proc.pid}/comm").read_text().strip() == "gpu-swarm-guard"
    result = node.create("c1", f"{WHOLE}={A}", "NVIDIA_VISIBLE_DEVICES=all")
    assert result.returncode == 0, result.stderr
    assert node.created() == ["c1"] and node.claims() == {A: "c1"}
    env = json.loads((node.bundle("c1") / "config.json").read_text())["process"]["env"]
    assert f"NVIDIA_VISIBLE_DEVICES={A}" in env
    assert [p.name for p in server.directory.iterdir()] and not list(server.directory.glob("reply.*"))


def test_a_refusal_from_the_server_says_why_where_containerd_reads_it(served):
    node, _ = served
    assert node.create("holder", f"{WHOLE}={A}").returncode == 0
    second = node.create("second", f"{WHOLE}={A}")
    assert refused(second, "holder", f"GPU {A}"), second.stderr
    (entry,) = [json.loads(line) for line in (node.tmp / "second.log").read_text().splitlines()]
    assert entry["level"] == "error" and f"GPU {A} is held by container holder" in entry["msg"]
    assert node.created() == ["holder"]


def test_creates_at_the_same_moment_through_the_server_give_a_gpu_to_exactly_one(served):
    node, _ = served
    names = [f"c{i}" for i in range(8)]
    codes = node.create_at_once(names, f"{WHOLE}={B}")
    assert sorted(codes) == [0] + [1] * 7
    assert node.claims() == {B: names[codes.index(0)]}


def test_a_bundle_given_relative_to_the_runtimes_directory_is_found(served):
    node, _ = served
    node.prepare("rel", f"{WHOLE}={A}")
    args = [a if a != str(node.bundle("rel")) else "rel" for a in node.args("rel")]
    result = subprocess.run(args, cwd=node.bundle("rel").parent, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"NVIDIA_VISIBLE_DEVICES={A}" in (node.bundle("rel") / "config.json").read_text()


def test_the_settings_are_read_at_every_create(served):
    node, _ = served
    node.config.write_text(node.config.read_text().replace(f"GPUS={A},{B}", f"GPUS={B}"))
    result = node.create("c", f"{WHOLE}={A}")
    assert result.returncode == 1 and "which this node does not have" in result.stderr


def test_requests_it_cannot_read_do_not_stop_it(served):
    node, server = served
    fd = os.open(server.directory / "requests", os.O_WRONLY)
    os.write(fd, b"x\0not a request\0")
    os.write(fd, b"2\0/etc/passwd\0/nonexistent\0/\0a\0b\0")  # a reply path outside its folder: never touched
    os.close(fd)
    assert node.create("c", f"{WHOLE}={A}").returncode == 0 and server.proc.poll() is None
    assert Path("/etc/passwd").exists()


@pytest.mark.parametrize("how", ["killed", "pid of another process"])
def test_without_a_live_server_the_front_runs_the_guard_itself(served, how):
    node, server = served
    server.stop()
    if how == "pid of another process":
        (server.directory / "server.pid").write_text(f"{os.getpid()}\n")  # alive, but not the server
    node.config.write_text(node.config.read_text().replace("GUARD_PYTHON=/nonexistent/python3",
                                                           f"GUARD_PYTHON={sys.executable}"))
    assert node.create("c", f"{WHOLE}={A}").returncode == 0 and node.claims() == {A: "c"}


def test_a_new_server_answers_the_creates_its_predecessor_left_waiting(served):
    _, server = served
    server.stop()
    waiting = server.directory / "reply.4242"
    os.mkfifo(waiting, 0o600)
    fd = os.open(waiting, os.O_RDWR)  # as a front waiting for its answer
    try:
        server.start()
        answer = os.read(fd, 4096).decode()
    finally:
        os.close(fd)
    assert answer.startswith("refused gpu-swarm guard: the guard's server restarted") and not waiting.exists()


def test_the_unit_runs_the_server_where_the_agent_points_the_runtime():
    from swarm.node_contract import GUARD_SERVER_DIR, GUARD_SERVER_PATH, GUARD_UNIT
    unit = (REPO / "node" / GUARD_UNIT).read_text()
    assert f"ExecStart=/usr/bin/python3 -I -S {GUARD_SERVER_PATH} {GUARD_SERVER_DIR}\n" in unit
    assert "Before=docker.service" in unit and "Restart=always" in unit
    assert f"install_service {GUARD_UNIT}" in (REPO / "node" / "install-gpu-agent.sh").read_text()

