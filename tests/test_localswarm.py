"""Integration tests: a real swarm of namespaced dockerds with simulated GPUs.

They need root and a Docker Engine >= 25.0.3 (scripts/setup.sh installs one).
In CI (CI=true) a missing prerequisite fails the run instead of skipping it.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from localswarm import network, rehearsal as rehearsal_mod
from localswarm.host import RehearsalError
from localswarm.nodes import REGISTRY, RUN_ROOT, STATE_ROOT, Node, docker, run_script
from swarm import stacks
from tests.rehearsal_tools import (KIND, advertised, cli, cli_json, node_of, rehearsal_up, status, tasks_of,
                                   wait_for)

pytestmark = pytest.mark.integration



MANAGER = Node("node-1", 1, "manager")


@pytest.fixture(scope="module")
def rehearsal(engine):
    yield from rehearsal_up("--nodes", "3", "--gpus-per-node", "2")


def test_seven_one_gpu_replicas_on_six_gpus(rehearsal):
    """3 nodes x 2 GPUs, 7 one-GPU replicas: 6 run on distinct GPUs, 1 waits for resources."""
    tasks = tasks_of(rehearsal, "smoke_gpu")
    assert len(tasks) == 7
    running = [t for t in tasks if t["state"] == "running"]
    pending = [t for t in tasks if t["state"] == "pending"]
    assert len(running) == 6 and len(pending) == 1
    assert "insufficient resources" in pending[0]["reason"] == pending[0]["error"]
    pairs = [(t["node"], gpu) for t in running for gpu in t["gpus"]]
    assert all(len(t["gpus"]) == 1 for t in running)
    assert len(set(pairs)) == 6
    offered = advertised(rehearsal)
    assert all(gpu in offered[node] for node, gpu in pairs), "a task holds a GPU its node does not advertise"
    assert {n["name"]: n["role"] for n in rehearsal["nodes"]} == {
        "node-1": "manager", "node-2": "worker", "node-3": "worker"}
    timings = rehearsal["timings"]
    assert 0 < timings["nodes_ready_s"] <= timings["swarm_ready_s"] <= timings["stack_converged_s"]


def test_up_on_top_of_a_running_rehearsal_is_refused(rehearsal):
    proc = cli("up", check=False)
    assert proc.returncode == 1
    assert "down" in proc.stderr and "already up" in proc.stderr


def _service(engine, name: str, gpus: int, replicas: int, *extra: str) -> None:
    docker(MANAGER, engine, "service", "create", "--detach", "--name", name, "--replicas", str(replicas),
           "--generic-resource", f"{KIND}={gpus}", *extra, f"{REGISTRY}/gpu-swarm/standin:1")


def test_two_gpu_replica_lands_only_where_two_gpus_are_free(rehearsal, engine):
    docker(MANAGER, engine, "service", "scale", "--detach", "smoke_gpu=0")
    wait_for(lambda v: not tasks_of(v, "smoke_gpu"), 60, "smoke_gpu to scale to 0")
    # One GPU taken on node-1 and on node-2 leaves node-3 as the only node with two free.
    _service(engine, "one", 1, 2, "--constraint", "node.hostname!=node-3", "--replicas-max-per-node", "1")
    # "one" holds its GPUs before "two" asks: two services made at once race for node-1's and node-2's GPUs.
    wait_for(lambda v: sorted(t["state"] for t in tasks_of(v, "one")) == ["running", "running"], 60,
             "the 1-GPU tasks to run")
    _service(engine, "two", 2, 1)
    try:
        view = wait_for(lambda v: [t["state"] for t in tasks_of(v, "two")] == ["running"]
                        and sorted(t["state"] for t in tasks_of(v, "one")) == ["running", "running"],
                        60, "the 2-GPU task to run")
        (task,) = tasks_of(view, "two")
        assert task["node"] == "node-3"
        assert set(task["gpus"]) == advertised(view)["node-3"] and len(task["gpus"]) == 2
        # A second 2-GPU replica has nowhere to go: every node now has at most one free GPU.
        docker(MANAGER, engine, "service", "scale", "--detach", "two=2")
        view = wait_for(lambda v: any(t["state"] == "pending" and t["error"] for t in tasks_of(v, "two")),
                        60, "the second 2-GPU replica to be pending")
        pending = [t for t in tasks_of(view, "two") if t["state"] == "pending"]
        assert "insufficient resources" in pending[0]["error"]
    finally:
        docker(MANAGER, engine, "service", "rm", "one", "two")


def test_stopped_node_tasks_move_to_free_gpus_and_node_rejoins(rehearsal, engine):
    docker(MANAGER, engine, "service", "scale", "--detach", "smoke_gpu=3")
    view = wait_for(lambda v: sorted(t["state"] for t in tasks_of(v, "smoke_gpu")) == ["running"] * 3,
                    60, "3 smoke tasks to run")
    victim = next(t["node"] for t in tasks_of(view, "smoke_gpu") if t["node"] != "node-1")
    before = advertised(view)[victim]
    assert cli("node", "stop", victim).stdout.strip() == f"{victim}: engine stopped"
    started = time.monotonic()
    view = wait_for(
        lambda v: all(t["state"] == "running" and t["node"] not in ("", victim) for t in tasks_of(v, "smoke_gpu"))
        and len(tasks_of(v, "smoke_gpu")) == 3,
        90, f"tasks of {victim} to be rescheduled")
    moved_in = time.monotonic() - started
    pairs = {(t["node"], t["gpus"][0]) for t in tasks_of(view, "smoke_gpu")}
    assert len(pairs) == 3 and all(g in advertised(view)[n] for n, g in pairs)
    assert node_of(view, victim)["state"] == "down"
    assert moved_in < 90
    # The table says the down node's GPUs cannot be used, never that they are free.
    table = cli("status").stdout
    victim_rows = [line for line in table.splitlines() if line.startswith(victim + " ")]
    assert any("down" in line for line in victim_rows)
    assert [line for line in victim_rows if "GPU-" in line] and all(
        "unusable (node down)" in line for line in victim_rows if "GPU-" in line)

    assert json.loads(cli("node", "start", victim, "--json").stdout) == {"node": victim, "running": True}
    view = wait_for(lambda v: node_of(v, victim)["state"] == "ready", 60, f"{victim} to rejoin")
    assert advertised(view)[victim] == before


def test_redetection_alone_changes_what_the_swarm_sees_and_keeps_other_daemon_keys(rehearsal, engine):
    """The agent's unit restarts docker when it changed daemon.json; `node redetect` does the same."""
    daemon_json = STATE_ROOT / "node-2" / "daemon.json"
    before = json.loads(daemon_json.read_text())
    report = json.loads(cli("node", "redetect", "node-2", "--gpus", "3", "--json").stdout)
    assert report["changed"] is True and report["engine_restarted"] is True and len(report["gpus"]) == 3
    new = {g["uuid"] for g in report["gpus"]}
    view = wait_for(lambda v: advertised(v)["node-2"] == new, 60, "the swarm to see node-2's new GPUs")
    assert advertised(view)["node-2"] == new
    after = json.loads(daemon_json.read_text())
    for key in ("insecure-registries", "shutdown-timeout", "log-opts"):
        assert after[key] == before[key], f"the agent lost {key}"
    assert sorted(after["node-generic-resources"]) == sorted(f"{KIND}={u}" for u in new)
    # The same GPUs again (a reboot): nothing changes, no restart.
    again = cli("node", "redetect", "node-2").stdout
    assert again.strip() == "node-2: 3 GPU(s); daemon.json unchanged"


def test_stack_removed_and_redeployed_under_the_same_name(rehearsal, engine):
    """remove_stack waits until the stack's network is gone, so an immediate redeploy works."""
    text = json.loads((STATE_ROOT / "state.json").read_text())["stacks"]["smoke"]["text"]
    run_script(MANAGER, engine, stacks.remove_stack("smoke"))
    assert docker(MANAGER, engine, "network", "ls", "-q", "--filter",
                  "label=com.docker.stack.namespace=smoke").stdout.strip() == ""
    run_script(MANAGER, engine, stacks.deploy_stack("smoke", hashlib.sha256(text.encode()).hexdigest()), stdin=text)
    view = wait_for(lambda v: len([t for t in tasks_of(v, "smoke_gpu") if t["state"] == "running"]) >= 6,
                    60, "the redeployed stack to run")
    assert {n["state"] for n in view["nodes"]} == {"ready"}


def test_a_task_gpus_come_from_its_container_and_its_own_command_runs(rehearsal, engine):
    """The smoke stack's own command (sh -c 'nvidia-smi -L; exec sleep infinity') runs on the stand-in."""
    view = status()
    task = next(t for t in tasks_of(view, "smoke_gpu") if t["state"] == "running")
    assert task["gpus_from"] == "container" and len(task["gpus"]) == 1
    container = docker(MANAGER, engine, "ps", "-q", "--filter", "label=com.docker.swarm.service.name=smoke_gpu")
    node = MANAGER if container.stdout.strip() else next(
        Node(n["name"], int(n["name"].split("-")[1]), "worker") for n in view["nodes"] if n["name"] != "node-1")
    ids = docker(node, engine, "ps", "-q", "--filter", "label=com.docker.swarm.service.name=smoke_gpu").stdout.split()
    top = docker(node, engine, "top", ids[0]).stdout
    assert "sleep infinity" in top
    logs = docker(node, engine, "logs", ids[0]).stdout
    assert "GPU 0: Simulated GPU (UUID: GPU-" in logs


def test_node_commands_print_text_and_json_on_request(rehearsal):
    text = cli("node", "redetect", "node-3").stdout
    assert text == "node-3: 2 GPU(s); daemon.json unchanged\n"
    assert not text.lstrip().startswith("{")
    assert "gpus" in cli_json("node", "redetect", "node-3")
    assert cli("status", "--json").stdout.lstrip().startswith("{")


def test_down_removes_everything(engine):
    """Runs last in this module: the rehearsal fixture's own teardown then finds nothing to do."""
    cli("down")
    cli("up", "--nodes", "2", "--gpus-per-node", "1")
    pids_before = _our_processes()
    assert pids_before, "up started no processes?"
    cli("down")
    assert network.our_netns() == []
    assert network.BRIDGE not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert network.our_rules() == []
    assert _our_processes() == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(STATE_ROOT) not in mounts and str(RUN_ROOT) not in mounts
    assert not STATE_ROOT.exists() and not RUN_ROOT.exists()
    assert cli("down").returncode == 0  # a second down is harmless


def test_a_failed_up_leaves_nothing_behind_and_says_so(engine, tmp_path):
    """A stack that does not converge fails `up`; with --no-keep-on-failure everything it made is removed (by
    default such a swarm is kept to look at: tests/test_stacks_ending.py). The stack crash-loops, so it cannot
    settle however fast the engine starts tasks (Docker 28 settled the smoke stack within the 1 s asked)."""
    cli("down")
    crashing = tmp_path / "crashing.yml"
    crashing.write_text('services:\n  loop:\n    image: busybox\n    command: ["sh", "-c", "exit 1"]\n')
    with pytest.raises(RehearsalError) as err:
        rehearsal_mod.up(n_nodes=2, gpus=1, stacks=[str(crashing)], progress=lambda _: None, converge_timeout=0,
                         keep_on_failure=False)
    assert "did not settle" in str(err.value) and "Nothing is left behind" in str(err.value)
    assert network.our_netns() == [] and network.our_rules() == []
    assert _our_processes() == []
    assert not STATE_ROOT.exists() and not RUN_ROOT.exists()


def _our_processes() -> list[str]:
    """Live (non-zombie) processes whose command line or environment points into this lane's rehearsal
    folders (another lane's rehearsal, or a machine's own processes, may run beside it: localswarm/lane.py).
    The reconciler finds its node by DOCKER_HOST alone."""
    ours = re.compile("|".join(rf"{re.escape(str(root))}(?=[/\s=:]|$)" for root in (STATE_ROOT, RUN_ROOT)))
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (ours.search(cmdline) or ours.search(environ)) and "pytest" not in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found
