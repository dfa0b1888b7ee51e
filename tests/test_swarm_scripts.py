"""The swarm builders: refused values, shellcheck, and their decisions run in real bash.

A fake `docker` on PATH keeps a node's swarm state in files and records every call, so the
paths that a healthy rehearsal never takes (a peer's swarm to join, a second swarm refused,
a node stranded in a dead swarm) run here. The rehearsal runs the same scripts for real.
"""
from __future__ import annotations

import http.server
import json
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from swarm import formation, reconcile, rollout, stacks
from swarm.script import JOIN_WITH_TOKEN, script
from tests.tools import require_tool

NODE_ID = "abcdefghijklmnopqrstuvwxy"
CLUSTER = "clusteraaaaaaaaaaaaaaaaaa"
OTHER_CLUSTER = "clusterbbbbbbbbbbbbbbbbbb"
SOFTWARE = "a" * 64
KIND = "NVIDIA-GPU"


def all_scripts() -> dict[str, str]:
    return {
        "probe": formation.probe_manager(),
        "init-alone": formation.init_swarm("10.0.0.5"),
        "init-peers": formation.init_swarm("10.0.0.5", peers=["10.0.0.6", "10.0.0.7"]),
        "tokens": formation.read_join_tokens(CLUSTER),
        "join": formation.join_swarm(role="worker", managers=["10.0.0.5"], advertise_addr="10.0.1.7",
                                     expected_cluster=CLUSTER),
        "leave": formation.leave_swarm(),
        "cordon": rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE),
        "admit": rollout.admit_node(NODE_ID, {"gpu-swarm.pool": "h100"}, expected_gpus=8, kind=KIND,
                                    software=SOFTWARE),
        "reconcile": reconcile.reconcile(nodes=[NODE_ID], stacks=["smoke"]),
        "deploy": stacks.deploy_stack("smoke", SOFTWARE),
        "rm": stacks.remove_stack("smoke"),
    }


@pytest.mark.parametrize("call, message", [
    (lambda: formation.init_swarm("10.0.0.500"), "expected an IP address"),
    (lambda: formation.init_swarm("10.0.0.1; rm -rf /"), "expected an IP address"),
    (lambda: formation.init_swarm("10.0.0.1", peers=["manager-2"]), "expected an IP address"),
    (lambda: formation.init_swarm("10.0.0.1", address_pool="10.0.0.0/26"), "larger than its /24"),
    (lambda: formation.read_join_tokens("$(reboot)"), "25-character swarm cluster ID"),
    (lambda: formation.join_swarm(role="boss", managers=["10.0.0.1"], advertise_addr="10.0.0.2",
                                  expected_cluster=CLUSTER), "role must be"),
    (lambda: formation.join_swarm(role="worker", managers=[], advertise_addr="10.0.0.2",
                                  expected_cluster=CLUSTER), "at least one manager"),
    (lambda: formation.join_swarm(role="worker", managers=["manager"], advertise_addr="10.0.0.2",
                                  expected_cluster=CLUSTER), "expected an IP address"),
    (lambda: rollout.cordon_node(NODE_ID, pool="H100 pool", software=SOFTWARE), "pool name"),
    (lambda: rollout.cordon_node(NODE_ID, pool="h100", software="latest"), "sha256 hex digest"),
    (lambda: rollout.admit_node("node-1", {}, expected_gpus=0, kind=KIND, software=SOFTWARE),
     "25-character swarm node ID"),
    (lambda: rollout.admit_node(NODE_ID, {"bad key": "x"}, expected_gpus=0, kind=KIND, software=SOFTWARE),
     "label key"),
    (lambda: rollout.admit_node(NODE_ID, {}, expected_gpus=1, kind="NVIDIA GPU", software=SOFTWARE),
     "invalid GPU resource kind"),
    (lambda: reconcile.reconcile(nodes=["$(reboot)"], stacks=[]), "25-character swarm node ID"),
    (lambda: reconcile.reconcile(nodes=[], stacks=["x;y"]), "is not valid"),
    (lambda: stacks.deploy_stack("My Stack", SOFTWARE), "stack name 'My Stack' is not valid"),
    (lambda: stacks.deploy_stack("smoke", "abc"), "sha256 hex digest of the compose file"),
    (lambda: stacks.remove_stack("x;y"), "is not valid"),
])
def test_bad_values_are_refused_before_any_shell_is_built(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_script_passes_shellcheck():
    require_tool("shellcheck")
    for name, text in all_scripts().items():
        proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}"


def test_secrets_never_appear_in_scripts():
    for name, text in all_scripts().items():
        assert "SWMTKN" not in text, name
    assert "IFS= read -r token" in all_scripts()["join"]


def test_label_values_with_shell_metacharacters_are_quoted():
    text = rollout.admit_node(NODE_ID, {"gpu-swarm.pool": "a b;c"}, expected_gpus=0, kind=KIND, software=SOFTWARE)
    assert "--label-add 'gpu-swarm.pool=a b;c'" in text


def test_live_peers_keeps_only_managers_of_a_swarm_with_a_token():
    answers = [
        json.dumps({"state": "active", "manager": True, "cluster_id": CLUSTER, "address": "10.0.0.6",
                    "token": "SWMTKN-1-x"}),
        json.dumps({"state": "inactive", "manager": False}),
        json.dumps({"state": "active", "manager": True, "address": "10.0.0.7", "token": ""}),
        "not json",
        "",
    ]
    assert formation.live_peers(answers) == "10.0.0.6 SWMTKN-1-x\n"


def test_advertised_gpus_reads_node_inspect_json():
    text = json.dumps([
        {"NamedResourceSpec": {"Kind": KIND, "Value": "GPU-b"}},
        {"NamedResourceSpec": {"Kind": "OTHER", "Value": "x"}},
        {"DiscreteResourceSpec": {"Kind": KIND, "Value": 2}},
        {"NamedResourceSpec": {"Kind": KIND, "Value": "GPU-a"}},
    ])
    assert rollout.advertised_gpus(text, KIND) == ["GPU-a", "GPU-b"]
    assert rollout.advertised_gpus("null\n", KIND) == []


# ---------------------------------------------------------------- decisions, in real bash

FAKE_DOCKER = r"""#!/usr/bin/env bash
# A node's engine, reduced to the swarm state the scripts ask about. Files in $FAKE:
# state, control, cluster, node, and `down` when the engine does not answer. Joins do not
# come here: they go to the Engine API (FakeEngine), as swarm_join sends them.
echo "docker $*" >>"$FAKE/calls"
[ ! -e "$FAKE/down" ] || exit 1
get() { cat "$FAKE/$1" 2>/dev/null || echo "${2:-}"; }
case "$1 $2" in
  "info --format")
    case "$3" in
      *LocalNodeState*) get state inactive ;;
      *ControlAvailable*) get control false ;;
      *Cluster.ID*) get cluster ;;
      *NodeID*) get node ;;
      *NodeAddr*) echo 10.0.0.6 ;;
      *DockerRootDir*) echo "$FAKE/root" ;;
    esac ;;
  "swarm init") echo active >"$FAKE/state"; echo true >"$FAKE/control"; echo "$FAKE_NEW_CLUSTER" >"$FAKE/cluster"
                echo newnode >"$FAKE/node" ;;
  "swarm join") echo "a token on the command line: use the Engine API" >&2; exit 1 ;;
  "swarm leave") echo inactive >"$FAKE/state"; echo false >"$FAKE/control"; rm -f "$FAKE/cluster" ;;
  "swarm join-token") echo "SWMTKN-1-$4-token" ;;
  "node ls") case "$*" in *--format*) get nodes ;; *-q*) get pool ;; esac ;;  # nodes: "ID Status Hostname" lines
  # The reconcile's removals: pool (labelled node IDs), tasks-ID (what runs on a node until it
  # is drained), stack-TASK (a task's stack), markers (the stacks' marker configs).
  "node inspect") case "$*" in  # availability, label-<name> (a node label), resources
      *Availability*) get availability active ;;
      *Spec.Labels*) l="$*"; l=${l#*Labels \"}; get "label-${l%%\"*}" ;;
      *GenericResources*) get resources null ;;
      *Status.State*) get "status-${!#}" ready ;;
      *) echo worker ;;
    esac ;;
  "node update") case "$*" in *"--availability drain"*) : >"$FAKE/drained-${!#}" ;; esac ;;
  # states-ID: the current states of a node's tasks; a drained task shows Running until it exits.
  "node ps") case "$*" in *CurrentState*) get "states-$3" ;; *) [ -e "$FAKE/drained-$3" ] || get "tasks-$3" ;; esac ;;
  "node rm") ;;
  # grace-ID: a task's stop_grace_period in ns (null: it sets none); stack-ID: a task's stack.
  "inspect --type") case "$*" in *StopGracePeriod*) for id in "${@:6}"; do get "grace-$id" null; done ;; *) get "stack-$6" ;; esac ;;
  "config ls") get markers ;;
  "config inspect") [ -e "$FAKE/marker-$3" ] || exit 1 ;;
esac
"""
# The worker's certificate says which swarm issued it; openssl reads it from the data root.
FAKE_OPENSSL = r"""#!/usr/bin/env bash
echo "subject=O = $(cat "$FAKE/cluster" 2>/dev/null), OU = swarm-worker, CN = x"
"""
# Every other program the scripts (and the fakes) run: the real one, behind a wrapper that
# records its command line. PATH holds only these and the fakes, so nothing runs unrecorded.
REAL_TOOLS = {"bash": shutil.which("bash"), "cat": shutil.which("cat"), "rm": shutil.which("rm"),
              "sed": shutil.which("sed"), "timeout": shutil.which("timeout"), "python3": sys.executable,
              "awk": shutil.which("awk"), "date": shutil.which("date"), "sleep": shutil.which("sleep"),
              "mktemp": shutil.which("mktemp"), "grep": shutil.which("grep"), "tr": shutil.which("tr"),
              "sort": shutil.which("sort"), "paste": shutil.which("paste"), "wc": shutil.which("wc")}
RECORD_ARGV = """#!/bin/sh
printf '%s\\n' "$0 $*" >>"$FAKE/argv"
exec {real} "$@"
"""
ALREADY_IN_A_SWARM = ('This node is already part of a swarm. Use "docker swarm leave" to leave this swarm and '
                      'join another one.')


class EngineApi(http.server.BaseHTTPRequestHandler):
    """POST /swarm/join as dockerd answers it: 200 and no body, or an error status and {"message"}."""

    def do_POST(self) -> None:
        node = self.server.node
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        node.record(f"POST {self.path}")
        node.requests.append({"path": self.path, "type": self.headers.get("Content-Type"), "body": json.loads(body)})
        request = node.requests[-1]["body"]
        if self.path != "/swarm/join":
            return self.answer(404, "page not found")
        if node.join_refusal:
            return self.answer(503, node.join_refusal)
        if node.get("state") == "active":
            return self.answer(503, ALREADY_IN_A_SWARM)
        node.set(state="active", cluster=node.join_cluster, node="joinednode",
                 control="true" if "manager" in request["JoinToken"] else "false")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def answer(self, status: int, message: str) -> None:
        data = json.dumps({"message": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, *args) -> None:
        pass


class FakeNode:
    def __init__(self, root: Path):
        self.dir = root / "node"
        self.bin = root / "bin"
        self.dir.mkdir()
        self.bin.mkdir()
        for name, body in (("docker", FAKE_DOCKER), ("openssl", FAKE_OPENSSL),
                           *((name, RECORD_ARGV.format(real=real)) for name, real in REAL_TOOLS.items())):
            (self.bin / name).write_text(body)
            (self.bin / name).chmod(0o755)
        self.requests: list[dict] = []
        self.join_refusal = ""  # the engine's message when it refuses every join
        self.join_cluster = CLUSTER
        # A short path: a unix socket's name has room for about 100 bytes.
        self.sock_dir = tempfile.mkdtemp(prefix="engine-")
        self.sock = f"{self.sock_dir}/docker.sock"
        self.engine = socketserver.ThreadingUnixStreamServer(self.sock, EngineApi)
        self.engine.node = self
        threading.Thread(target=self.engine.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.engine.shutdown()
        self.engine.server_close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def set(self, **files: str) -> None:
        for name, value in files.items():
            (self.dir / name).write_text(value + "\n")

    def get(self, name: str) -> str:
        path = self.dir / name
        return path.read_text().strip() if path.exists() else ""

    def record(self, line: str) -> None:
        with open(self.dir / "calls", "a") as f:
            f.write(line + "\n")

    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def joins(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["path"] == "/swarm/join"]

    def argv(self) -> str:
        """Every command line that ran, the script's own bash among them."""
        path = self.dir / "argv"
        return path.read_text() if path.exists() else ""

    def run(self, text: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
        full = {"PATH": str(self.bin), "FAKE": str(self.dir), "DOCKER_HOST": f"unix://{self.sock}",
                "FAKE_NEW_CLUSTER": "newclusteraaaaaaaaaaaaaaa", **env}
        return subprocess.run(["bash", "-c", text], input=stdin, capture_output=True, text=True, env=full, timeout=30)


@pytest.fixture
def fake(tmp_path):
    node = FakeNode(tmp_path)
    yield node
    node.close()


def free_loopback() -> str:
    """A loopback address whose port 2377 is free, so a test can play a manager there."""
    for last in range(2, 250):
        address = f"127.0.0.{last}"
        with socket.socket() as s:
            if s.connect_ex((address, 2377)) != 0:
                return address
    raise RuntimeError("no free loopback address")


def test_init_on_a_fresh_first_manager_with_no_peers_creates_the_swarm(fake):
    result = fake.run(formation.init_swarm("10.0.0.5"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"cluster_id": "newclusteraaaaaaaaaaaaaaa", "node_id": "newnode",
                                         "created": True}
    assert any("swarm init --advertise-addr 10.0.0.5 --default-addr-pool 10.200.0.0/16" in c for c in fake.calls())


def test_init_on_a_manager_already_in_the_swarm_changes_nothing(fake):
    fake.set(state="active", control="true", cluster=CLUSTER, node="oldnode")
    result = fake.run(formation.init_swarm("10.0.0.5", peers=["10.0.0.6"]), stdin="10.0.0.6 SWMTKN-1-manager-x\n")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["created"] is False
    assert not [c for c in fake.calls() if "swarm init" in c or "swarm/join" in c]


def test_a_new_first_manager_joins_the_swarm_its_peers_run(fake):
    """The replaced manager-0 of a 3-manager cluster: the other two still hold the swarm."""
    peers = "10.0.0.6 SWMTKN-1-manager-secret\n10.0.0.7 SWMTKN-1-manager-secret\n"
    result = fake.run(formation.init_swarm("10.0.0.5", peers=["10.0.0.6", "10.0.0.7"]), stdin=peers)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"cluster_id": CLUSTER, "node_id": "joinednode", "created": False}
    # What `docker swarm join --token T --advertise-addr 10.0.0.5 10.0.0.6:2377` would have asked.
    assert fake.requests == [{"path": "/swarm/join", "type": "application/json", "body": {
        "ListenAddr": "0.0.0.0:2377", "AdvertiseAddr": "10.0.0.5", "RemoteAddrs": ["10.0.0.6:2377"],
        "JoinToken": "SWMTKN-1-manager-secret", "Availability": "drain"}}]
    assert not [c for c in fake.calls() if "swarm init" in c]


def test_a_peer_that_answers_on_the_swarm_port_without_a_token_blocks_a_second_swarm(fake):
    peer = free_loopback()
    with socket.socket() as listener:
        listener.bind((peer, 2377))
        listener.listen()
        result = fake.run(formation.init_swarm("10.0.0.5", peers=[peer]), stdin="")
    assert result.returncode == 1
    assert f"manager {peer} runs a swarm" in result.stderr and "refusing to create a second swarm" in result.stderr
    assert not [c for c in fake.calls() if "swarm init" in c]


def test_peers_that_are_gone_let_the_first_manager_create_a_new_swarm(fake):
    peer = free_loopback()  # nothing listens there: that manager is gone too
    result = fake.run(formation.init_swarm("10.0.0.5", peers=[peer]), stdin="")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["created"] is True


def test_a_worker_in_the_expected_swarm_stays(fake):
    fake.set(state="active", control="false", cluster=CLUSTER, node=NODE_ID)
    script = formation.join_swarm(role="worker", managers=["10.0.0.5"], advertise_addr="10.0.1.7",
                                  expected_cluster=CLUSTER)
    result = fake.run(script, stdin="SWMTKN-1-worker-x\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == NODE_ID
    assert not [c for c in fake.calls() if "swarm/join" in c or "swarm leave" in c]


def test_a_worker_left_in_a_dead_swarm_leaves_it_and_joins_the_current_one(fake):
    fake.set(state="active", control="false", cluster=OTHER_CLUSTER, node="stale")
    script = formation.join_swarm(role="worker", managers=["10.0.0.5", "10.0.0.6"], advertise_addr="10.0.1.7",
                                  expected_cluster=CLUSTER)
    result = fake.run(script, stdin="SWMTKN-1-worker-x\n")
    assert result.returncode == 0, result.stderr
    assert f"in swarm {OTHER_CLUSTER}, not {CLUSTER}; leaving it" in result.stderr
    calls = fake.calls()
    assert "docker swarm leave --force" in calls
    assert calls.index("docker swarm leave --force") < calls.index("POST /swarm/join")
    assert result.stdout.strip() == "joinednode"
    assert fake.joins() == [{"ListenAddr": "0.0.0.0:2377", "AdvertiseAddr": "10.0.1.7",
                             "RemoteAddrs": ["10.0.0.5:2377"], "JoinToken": "SWMTKN-1-worker-x",
                             "Availability": "drain"}]


def test_a_join_tries_every_manager_and_fails_clearly_when_none_takes_it(fake):
    script = formation.join_swarm(role="worker", managers=["10.0.0.5", "10.0.0.6"], advertise_addr="10.0.1.7",
                                  expected_cluster=CLUSTER)
    fake.join_refusal = "rpc error: code = Unavailable desc = connection error"
    result = fake.run(script, stdin="SWMTKN-1-worker-x\n")
    assert result.returncode == 1
    assert "no manager took the join (10.0.0.5:2377 10.0.0.6:2377)" in result.stderr
    assert [r["RemoteAddrs"] for r in fake.joins()] == [["10.0.0.5:2377"], ["10.0.0.6:2377"]]
    # Each refusal is shown as the docker CLI shows it.
    refused = "Error response from daemon: rpc error: code = Unavailable desc = connection error\n"
    assert result.stderr.count(refused) == 2


def join_script(*managers: str) -> str:
    return formation.join_swarm(role="worker", managers=list(managers or ["10.0.0.5"]), advertise_addr="10.0.1.7",
                                expected_cluster=CLUSTER)


@pytest.mark.parametrize("scenario", ["init joins a peer", "a fresh worker", "a worker in a dead swarm",
                                      "every manager refuses", "the engine is gone"])
def test_the_token_is_on_no_command_line(fake, scenario):
    """Not in ps, not in /proc/<pid>/cmdline: every program the scripts run is recorded, and none
    was given the token, which still reached the engine."""
    token = "SWMTKN-1-3pu6hszjas19xyp7ghgosyx9k8atbfcr8p2is99znpy26u2lkl-1awxwuwd3z9j1z3puu7rcgdbx"
    text, stdin = join_script(), token + "\n"
    if scenario == "init joins a peer":
        text, stdin = formation.init_swarm("10.0.0.5", peers=["10.0.0.6"]), f"10.0.0.6 {token}\n"
    elif scenario == "a worker in a dead swarm":
        fake.set(state="active", control="false", cluster=OTHER_CLUSTER, node="stale")
    elif scenario == "every manager refuses":
        text, fake.join_refusal = join_script("10.0.0.5", "10.0.0.6"), "invalid join token"
    elif scenario == "the engine is gone":
        fake.close()
    result = fake.run(text, stdin=stdin)
    assert result.returncode == (0 if scenario in ("init joins a peer", "a fresh worker", "a worker in a dead swarm")
                                 else 1), result.stderr
    argv = fake.argv()
    assert "swarm_join" in argv and "python3 -I -c" in argv  # the recording saw the join's programs
    assert token not in argv and token not in result.stderr and token not in result.stdout
    assert all(join["JoinToken"] == token for join in fake.joins())
    assert len(fake.joins()) == {"every manager refuses": 2, "the engine is gone": 0}.get(scenario, 1)


def test_a_node_that_joined_meanwhile_is_refused_as_the_cli_refuses_it(fake):
    """Between the state check and the join, another join won: the engine says so, and so does the script."""
    fake.set(state="active")  # the engine's own state; docker info still says inactive below
    text = join_script().replace("state=$(docker info", "state=inactive; : $(docker info", 1)
    result = fake.run(text, stdin="SWMTKN-1-worker-x\n")
    assert result.returncode == 1
    assert f"Error response from daemon: {ALREADY_IN_A_SWARM}\n" in result.stderr
    assert "no manager took the join (10.0.0.5:2377)" in result.stderr


def test_a_join_with_no_engine_says_so_as_the_cli_does(fake):
    fake.close()
    result = fake.run(join_script(), stdin="SWMTKN-1-worker-x\n")
    assert result.returncode == 1
    assert f"Cannot connect to the Docker daemon at unix://{fake.sock}. Is the docker daemon running?" in result.stderr


@pytest.mark.parametrize("docker_host, sock", [(None, "/var/run/docker.sock"), ("unix:///run/n1/docker.sock",
                                                                                   "/run/n1/docker.sock")])
def test_the_join_asks_the_engine_that_docker_would(tmp_path, docker_host, sock):
    """dockerd's socket, or DOCKER_HOST's (the rehearsal's engines); asked of a python3 that only records."""
    from swarm.script import SWARM_JOIN
    (tmp_path / "python3").write_text('#!/bin/sh\necho "$@" >"$OUT"; cat >"$OUT.stdin"\n')
    (tmp_path / "python3").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
           **({"DOCKER_HOST": docker_host} if docker_host else {})}
    text = script(SWARM_JOIN, "token=SWMTKN-1-x", f"{JOIN_WITH_TOKEN} 10.0.1.7 10.0.0.5:2377")
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out").read_text().split()[-3:] == ["10.0.1.7", "10.0.0.5:2377", sock]
    assert (tmp_path / "out.stdin").read_text() == "SWMTKN-1-x\n"


def test_a_docker_host_that_is_no_unix_socket_is_refused(fake):
    result = fake.run(join_script(), stdin="SWMTKN-1-worker-x\n", DOCKER_HOST="tcp://10.0.0.9:2376")
    assert result.returncode == 1
    assert "DOCKER_HOST=tcp://10.0.0.9:2376 is not a unix socket, which the join needs" in result.stderr
    assert fake.requests == []


def test_a_join_without_a_token_fails_before_touching_the_engine(fake):
    script = formation.join_swarm(role="worker", managers=["10.0.0.5"], advertise_addr="10.0.1.7",
                                  expected_cluster=CLUSTER)
    result = fake.run(script, stdin="")
    assert result.returncode == 1 and "no join token on stdin" in result.stderr
    assert fake.calls() == []


def test_scripts_report_an_engine_that_does_not_answer(fake):
    fake.set(down="")
    for text, stdin in ((formation.init_swarm("10.0.0.5"), ""), (formation.leave_swarm(), ""),
                        (formation.join_swarm(role="worker", managers=["10.0.0.5"], advertise_addr="10.0.1.7",
                                              expected_cluster=CLUSTER), "SWMTKN-1-x\n")):
        result = fake.run(text, stdin=stdin)
        assert result.returncode == 1 and "cannot reach the Docker engine" in result.stderr


def test_tokens_are_read_only_from_the_expected_swarm(fake):
    fake.set(state="active", control="true", cluster=OTHER_CLUSTER)
    result = fake.run(formation.read_join_tokens(CLUSTER))
    assert result.returncode == 1 and f"expected {CLUSTER}" in result.stderr
    fake.set(cluster=CLUSTER)
    result = fake.run(formation.read_join_tokens(CLUSTER))
    assert json.loads(result.stdout) == {"worker": "SWMTKN-1-worker-token", "manager": "SWMTKN-1-manager-token"}


def test_probe_reports_a_node_without_docker_as_absent(fake, tmp_path):
    result = subprocess.run(["bash", "-c", formation.probe_manager()], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"})  # no docker at all: a node still booting
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"state": "absent", "manager": False}
    fake.set(state="active", control="true", cluster=CLUSTER)
    answer = json.loads(fake.run(formation.probe_manager()).stdout)
    assert answer == {"state": "active", "manager": True, "cluster_id": CLUSTER, "address": "10.0.0.6",
                      "token": "SWMTKN-1-manager-token"}


# ---------------------------------------------------------------- the post-join GPU check's verdict

A = "GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb"
B = "GPU-558ebd1d-bf3c-6536-ecae-e740b71254de"
ADVERTISED = json.dumps([{"NamedResourceSpec": {"Kind": KIND, "Value": u}} for u in (A, B)])


def verdict(reserved: str, unreserved: str, *, busy: bool = False, devices: bool = True, shared: str = "",
            advertised: str = ADVERTISED) -> dict:
    from swarm.gpu_check import GpuCheck, judge
    code = judge(shared or KIND, GpuCheck(devices=devices, shared_kind=shared), 1 if shared else 2)
    out = subprocess.run(["python3", "-", reserved, unreserved, advertised, "true" if busy else "false"],
                         input=code, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def smi(*uuids: str, devices: int = 0) -> str:
    return "".join(f"GPU {i}: NVIDIA H200 (UUID: {u})\n" for i, u in enumerate(uuids)) + \
        "".join(f"device /dev/nvidia{i}\n" for i in range(devices)) + "probe-end\n"


def test_the_check_passes_when_reserved_sees_all_and_unreserved_sees_none():
    result = verdict(smi(B, A, devices=2), "No devices were found\nprobe-end\n")
    assert result["verified"] is True and result["expected"] == [A, B]


@pytest.mark.parametrize("reserved, unreserved, what", [
    (smi(A, devices=1), "probe-end\n", "only one of two GPUs"),
    (smi(A, B, devices=2), smi(A, B, devices=2), "the unreserved task saw both"),
    (smi(A, B, devices=2), "probe-end\ndevice /dev/nvidia0\n", "a device node leaked"),
    (smi(A, B, devices=1), "probe-end\n", "a GPU without its device node"),
    (smi(A, "GPU-00000000-0000-0000-0000-000000000000", devices=2), "probe-end\n", "a GPU the node lacks"),
])
def test_the_check_fails_on_evidence(reserved, unreserved, what):
    assert verdict(reserved, unreserved)["verified"] is False, what


def test_a_gpu_line_without_a_uuid_still_counts_as_seen():
    result = verdict(smi(A, B, devices=2), "GPU 0: every GPU of the node (UUID: ALL)\nprobe-end\n")
    assert result["verified"] is False and result["unreserved_saw"] == ["GPU 0: every GPU of the node (UUID: ALL)"]


def test_busy_gpus_are_no_evidence_but_a_leak_still_is():
    assert verdict("", "probe-end\n", busy=True)["verified"] is None
    assert verdict("", smi(A), busy=True)["verified"] is False


def test_a_shared_node_proves_one_slot_is_one_of_its_gpus():
    advertised = json.dumps([{"NamedResourceSpec": {"Kind": "NVIDIA-GPU-SHARED", "Value": f"{u}-s{n}"}}
                             for u in (A, B) for n in range(4)])
    assert verdict(smi(B, devices=1), "probe-end\n", shared="NVIDIA-GPU-SHARED", advertised=advertised)["verified"]
    assert verdict(smi(A, B, devices=2), "probe-end\n", shared="NVIDIA-GPU-SHARED",
                   advertised=advertised)["verified"] is False


def test_the_rehearsal_has_no_device_nodes_and_says_so():
    assert verdict(smi(A, B), "probe-end\n", devices=False)["verified"] is True


def test_a_probe_that_did_not_run_to_its_end_proves_nothing():
    """Output without probe-end is a job that never ran, or logs not yet sent: neither half may pass on it."""
    cut = smi(A, B, devices=2).replace("probe-end\n", "")
    assert verdict(cut, "probe-end\n")["verified"] is False
    assert verdict(smi(A, B, devices=2), "")["verified"] is False
    assert verdict("", "", busy=True)["verified"] is False


# The check's jobs as a busy node shows them: the unreserved job completes, the reserving one stays
# pending; `docker node ps` lists the node's tasks (held-ids), each holding what task-<id> says.
CHECK_DOCKER = r"""#!/usr/bin/env bash
echo "$*" >>"$DIR/calls"
case "$1 $2" in
  "node inspect")
    case "$*" in
      *GenericResources*) cat "$DIR/advertised" ;;
      *Status.State*) echo "${NODE_STATUS:-ready}, ${NODE_AVAILABILITY:-active}, labels ${NODE_LABELS:-{\}}" ;;
      # active when the check begins; $LATER_AVAILABILITY from the second ask on (drained while checked)
      *Availability*) n=$(cat "$DIR/avail-asked" 2>/dev/null || echo 0); echo $((n + 1)) >"$DIR/avail-asked"
                      if [ "$n" -ge 1 ]; then echo "${LATER_AVAILABILITY:-active}"; else echo active; fi ;;
      *"json .Spec.Labels"*) echo "${NODE_LABELS:-{\}}" ;;
      *) echo "" ;;  # no label: never verified
    esac ;;
  "service ps")
    case "$*" in *--no-trunc*-none)
      echo "${NONE:-Complete} 3 minutes ago ${NONE_ERROR:-}"; exit ;; esac
    case "$*" in *--no-trunc*)
      if [ "${RESERVED:-}" = Complete ]; then echo "(task Complete 1 second ago )"
      else echo "(task Failed 1 second ago \"starting container failed: gpu-swarm guard\")"; fi; exit ;; esac
    for s in "${@:5}"; do
      case $s in *-none) echo "$s.1 ${NONE:-Complete} 1 second ago" ;; *-reserved) echo "$s.1 ${RESERVED:-Pending} 2 seconds ago" ;; esac
    done ;;
  "service logs")
    case "$*" in
      *-none*) echo probe-end ;;
      # The reserving job's logs: empty for the first $EMPTY asks, as a node that has not sent them yet answers.
      *-reserved*) n=$(cat "$DIR/asked" 2>/dev/null || echo 0); echo $((n + 1)) >"$DIR/asked"
                   if [ "$n" -ge "${EMPTY:-0}" ]; then cat "$DIR/reserved-logs" 2>/dev/null; fi ;;
    esac ;;
  "node ps") cat "$DIR/held-ids" ;;
  "inspect --type")
    # As dockerd 26 answers: a task's assigned resources are its GenericResources, a key that a task
    # without any lacks, so a plain field fails ("map has no entry for key").
    [ "$5" = '{{json (index . "GenericResources")}}' ] || { echo "template: map has no entry for key" >&2; exit 1; }
    for id in "${@:6}"; do cat "$DIR/task-$id"; echo; done ;;
esac
"""


def run_check(tmp_path, held: list[list[str]], *, units: int, shared: str = "", busy_after_s: int = 60,
              env: dict | None = None, ok: bool = True, logs_wait_s: int = 20, timeout_s: int = 120) -> dict:
    """verify_gpus on a node whose other tasks hold `held` (one list of resource values per task)."""
    from swarm.gpu_check import GpuCheck, verify_gpus
    from swarm.labels import node_label_function
    kind = shared or KIND
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text(CHECK_DOCKER)
    (tmp_path / "bin" / "docker").chmod(0o755)
    (tmp_path / "advertised").write_text(json.dumps(
        [{"NamedResourceSpec": {"Kind": kind, "Value": f"GPU-{i:08x}-0000-0000-0000-000000000000"}} for i in range(units)]))
    (tmp_path / "held-ids").write_text("".join(f"task{i}\n" for i in range(len(held))))
    for i, values in enumerate(held):
        (tmp_path / f"task-task{i}").write_text(json.dumps(
            [{"NamedResourceSpec": {"Kind": kind, "Value": v}} for v in values], separators=(",", ":")))
    check = GpuCheck(devices=False, shared_kind=shared, busy_after_s=busy_after_s, timeout_s=timeout_s,
                     logs_wait_s=logs_wait_s)
    lines = verify_gpus(NODE_ID, kind=KIND, count=1 if shared else units, release=SOFTWARE, check=check,
                        units=units)
    text = script(node_label_function(), *lines, 'printf "%s\\n" "$check"')
    proc = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "DIR": str(tmp_path), **(env or {})})
    assert (proc.returncode == 0) == ok, proc.stderr
    (tmp_path / "stderr").write_text(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}


def test_the_check_asks_again_for_logs_that_a_finished_job_has_not_sent_yet(tmp_path):
    """CI saw a whole-GPU node drained with "reserved": "" after its job completed: the logs came empty once."""
    gpu = "GPU-00000000-0000-0000-0000-000000000000"
    (tmp_path / "reserved-logs").write_text(f"GPU 0: stand-in (UUID: {gpu})\nprobe-end\n")
    result = run_check(tmp_path, [], units=1, env={"RESERVED": "Complete", "EMPTY": "3"})
    assert result["verified"] is True and result["reserved_saw"] == [gpu]
    assert (tmp_path / "asked").read_text().strip() == "4"


def test_a_job_the_guard_refused_for_a_held_gpu_finds_the_gpu_busy_not_the_node_broken():
    """CI: swarm gave the check's job a GPU whose container was still running; the guard refused it."""
    refused = ('(task Failed 11 seconds ago "starting container failed: ... gpu-swarm guard: GPU '
               f'{A} is held by container 2f9aecd8164d (since 00:12:21 UTC): a GPU that a running container '
               'holds is never given to another ...")')
    result = verdict(refused, "No devices were found\nprobe-end\n")
    assert result["verified"] is None and result["gpus_busy"] is True
    assert "container 2f9aecd8164d holds the GPU" in result["busy_because"]
    assert verdict(refused, smi(A))["verified"] is False  # a leak is still evidence


def test_a_completed_job_whose_output_never_comes_leaves_the_node_in_unverified(tmp_path):
    """CI, in a roll: the unreserved job completed and `docker service logs` answered empty for 10 s;
    the check took that for a failed probe and drained a healthy node."""
    result = run_check(tmp_path, [], units=1, env={"RESERVED": "Complete", "EMPTY": "1000"}, logs_wait_s=1)
    assert result["verified"] is None and result["unread"] == ["reserved"]
    calls = (tmp_path / "calls").read_text()
    assert "--availability drain" not in calls and "--label-add" not in calls  # neither drained nor verified
    assert "its output never reached this manager (docker service logs, 1 s)" in (tmp_path / "stderr").read_text()
    assert int((tmp_path / "asked").read_text()) >= 4  # asked again for the second it was given


def test_output_that_never_came_is_no_evidence_but_a_leak_still_is():
    unread = "\n(task Complete 11 seconds ago )"
    assert verdict(smi(A, B, devices=2), unread)["verified"] is None
    assert verdict(unread, "No devices were found\nprobe-end\n")["unread"] == ["reserved"]
    assert verdict(unread, smi(A))["verified"] is False
    assert verdict(smi(A, B, devices=2), "\n(task Failed 3 seconds ago \"exit 1\")")["verified"] is False


def test_a_reserving_job_that_never_ran_fails_the_check_with_its_tasks_error(tmp_path):
    result = run_check(tmp_path, [], units=1, env={"RESERVED": "Failed", "EMPTY": "1000"}, ok=False)
    assert result["check"]["verified"] is False
    assert "gpu-swarm guard" in result["check"]["evidence"]["reserved"]


def test_gpus_that_other_tasks_hold_end_the_checks_wait_at_once(tmp_path):
    """A roll gives a node back, and a task that waited for a GPU takes it before the check's job:
    the check reads the node's tasks and skips its reserving half at once, not after busy_after_s."""
    result = run_check(tmp_path, [["GPU-0"], ["GPU-1"]], units=2, busy_after_s=60)
    assert result["gpus_busy"] is True and result["busy_because"] == "held" and result["verified"] is None
    calls = (tmp_path / "calls").read_text()
    assert f"service rm gpu-swarm-check-{NODE_ID[:12]}-reserved" in calls


def test_a_check_that_never_ends_says_where_its_job_stopped_and_what_swarm_makes_of_the_node(tmp_path):
    """The rehearsal once saw the unreserved job on a node whose engine had just restarted never start;
    `up` then said only "did not finish in 180 s"."""
    run_check(tmp_path, [], units=1, ok=False, timeout_s=2, busy_after_s=1,
              env={"RESERVED": "Pending", "NONE": "Pending", "NONE_ERROR": "no suitable node (1 node not available)",
                   "NODE_STATUS": "down (heartbeat failure)"})
    stderr = (tmp_path / "stderr").read_text()
    assert (f"the GPU check jobs on node {NODE_ID} did not finish in 2 s: the job that reserves nothing is "
            "Pending 3 minutes ago no suitable node (1 node not available), and swarm has the node down (heartbeat "
            f"failure), active, labels {{}}; see docker service ps gpu-swarm-check-{NODE_ID[:12]}-none") in stderr
    assert "--availability drain" not in (tmp_path / "calls").read_text()  # no evidence against the node


def test_a_check_whose_node_was_drained_meanwhile_says_who_drained_it(tmp_path):
    """CI saw a ready node's unreserved job pending "1 node not available for new tasks" for 180 s: the
    message said only "ready". A node drained while its check runs says by whom, from its labels."""
    labels = '{"gpu-swarm.drained-by":"health","gpu-swarm.health":"unhealthy:gpu_lost"}'
    run_check(tmp_path, [], units=1, ok=False, timeout_s=2, busy_after_s=1,
              env={"RESERVED": "Pending", "NONE": "Pending", "NONE_ERROR": "no suitable node (1 node not available)",
                   "NODE_AVAILABILITY": "drain", "NODE_LABELS": labels})
    stderr = (tmp_path / "stderr").read_text()
    assert f"and swarm has the node ready, drain, labels {labels}; see docker service ps" in stderr

def test_a_node_drained_while_checked_ends_its_check_at_once_unverified_and_left_as_drained(tmp_path):
    """Its jobs can no longer start: the check says who took the node out (its labels), within seconds
    and not after timeout_s, does not drain or fail it, and reports it unverified."""
    labels = '{"gpu-swarm.drained-by":"health","gpu-swarm.health":"unhealthy:xid_79"}'
    started = time.monotonic()
    result = run_check(tmp_path, [], units=1, timeout_s=60, busy_after_s=30,
                       env={"RESERVED": "Pending", "NONE": "Pending", "LATER_AVAILABILITY": "drain",
                            "NODE_LABELS": labels})
    assert time.monotonic() - started < 20
    assert result["verified"] is None and result["note"] == "not checked: taken out of scheduling while checked"
    assert result["labels"]["gpu-swarm.drained-by"] == "health"
    calls = (tmp_path / "calls").read_text()
    assert "--availability drain" not in calls and "--label-add" not in calls
    assert f"service rm gpu-swarm-check-{NODE_ID[:12]}-reserved gpu-swarm-check-{NODE_ID[:12]}-none" in calls
    assert f"node {NODE_ID} was taken out of scheduling while its GPU check ran" in (tmp_path / "stderr").read_text()

def test_a_reserving_job_pending_with_nothing_held_waits_out_busy_after(tmp_path):
    result = run_check(tmp_path, [], units=2, busy_after_s=2)
    assert result["gpus_busy"] is True and result["busy_because"] == "still pending after 2 s"


@pytest.mark.parametrize("held, early", [([["GPU-0", "GPU-1"], ["GPU-2"]], False), ([["GPU-0", "GPU-1"], ["GPU-2", "GPU-3"]], True)])
def test_a_shared_node_is_busy_only_when_every_slot_is_held(tmp_path, held, early):
    result = run_check(tmp_path, held, units=4, shared="NVIDIA-GPU-SHARED", busy_after_s=2)
    assert result["busy_because"] == ("held" if early else "still pending after 2 s")


def test_a_shared_nodes_check_keeps_every_setting_it_was_given():
    from swarm.gpu_check import GpuCheck
    text = rollout.admit_node(NODE_ID, {}, expected_gpus=2, kind=KIND, software=SOFTWARE, slots_per_gpu=4,
                              shared_kind="NVIDIA-GPU-SHARED", check=GpuCheck(busy_after_s=8, timeout_s=90))
    assert "busy_at=$((SECONDS + 8))" in text and "end=$((SECONDS + 90))" in text
    assert "--generic-resource NVIDIA-GPU-SHARED=1" in text


def test_admit_with_the_check_passes_shellcheck():
    require_tool("shellcheck")
    from swarm.gpu_check import GpuCheck
    text = rollout.admit_node(NODE_ID, {"gpu-swarm.pool": "h100"}, expected_gpus=8, kind=KIND, software=SOFTWARE,
                              check=GpuCheck())
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- the reconcile's last word

WORKER_ID = "workeraaaaaaaaaaaaaaaaaaa"


def test_the_reconcile_waits_for_a_kept_node_that_reconnects_after_its_manager_restarted(fake):
    """A resized manager lists its workers as down until each reconnects: the reconcile waits it out."""
    fake.set(nodes=f"{NODE_ID} Ready manager-0\n{WORKER_ID} Down t4-0")
    threading.Timer(2, lambda: fake.set(nodes=f"{NODE_ID} Ready manager-0\n{WORKER_ID} Ready t4-0")).start()
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID, WORKER_ID], stacks=[], settle_timeout_s=20))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("reconciled")
    assert sum("docker node ls --format" in c for c in fake.calls()) >= 2  # it looked again, one list a round


def test_a_kept_node_that_stays_down_fails_the_reconcile_naming_it(fake):
    fake.set(nodes=f"{NODE_ID} Ready manager-0\n{WORKER_ID} Down t4-0\nzzzzzzzzzzzzzzzzzzzzzzzzz Down gone-0")
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID, WORKER_ID], stacks=[], settle_timeout_s=3))
    assert result.returncode == 1
    # Only the kept node is named: a node the program no longer has is not its business here.
    assert f"kept node(s) not ready: t4-0 ({WORKER_ID}, down)" in result.stderr, result.stderr
    assert "gone-0" not in result.stderr and "reconciled" not in result.stdout


def test_a_kept_node_whose_instance_aws_reports_stopped_is_said_and_not_waited_for(fake):
    """An operator's stop, or a spot node stopped on interruption: the node stays in the swarm, down; the
    reconcile neither removes it nor fails on it. Another kept node down still fails it."""
    fake.set(nodes=f"{NODE_ID} Ready manager-0\n{WORKER_ID} Down t4-0")
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID, WORKER_ID], stacks=[], settle_timeout_s=3,
                                          stopped=[WORKER_ID]))
    assert result.returncode == 0, result.stderr
    assert f"node {WORKER_ID} is kept, not waited for: AWS reports its instance stopped" in result.stderr
    assert result.stdout.strip().endswith("reconciled")
    assert not [c for c in fake.calls() if "node rm" in c or "availability drain" in c]
    fake.set(nodes=f"{NODE_ID} Ready manager-0\n{WORKER_ID} Down t4-0\nyyyyyyyyyyyyyyyyyyyyyyyyy Down t4-1")
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID, WORKER_ID, "yyyyyyyyyyyyyyyyyyyyyyyyy"], stacks=[],
                                          settle_timeout_s=3, stopped=[WORKER_ID]))
    assert result.returncode == 1 and "kept node(s) not ready: t4-1 (yyyyyyyyyyyyyyyyyyyyyyyyy, down)" in result.stderr


# A stand-in for the node's stack waiter (node/stack_settle.py): it records what it was asked, and
# exits as the file settle-exit says (the real one: 0 settled, 1 refused or out of time).
SETTLE_STUB = """import os, sys
for name in ("settled", "calls"):  # calls: in order with the docker CLI's
    with open(os.path.join(os.environ["FAKE"], name), "a") as f:
        f.write(("settle " if name == "calls" else "") + " ".join(sys.argv[1:]) + "\\n")
path = os.path.join(os.environ["FAKE"], "settle-exit")
code = int(open(path).read()) if os.path.exists(path) else 0
if code:
    print("gpu-swarm: stack a: infer task 1 was rejected and swarm will not start it again", file=sys.stderr)
sys.exit(code)
"""
GONE_ID = "goneaaaaaaaaaaaaaaaaaaaaa"


def removal(fake, tmp_path) -> dict:
    """A swarm with one node the program no longer has, running tasks of stacks a (twice), b and c,
    and one task of no stack; the program deployed stacks a and b (they have markers), not c."""
    fake.set(pool=f"{NODE_ID}\n{GONE_ID}", nodes=f"{NODE_ID} Ready manager-0", markers="",
             **{f"marker-{stacks.marker('a')}": "", f"marker-{stacks.marker('b')}": ""},
             **{f"tasks-{GONE_ID}": "t1\nt2\nt3\nt4\nt5"},
             **{"stack-t1": "a", "stack-t2": "b", "stack-t3": "a", "stack-t4": "", "stack-t5": "c"})
    software = tmp_path / "software"
    software.mkdir()
    (software / "stack_settle.py").write_text(SETTLE_STUB)
    return {"GPU_SWARM_SOFTWARE": str(software)}


def test_the_reconcile_waits_until_each_kept_stack_whose_tasks_moved_has_settled(fake, tmp_path):
    """Draining only stops a removed node's tasks; their replacements start elsewhere after the
    restart delay. `up` goes on once each kept stack that had a task there runs again."""
    env = removal(fake, tmp_path)
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID], stacks=["a", "b"], moved_timeout_s=42), **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("reconciled")
    assert fake.get("settled").splitlines() == ["--stack a --timeout 42", "--stack b --timeout 42"]
    calls = fake.calls()
    # The stacks were read before the drain, while the tasks were still on the node.
    assert max(i for i, c in enumerate(calls) if c.startswith("docker inspect --type task")) < \
        calls.index(f"docker node update --availability drain {GONE_ID}")
    assert f"docker node rm --force {GONE_ID}" in calls


def test_a_moved_stack_that_will_not_run_again_fails_the_reconcile_with_the_waiters_reason(fake, tmp_path):
    env = removal(fake, tmp_path)
    fake.set(**{"settle-exit": "1"})
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID], stacks=["a", "b"]), **env)
    assert result.returncode == 1
    assert "stack a: infer task 1 was rejected" in result.stderr, result.stderr
    assert fake.get("settled").splitlines() == ["--stack a --timeout 600"]  # it stopped at the first
    assert "reconciled" not in result.stdout


def stopping_until(fake, node: str, seconds: float) -> None:
    """A task of `node` that runs on through its stop_grace_period after the drain, for `seconds`."""
    fake.set(**{f"states-{node}": "Running 3 seconds ago\nShutdown 2 minutes ago"})
    threading.Timer(seconds, lambda: fake.set(**{f"states-{node}": "Shutdown 1 second ago"})).start()


def state_reads(fake, node: str) -> list[int]:
    return [i for i, c in enumerate(fake.calls()) if c.startswith(f"docker node ps {node} --format")]


def test_a_cordon_waits_until_the_drained_tasks_have_stopped(fake):
    """Drained tasks keep their containers, and their GPUs, through their stop_grace_period: the
    upgrade must not run under them, nor the GPU check want their GPUs."""
    stopping_until(fake, NODE_ID, 2.5)
    result = fake.run(rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("drained for its release")
    assert len(state_reads(fake, NODE_ID)) >= 2  # it read them again until the task was gone


def test_a_cordon_of_a_node_that_is_down_does_not_wait_for_what_it_cannot_report(fake):
    fake.set(**{f"status-{NODE_ID}": "down", f"states-{NODE_ID}": "Running 5 minutes ago"})
    result = fake.run(rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE, drain_timeout_s=2))
    assert result.returncode == 0, result.stderr
    assert state_reads(fake, NODE_ID) == []


def test_a_task_that_will_not_stop_fails_the_cordon_naming_the_node(fake):
    fake.set(**{f"states-{NODE_ID}": "Running 5 minutes ago"})
    result = fake.run(rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE, drain_timeout_s=2))
    assert result.returncode == 1
    assert f"tasks on node {NODE_ID} did not stop" in result.stderr, result.stderr


def test_a_task_with_a_long_stop_grace_period_is_given_it_before_the_cordon_gives_up(fake):
    """A stack that asks for 5 minutes to checkpoint gets them: the drain waits for its grace plus
    GRACE_SLACK_S, not only drain_timeout_s (here 2 s), which the task outlasts."""
    fake.set(**{f"tasks-{NODE_ID}": "ckpt1", "grace-ckpt1": str(300 * 10**9)})
    stopping_until(fake, NODE_ID, 3.5)
    result = fake.run(rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE, drain_timeout_s=2))
    assert result.returncode == 0, result.stderr
    assert "docker inspect --type task --format" in "\n".join(fake.calls())


def test_a_task_that_outlasts_its_own_grace_fails_the_cordon_saying_how_long_it_waited(fake):
    fake.set(**{f"tasks-{NODE_ID}": "t1 t2", "grace-t1": "null", "grace-t2": str(1 * 10**9),
                f"states-{NODE_ID}": "Running 5 minutes ago"})
    from swarm.rollout import GRACE_SLACK_S
    # A grace of 1 s plus the slack is the limit; the test does not wait that long: it reads the message
    # of a limit the script computed, with the slack made small.
    script_text = rollout.cordon_node(NODE_ID, pool="h100", software=SOFTWARE, drain_timeout_s=2)
    script_text = script_text.replace(f"grace + {GRACE_SLACK_S}", "grace + 2")
    result = fake.run(script_text)
    assert result.returncode == 1
    assert "did not stop (gave up after 3 s; the longest stop_grace_period among them is 1 s)" in result.stderr, \
        result.stderr


def test_the_reconcile_removes_a_node_only_once_its_tasks_have_stopped(fake, tmp_path):
    env = removal(fake, tmp_path)
    stopping_until(fake, GONE_ID, 2.5)
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID], stacks=["a", "b"]), **env)
    assert result.returncode == 0, result.stderr
    reads, calls = state_reads(fake, GONE_ID), fake.calls()
    assert len(reads) >= 2 and max(reads) < calls.index(f"docker node rm --force {GONE_ID}")


def test_no_node_removed_means_no_stack_is_waited_for(fake, tmp_path):
    env = removal(fake, tmp_path)
    fake.set(pool=NODE_ID)
    result = fake.run(reconcile.reconcile(nodes=[NODE_ID], stacks=["a", "b"]), **env)
    assert result.returncode == 0, result.stderr
    assert fake.get("settled") == ""


def test_wait_until_takes_a_limit_the_script_computed():
    """The drain's limit comes from its tasks' grace periods, on the node (wait_tasks_stopped)."""
    from swarm.script import script, wait_until
    text = script("limit=$(( 0 + 1 ))", *wait_until("false", "limit", "never held", interval_s=0.2, detail="why"))
    result = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "gpu-swarm: never held (gave up after 1 s; why)" in result.stderr
    with pytest.raises(ValueError, match="shell variable"):
        wait_until("false", "$limit", "never held")
