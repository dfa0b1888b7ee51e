"""The stack deploy command as the program renders it, run in real bash: `docker stack deploy`, then
the waiter of the node software (node/stack_settle.py) against an Engine API on a unix socket.

The docker CLI is a stub that answers `stack deploy` and `config` as the real one does (exit codes
and messages); the engine is a stub that serves, read after read, the documents a real manager
returned in each phase of a scenario (services, tasks with the `_up-to-date` filter, nodes).
The rehearsal runs the same command against real engines (tests/test_pulumi_up.py, test_program_stacks.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from socketserver import ThreadingUnixStreamServer

import pulumi
import pytest

from components.gpu_stack import GpuStack, GpuStackArgs
from swarm.stacks import deploy_stack, settle_report
from tests.conftest import REPO, request_inputs, is_secret, use_mocks
from tests.docker_api_stub import send_json
from tests.tools import require_tool

COMPOSE = "services:\n  gpu:\n    image: busybox\n"
SHA = hashlib.sha256(COMPOSE.encode()).hexdigest()
NO_GPU = "no suitable node (insufficient resources on 1 node)"
BIND = 'invalid mount config for type "bind": bind source path does not exist: /srv/models'
OLD = "2026-01-01T00:00:00.1Z"  # a task in its state long enough to count as running

FAKE_DOCKER = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >>"$FAKE/calls"
case "$1 $2" in
  "stack deploy")
    cat >"$FAKE/compose"
    if [ -e "$FAKE/deploy-fails" ]; then
      echo "failed to create service smoke_gpu: Error response from daemon: rpc error: code = InvalidArgument" >&2
      exit 1
    fi
    echo "Creating network smoke_default"; echo "Creating service smoke_gpu" ;;
  "config inspect")
    [ -e "$FAKE/marker" ] && exit 0
    echo "Error response from daemon: config $3 not found" >&2; exit 1 ;;
  "config create") cat >"$FAKE/marker" ;;
  *) echo "fake docker: unexpected $*" >&2; exit 2 ;;
esac
"""


def node(node_id: str = "n1", state: str = "ready") -> dict:
    return {"ID": node_id, "Description": {"Hostname": f"host-{node_id}"}, "Status": {"State": state}}


def service(name: str = "smoke_gpu", replicas: int = 2, stack: str = "smoke", **extra) -> dict:
    return {"ID": f"id-{name}", "Spec": {"Name": name, "Labels": {"com.docker.stack.namespace": stack},
                                         "Mode": {"Replicated": {"Replicas": replicas}}}, **extra}


def task(slot: int, state: str, desired: str = "running", err: str = "", svc: str = "smoke_gpu", node_id: str = "n1",
         created: str = OLD, stale: bool = False) -> dict:
    """A task document; stale: it runs a spec older than its service's (the engine's `_up-to-date` filter drops it)."""
    status = {"State": state, "Timestamp": created, **({"Err": err} if err else {})}
    return {"ID": f"t{slot}{state}{created}", "ServiceID": f"id-{svc}", "Slot": slot,
            "NodeID": node_id if state != "pending" else "", "DesiredState": desired, "CreatedAt": created,
            "Version": {"Index": 1}, "Status": status, "_stale": stale}


class Engine(BaseHTTPRequestHandler):
    """GET /services (label filter), /tasks (`_up-to-date` filter), /nodes, from the current phase.
    Each read of /services (the waiter's first read of a round) moves to the next phase; the last stays."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        stub = self.server.stub
        url = urllib.parse.urlparse(self.path)
        filters = json.loads(urllib.parse.parse_qs(url.query).get("filters", ["{}"])[0])
        if url.path == "/services":
            stub.round = min(stub.round + 1, len(stub.phases) - 1)
        phase = stub.phases[max(stub.round, 0)]
        if url.path == "/services":
            labels = filters.get("label", [])
            body = [s for s in phase["services"]
                    if all(f"{k}={v}" in labels for k, v in s["Spec"]["Labels"].items()) or not labels]
        elif url.path == "/tasks":
            body = [t for t in phase["tasks"] if not (filters.get("_up-to-date") and t["_stale"])]
        elif url.path == "/nodes":
            body = phase.get("nodes", [node()])
        else:
            self.send_error(404)
            return
        send_json(self, body)

    def address_string(self):
        return "unix"

    def log_message(self, *args):
        pass


class Manager:
    """A manager's docker CLI and engine, with a scenario given as phases."""

    def __init__(self, root: Path):
        self.dir, self.bin = root / "state", root / "bin"
        self.dir.mkdir()
        self.bin.mkdir()
        (self.bin / "docker").write_text(FAKE_DOCKER)
        (self.bin / "docker").chmod(0o755)
        for name in ("bash", "cat", "python3"):
            (self.bin / name).symlink_to(sys.executable if name == "python3" else shutil.which(name))
        self.sock_dir = tempfile.mkdtemp(prefix="engine-")  # a unix socket's path has room for ~100 bytes
        self.server = ThreadingUnixStreamServer(f"{self.sock_dir}/docker.sock", Engine)
        self.server.stub = self
        self.phases: list[dict] = [{"services": [], "tasks": []}]
        self.round = -1
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def deploy(self, *phases: dict, wait_seconds: int = 5) -> tuple[subprocess.CompletedProcess, float]:
        self.phases = list(phases)
        env = {"PATH": str(self.bin), "FAKE": str(self.dir), "DOCKER_HOST": f"unix://{self.sock_dir}/docker.sock",
               "GPU_SWARM_SOFTWARE": str(REPO / "node")}
        started = time.monotonic()
        proc = subprocess.run(["bash", "-c", deploy_stack("smoke", SHA, wait_seconds)], input=COMPOSE,
                              capture_output=True, text=True, env=env, timeout=60)
        return proc, time.monotonic() - started

    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def manager(tmp_path):
    m = Manager(tmp_path)
    yield m
    m.close()


def test_the_deploy_script_passes_shellcheck():
    require_tool("shellcheck")
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=deploy_stack("smoke", SHA, 90),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("wait", [0, -5, 1.5, True, "600"])
def test_a_wait_that_is_no_whole_number_of_seconds_is_refused(wait):
    with pytest.raises(ValueError, match="whole number of seconds"):
        deploy_stack("smoke", SHA, wait)


def test_a_stack_with_a_replica_waiting_for_a_gpu_settles_and_reports_it(manager):
    proc, took = manager.deploy({"services": [service()],
                                 "tasks": [task(1, "running"), task(2, "pending", err=NO_GPU)]})
    assert proc.returncode == 0, proc.stderr
    report = settle_report(proc.stdout)
    assert report["settled"] is True and report["problems"] == []
    assert report["waiting"] == [{"service": "smoke_gpu", "slot": 2, "reason": NO_GPU}]
    (svc,) = report["services"]
    assert svc["outcome"] == "1 running, 1 waiting for resources"
    assert [(t["slot"], t["state"], t["node"]) for t in svc["tasks"]] == [(1, "running", "host-n1"), (2, "pending", "")]
    assert manager.calls()[0] == "stack deploy --detach=true --with-registry-auth --prune -c - smoke"
    assert (manager.dir / "compose").read_text() == COMPOSE and (manager.dir / "marker").read_text() == "smoke"
    assert "stack smoke settled in" in proc.stderr and took < 10


def test_a_swap_waits_for_the_old_stacks_tasks_to_release_their_gpu_then_fails_on_the_rejection(manager):
    """The hole: the new stack's task waits for the GPU the old stack's task still holds (swarm is
    stopping it). That wait is no answer; the answer comes once the GPU is free: rejected, 3 times."""
    old = task(1, "running", desired="remove", svc="old_gpu")
    waiting = {"services": [service(replicas=1)], "tasks": [old, task(1, "pending", err=NO_GPU)]}
    rejected = [task(1, "rejected", desired="shutdown", err=BIND, created=f"2026-01-01T00:00:0{i}Z") for i in (1, 2, 3)]
    phases = [waiting] * 8 + [{"services": [service(replicas=1)],
                               "tasks": [*rejected, task(1, "pending", created="2026-01-01T00:00:09Z")]}]
    proc, _ = manager.deploy(*phases)
    assert proc.returncode == 1, proc.stdout
    assert manager.round >= 8, "it settled while the old stack's task still held the GPU"
    assert ("stack smoke: smoke_gpu task 1 failed 3 times and never completed (rejected: " + BIND + ")") in proc.stderr
    report = settle_report(proc.stdout)
    assert report["settled"] is False and BIND in report["problems"][0]


def test_the_old_stacks_task_on_a_node_that_is_down_frees_nothing_to_wait_for(manager):
    old = task(1, "running", desired="shutdown", svc="old_gpu", node_id="n2")
    proc, _ = manager.deploy({"services": [service(replicas=1)], "tasks": [old, task(1, "pending", err=NO_GPU)],
                              "nodes": [node("n1"), node("n2", "down")]})
    assert proc.returncode == 0, proc.stderr
    assert settle_report(proc.stdout)["waiting"][0]["reason"] == NO_GPU


def test_a_task_refused_with_no_restart_fails_at_once_naming_stack_service_and_reason(manager):
    proc, took = manager.deploy({"services": [service(replicas=1)],
                                 "tasks": [task(1, "rejected", desired="shutdown", err=BIND)]})
    assert proc.returncode == 1
    assert f"stack smoke: smoke_gpu task 1 was rejected and swarm will not start it again: {BIND}" in proc.stderr
    assert took < 5


def test_a_task_of_the_stacks_previous_version_is_not_taken_for_the_new_one(manager):
    """Right after `stack deploy` updates a service, its old task still runs; only up-to-date tasks count."""
    before = {"services": [service(replicas=1)], "tasks": [task(1, "running", stale=True)]}
    after = {"services": [service(replicas=1)],
             "tasks": [task(1, "shutdown", desired="shutdown", stale=True), task(1, "running", created="2026-01-01T00:00:05Z")]}
    proc, _ = manager.deploy(*[before] * 6, after)
    assert proc.returncode == 0, proc.stderr
    assert manager.round >= 6


def test_a_stack_that_does_not_settle_in_time_fails_naming_what_did_not(manager):
    proc, took = manager.deploy({"services": [service(replicas=2)], "tasks": [task(1, "starting")]}, wait_seconds=2)
    assert proc.returncode == 1
    assert ("stack smoke did not settle in 2 s: smoke_gpu: 1 of 2 tasks made; smoke_gpu task 1: starting"
            in proc.stderr)
    assert 2 <= took < 8


def test_a_stack_with_no_services_after_the_deploy_fails(manager):
    """What a new swarm under an unchanged deploy, or a stack gone behind the program's back, looks like."""
    proc, _ = manager.deploy({"services": [service(stack="other")], "tasks": []})
    assert proc.returncode == 1
    assert "stack smoke has no services after `docker stack deploy`" in proc.stderr


def test_a_failed_stack_deploy_fails_the_command_with_dockers_message_and_no_wait(manager):
    (manager.dir / "deploy-fails").touch()
    proc, _ = manager.deploy({"services": [service()], "tasks": []})
    assert proc.returncode == 1 and "failed to create service smoke_gpu" in proc.stderr
    assert manager.round == -1 and not (manager.dir / "marker").exists()


def test_the_marker_is_made_once_even_when_the_stack_then_fails(manager):
    """A failing stack is still the program's: the reconcile finds it by its marker and can remove it."""
    proc, _ = manager.deploy({"services": [service(replicas=1)],
                              "tasks": [task(1, "rejected", desired="shutdown", err=BIND)]})
    assert proc.returncode == 1 and (manager.dir / "marker").read_text() == "smoke"
    manager.deploy({"services": [service(replicas=1)], "tasks": [task(1, "running")]})
    assert sum(c.startswith("config create") for c in manager.calls()) == 1


def test_the_waiter_refuses_a_docker_host_that_is_no_unix_socket(manager):
    proc = subprocess.run([sys.executable, str(REPO / "node" / "stack_settle.py"), "--stack", "smoke"],
                          capture_output=True, text=True, env={"DOCKER_HOST": "tcp://10.0.0.5:2375"}, timeout=30)
    assert proc.returncode == 2 and "DOCKER_HOST=tcp://10.0.0.5:2375 is no unix socket" in proc.stderr


def test_the_deploy_takes_a_secret_compose_file_on_stdin_and_reports_its_tasks():
    """Stacks with secret variables hand the component their content as a secret Output."""
    monitor = use_mocks({})
    seen = {}

    @pulumi.runtime.test
    def program():
        stack = GpuStack("s", GpuStackArgs(stack_name="smoke", content=pulumi.Output.secret(COMPOSE), sha256=SHA,
                                           manager={"host": "10.0.0.5", "user": "ubuntu"}, wait_seconds=45))
        return stack.tasks.apply(lambda tasks: seen.update(tasks=tasks))

    program()
    inputs = request_inputs(monitor.requests["s-deploy"])
    assert is_secret(inputs["stdin"]) and inputs["stdin"]["value"] == COMPOSE
    assert "--timeout 45" in inputs["create"]
    assert seen["tasks"]["waitingForGpus"] == [{"service": "smoke_gpu", "task": 2, "reason": NO_GPU}]
    asyncio.set_event_loop(asyncio.new_event_loop())
