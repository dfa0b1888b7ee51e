"""The runtime guard's ledger: a GPU (or slot) that a running container holds is never given to another.

Real sh front, real files, real processes: the delegate stands in for runc, writing runc's
state.json (init pid and start time) for a live `sleep` per container, as runc does for the
container's init. A container "ends" as it does on a node: containerd removes its bundle, or
its init process dies (a crash) and only files are left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.node_contract import GPU_HELD

REPO = Path(__file__).resolve().parent.parent
FRONT = REPO / "node" / "gpu-swarm-runtime"
A = "GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb"
B = "GPU-558ebd1d-bf3c-6536-ecae-e740b71254de"
WHOLE, SHARED = f"DOCKER_RESOURCE_NVIDIA-GPU", f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED"

FAKE_RUNC = """#!{python}
# runc's part of a create: the container's init (a sleep), and its state where runc keeps it.
import json, os, subprocess, sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if "create" in args:
    root = args[args.index("--root") + 1]
    init = subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not holding our pipes
    with open(f"/proc/{{init.pid}}/stat") as f:
        start = int(f.read().rpartition(")")[2].split()[19])
    os.makedirs(f"{{root}}/{{args[-1]}}", exist_ok=True)
    with open(f"{{root}}/{{args[-1]}}/state.json", "w") as f:
        json.dump({{"id": args[-1], "init_process_pid": init.pid, "init_process_start": start}}, f,
                  separators=(",", ":"))
    with open({pids!r}, "a") as f:
        f.write(f"{{init.pid}}\\n")
"""


class Node:
    """A GPU node's runtime files under tmp: settings, ledger, runc's root, one bundle per container."""

    def __init__(self, tmp: Path, **settings: str):
        self.tmp, self.root, self.ledger = tmp, tmp / "runc", tmp / "run" / "gpu-swarm" / "claims"
        self.calls, self.pids = tmp / "calls.jsonl", tmp / "inits"
        delegate = tmp / "runc-standin"
        delegate.write_text(FAKE_RUNC.format(python=sys.executable, calls=str(self.calls), pids=str(self.pids)))
        delegate.chmod(0o755)
        self.config = tmp / "runtime.env"
        values = {"DELEGATE": str(delegate), "GUARD": str(REPO / "node" / "gpu_guard.py"),
                  "GUARD_PYTHON": sys.executable, "KIND": "NVIDIA-GPU", "SHARED_KIND": "", "SLOTS_PER_GPU": "0",
                  "GPUS": f"{A},{B}", "ALLOW_DOCKER_RUN_GPUS": "true", "LEDGER": str(self.ledger), **settings}
        self.config.write_text("".join(f"{k}={v}\n" for k, v in values.items()))

    def bundle(self, container: str) -> Path:
        return self.tmp / "bundles" / container

    def args(self, container: str) -> list[str]:
        return ["sh", str(FRONT), "--gpu-swarm-config", str(self.config), "--root", str(self.root), "--log",
                str(self.tmp / f"{container}.log"), "--log-format", "json", "create", "--bundle",
                str(self.bundle(container)), "--pid-file", str(self.tmp / f"{container}.pid"), container]

    def prepare(self, container: str, *env: str) -> None:
        self.bundle(container).mkdir(parents=True, exist_ok=True)
        spec = {"ociVersion": "1.1.0", "process": {"args": ["sleep", "1"], "env": ["NVIDIA_VISIBLE_DEVICES=all", *env]},
                "root": {"path": "rootfs"}}
        (self.bundle(container) / "config.json").write_text(json.dumps(spec, separators=(",", ":")))

    def create(self, container: str, *env: str) -> subprocess.CompletedProcess:
        self.prepare(container, *env)
        return subprocess.run(self.args(container), capture_output=True, text=True, timeout=60)

    def create_at_once(self, names: list[str], *env: str) -> list[int]:
        """Each container's create started at the same moment; their exit codes, in order."""
        for name in names:
            self.prepare(name, *env)
        procs = [subprocess.Popen(self.args(name), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name in names]
        codes = [p.wait(60) for p in procs]
        for p in procs:
            p.communicate()
        return codes

    def created(self) -> list[str]:
        lines = self.calls.read_text().splitlines() if self.calls.exists() else []
        return [json.loads(line)[-1] for line in lines]

    def claims(self) -> dict[str, str]:
        lines = self.ledger.read_text().splitlines() if self.ledger.exists() else []
        return {line.split("\t")[0]: line.split("\t")[1] for line in lines}

    def init_of(self, container: str) -> int:
        return json.loads((self.root / container / "state.json").read_text())["init_process_pid"]

    def remove(self, container: str) -> None:
        """What containerd does when the task is deleted: the bundle goes (runc delete removes its state)."""
        os.kill(self.init_of(container), signal.SIGKILL)
        shutil.rmtree(self.root / container)
        shutil.rmtree(self.bundle(container))

    def kill_inits(self) -> None:
        for pid in (self.pids.read_text().split() if self.pids.exists() else []):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def node(tmp_path):
    made = Node(tmp_path)
    yield made
    made.kill_inits()


def refused(result: subprocess.CompletedProcess, holder: str, what: str) -> bool:
    return result.returncode == 1 and f"gpu-swarm guard: {what} {GPU_HELD} {holder[:12]}" in result.stderr \
        and "never given to another" in result.stderr and "the container was not started" in result.stderr \
        and "If both reserved it, swarm gave it twice, as its scheduler does after a leader change" in result.stderr


def test_a_gpu_a_running_container_holds_is_refused_to_a_second_whatever_its_environment_says(node):
    assert node.create("reserving", f"{WHOLE}={A}").returncode == 0
    sneaky = node.create("sneaky", f"{WHOLE}={A}")  # set by the service itself: one entry, as swarm's would be
    assert refused(sneaky, "reserving", f"GPU {A}"), sneaky.stderr
    assert node.created() == ["reserving"] and node.claims() == {A: "reserving"}
    log = [json.loads(line) for line in (node.tmp / "sneaky.log").read_text().splitlines()]
    assert log[0]["level"] == "error" and f"GPU {A} is held" in log[0]["msg"]  # where containerd reads it


def test_a_free_gpu_named_by_the_variable_alone_is_given_and_then_held(node):
    """The guard cannot tell that variable from swarm's on a worker (README "Isolation"): the GPU is
    free, so it is given, and recorded; the reserving task swarm places on it next is refused, names the
    holder, and swarm starts it again elsewhere. Never two holders."""
    assert node.create("squatter", f"{WHOLE}={B}").returncode == 0
    legit = node.create("legit", f"{WHOLE}={B}")
    assert refused(legit, "squatter", f"GPU {B}") and "reserve GPUs with generic_resources" in legit.stderr


def test_the_claim_ends_with_its_container(node):
    assert node.create("first", f"{WHOLE}={A}").returncode == 0
    node.remove("first")
    assert node.create("second", f"{WHOLE}={A}").returncode == 0
    assert node.claims() == {A: "second"}


def test_a_crashed_container_leaves_no_claim(node):
    """Its init died, and nobody ran delete: the bundle and runc's state are still there."""
    assert node.create("crashed", f"{WHOLE}={A}").returncode == 0
    os.kill(node.init_of("crashed"), signal.SIGKILL)
    time.sleep(0.2)  # the init is reaped (its parent, the delegate, is gone: init adopts it)
    assert node.bundle("crashed").is_dir() and (node.root / "crashed" / "state.json").exists()
    assert node.create("next", f"{WHOLE}={A}").returncode == 0
    assert node.claims() == {A: "next"}


@pytest.mark.parametrize("age, held", [(5, True), (300, False)])
def test_a_claim_whose_create_is_still_under_way_holds_for_a_while(node, age, held):
    """Between the claim and runc's state.json there is no init to look at: the bundle holds it."""
    node.prepare("starting")
    node.ledger.parent.mkdir(parents=True)
    node.ledger.write_text(f"{A}\tstarting\t{node.root}\t{node.bundle('starting')}\t{int(time.time()) - age}\n")
    result = node.create("other", f"{WHOLE}={A}")
    assert refused(result, "starting", f"GPU {A}") if held else result.returncode == 0


def test_the_same_container_created_again_keeps_its_claim(node):
    assert node.create("again", f"{WHOLE}={A}").returncode == 0
    assert node.create("again", f"{WHOLE}={A}").returncode == 0
    assert node.ledger.read_text().count("\n") == 1


def test_every_gpu_of_a_task_is_claimed(node):
    assert node.create("two", f"{WHOLE}={A},{B}").returncode == 0
    assert refused(node.create("one", f"{WHOLE}={B}"), "two", f"GPU {B}")
    assert node.claims() == {A: "two", B: "two"}


def test_slots_are_claimed_one_by_one(tmp_path):
    node = Node(tmp_path, SHARED_KIND="NVIDIA-GPU-SHARED", SLOTS_PER_GPU="4")
    try:
        assert node.create("s0", f"{SHARED}={A}-s0").returncode == 0
        assert node.create("s1", f"{SHARED}={A}-s1").returncode == 0
        assert refused(node.create("again", f"{SHARED}={A}-s0"), "s0", f"slot {A}-s0")
        assert node.claims() == {f"{A}-s0": "s0", f"{A}-s1": "s1"}
    finally:
        node.kill_inits()


def test_creates_at_the_same_moment_give_a_gpu_to_exactly_one(node):
    for round_ in range(3):
        names = [f"r{round_}c{i}" for i in range(8)]
        codes = node.create_at_once(names, f"{WHOLE}={A}")
        assert sorted(codes) == [0] + [1] * 7, codes
        (winner,) = [n for n, c in zip(names, codes) if c == 0]
        assert node.claims() == {A: winner} and node.created()[-1] == winner
        node.remove(winner)


def test_a_container_without_gpus_never_touches_the_ledger(node):
    assert node.create("plain").returncode == 0
    assert not node.ledger.exists() and not node.ledger.parent.exists()


def test_a_damaged_ledger_fails_closed(node):
    node.ledger.parent.mkdir(parents=True)
    node.ledger.write_text("half a line\n")
    result = node.create("c", f"{WHOLE}={A}")
    assert result.returncode == 1 and "is not a claim" in result.stderr and node.created() == []


def test_settings_without_a_ledger_give_no_gpu(node):
    node.config.write_text(node.config.read_text().replace(f"LEDGER={node.ledger}\n", ""))
    result = node.create("c", f"{WHOLE}={A}")
    assert result.returncode == 1 and "has no LEDGER" in result.stderr and node.created() == []


# ---------------------------------------------------------------- an MPS pool's daemons


@pytest.fixture
def mps(tmp_path):
    made = Node(tmp_path, SHARED_KIND="NVIDIA-GPU-SHARED", SLOTS_PER_GPU="4", SHARING="mps",
                MPS_DIR=str(tmp_path / "mps"), MPS_MEMORY_MIB="19968", MPS_THREAD_PERCENT="25")
    yield made
    made.kill_inits()


def start_fake_mps_daemon(mps: Node, gpu: str) -> subprocess.Popen:
    """A process with the control daemon's name, and its pid file where the daemon writes it."""
    binary = mps.tmp / "nvidia-cuda-mps-control"
    if not binary.exists():
        shutil.copy(shutil.which("sleep"), binary)
    daemon = subprocess.Popen([str(binary), "600"])
    pipe = mps.tmp / "mps" / gpu / "pipe"
    pipe.mkdir(parents=True, exist_ok=True)
    (pipe.parent / "daemon.pid").write_text(f"{daemon.pid}\n")
    return daemon


def start_fake_relay(mps: Node) -> subprocess.Popen:
    """A process that names itself as mps_relay.py does (its pid file), with its name in its command line."""
    binary = mps.tmp / "mps_relay"
    if not binary.exists():
        shutil.copy(shutil.which("sleep"), binary)
    relay = subprocess.Popen([str(binary), "600"])
    (mps.tmp / "mps").mkdir(exist_ok=True)
    (mps.tmp / "mps" / "relay.pid").write_text(f"{relay.pid}\n")
    return relay


def test_an_mps_slot_starts_only_while_its_gpus_daemon_and_the_relay_run(mps):
    result = mps.create("early", f"{SHARED}={A}-s0")
    assert result.returncode == 1 and "the MPS relay of this node" in result.stderr
    relay = start_fake_relay(mps)
    result = mps.create("early2", f"{SHARED}={A}-s0")
    assert result.returncode == 1 and f"the MPS control daemon of {A} is not running" in result.stderr
    daemon = start_fake_mps_daemon(mps, A)
    try:
        assert mps.create("ok", f"{SHARED}={A}-s0").returncode == 0
        spec = json.loads((mps.bundle("ok") / "config.json").read_text())
        pipe = str(mps.tmp / "mps" / A / "pipe")
        assert [m["source"] for m in spec["mounts"]] == [str(mps.tmp / "mps" / A / "tasks")]
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in spec["process"]["env"]
        relay.kill()
        relay.wait()
        result = mps.create("no-relay", f"{SHARED}={A}-s1")
        assert result.returncode == 1 and "the MPS relay of this node" in result.stderr
        relay = start_fake_relay(mps)
    finally:
        daemon.kill()
        daemon.wait()
    try:
        result = mps.create("late", f"{SHARED}={A}-s1")
        assert result.returncode == 1 and "not running" in result.stderr
        assert mps.created() == ["ok"]
    finally:
        relay.kill()
        relay.wait()


def test_a_pid_file_left_by_a_dead_daemon_is_not_a_daemon(mps):
    pipe = mps.tmp / "mps" / A / "pipe"
    pipe.mkdir(parents=True)
    (pipe.parent / "daemon.pid").write_text(f"{os.getpid()}\n")  # a live process, but not MPS's
    relay = start_fake_relay(mps)
    try:
        assert "the MPS control daemon of" in mps.create("c", f"{SHARED}={A}-s0").stderr
    finally:
        relay.kill()
        relay.wait()
