"""node/mps_relay.py, the only MPS socket a slot task reaches: a CUDA client's exact handshake passes, one client
at a time; control commands, descriptors, idle peers and floods never reach the daemon.

Real sockets: the relay runs as its own process (as gpu-swarm-mps starts it), in front of two daemons:
- FakeDaemon, a SOCK_SEQPACKET listener that speaks what an MPS control daemon spoke on driver 580
  (tests/data/mps-control-wire.json, written from bench/results/gpu-mps-wire/) and records what reaches it,
  with whose credentials; like the real one it serves one connection at a time and waits for each peer forever;
- the stand-in daemon and server (localswarm/standins/nvidia-cuda-mps-control, tests/mps_standin.py), with the
  failure modes measured on an H200: after each refused sequence both must still serve.
"""
import contextlib
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "node"))
import mps_relay  # noqa: E402
from contract import MPS_LAST_CLIENTS, MPS_RELAY_PER_CONTAINER  # noqa: E402
from tests import mps_standin  # noqa: E402

WIRE = json.loads((REPO / "tests" / "data" / "mps-control-wire.json").read_text())
HEX = bytes.fromhex
GPU = "GPU-a"


class FakeDaemon:
    """The control daemon's side of pipe/control, as recorded: every message it gets, with its sender's pid;
    one connection at a time, each peer waited for without a timeout, as the real daemon does."""

    def __init__(self, pipe: Path):
        self.got: list[tuple[bytes, int | None]] = []
        self.accepted = 0
        self.server_ends: list[socket.socket] = []  # the MPS server's end of each client's descriptor
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(pipe / "control"))
        self.sock.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._one(conn)

    def _one(self, conn: socket.socket):
        with conn, contextlib.suppress(OSError):  # the relay may cut a connection off mid-way
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            conn.sendmsg([HEX(WIRE["daemon_hello"])])
            while True:
                data, creds, fds, _ = mps_relay._receive(conn, 65536)
                if not data:
                    return
                self.got.append((data, creds[0] if creds else None))
                if data == HEX(WIRE["cuda_client"]["task"][1]):
                    ours, theirs = socket.socketpair()
                    self.server_ends.append(ours)
                    conn.sendmsg([HEX(WIRE["cuda_client"]["daemon_after_kind"])],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", theirs.fileno()))])
                    theirs.close()
                elif data == HEX("0000000000000000"):  # a command's end: the daemon answers and closes
                    for answer in WIRE["control_utility"]["daemon_answer"]:
                        conn.sendmsg([HEX(answer)])
                    return

    def received(self) -> list[str]:
        time.sleep(0.3)  # what was sent before the relay closed is still read, a moment later
        return [data.hex() for data, _ in self.got]


def start_relay(root: Path, *gpus: str, nofile: int | None = None, handshake_s: float | None = None):
    log = open(root / "relay.log", "a+")
    env = {**os.environ, **({"GPU_SWARM_MPS_HANDSHAKE_S": str(handshake_s)} if handshake_s else {})}
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    relay = subprocess.Popen([sys.executable, str(REPO / "node" / "mps_relay.py"), str(root), *(gpus or [GPU])],
                             stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=limit)
    for _ in range(100):
        if (root / "relay.pid").exists():
            break
        time.sleep(0.05)
    return relay


@pytest.fixture
def root():
    made = Path(tempfile.mkdtemp(prefix="relay", dir="/tmp"))  # socket paths stay under 108 bytes
    yield made
    shutil.rmtree(made)


def fake_daemon(root: Path) -> FakeDaemon:
    (root / GPU / "pipe").mkdir(parents=True)
    # the daemon's pid, as gpu-swarm-mps writes it: the relay reaches its pipe through /proc/<pid>/root
    (root / GPU / "daemon.pid").write_text(f"{os.getpid()}\n")
    return FakeDaemon(root / GPU / "pipe")


@pytest.fixture
def node(root):
    daemon = fake_daemon(root)
    relay = start_relay(root)
    yield root, daemon, relay
    relay.kill()
    relay.wait()
    daemon.sock.close()


def connect(root: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(root / GPU / "tasks" / "control"))
    assert sock.recv(64) == HEX(WIRE["daemon_hello"])
    return sock


def ended(sock: socket.socket) -> bool:
    """The relay closed the connection (nothing more comes)."""
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def relay_log(root: Path) -> str:
    time.sleep(0.2)
    return (root / "relay.log").read_text()


def cuda_client(root: Path) -> None:
    """A CUDA client's handshake, as libcuda makes it: it ends with a working connection to the server."""
    with connect(root) as sock:
        first, kind, done = WIRE["cuda_client"]["task"]
        sock.send(HEX(first))
        sock.send(HEX(kind))
        data, _, fds, _ = mps_relay._receive(sock)
        assert data == HEX(WIRE["cuda_client"]["daemon_after_kind"]) and len(fds) == 1
        with socket.socket(fileno=fds[0]) as server:
            server.send(b"ping")
        sock.send(HEX(done))


def test_a_cuda_client_reaches_its_server_with_its_own_credentials(node):
    root, daemon, relay = node
    connect(root).close()  # libcuda's first connection: it only looks, and closes
    cuda_client(root)
    time.sleep(0.2)
    assert daemon.received() == WIRE["cuda_client"]["task"]
    assert daemon.accepted == 1  # the first one never reached it: the relay greets a task itself
    # the kernel's credentials of the task's process, passed on: the daemon sees the client, not the relay
    assert {pid for _, pid in daemon.got} == {os.getpid()} and relay.pid != os.getpid()
    assert daemon.server_ends[0].recv(4) == b"ping"  # the descriptor the daemon handed over is the client's
    # who got it, for the health watcher: this process, in no container
    (last,) = [json.loads(line) for line in (root / GPU / MPS_LAST_CLIENTS).read_text().splitlines()]
    assert last["pid"] == os.getpid() and last["container"] is None and last["at"] <= time.time()


def test_clients_at_once_all_pass_one_at_a_time(node):
    root, daemon, _ = node
    threads = [threading.Thread(target=cuda_client, args=(root,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    time.sleep(0.2)
    assert len(daemon.server_ends) == 16 and len(daemon.got) == 16 * 3 and daemon.accepted == 16
    kept = (root / GPU / MPS_LAST_CLIENTS).read_text().splitlines()
    assert len(kept) == mps_relay.LAST_KEPT  # the last ones only


@pytest.mark.parametrize("command", sorted(WIRE["control_utility"]["commands"]))
def test_nvidia_cuda_mps_control_through_a_tasks_socket_is_refused_before_the_daemon_hears_of_it(node, command):
    root, daemon, _ = node
    sent = WIRE["control_utility"]["commands"][command]
    with connect(root) as sock:
        sock.send(HEX(sent[0]))
        sock.send(HEX(sent[1]))  # the control utility's kind
        assert ended(sock)
    assert daemon.received() == [] and daemon.accepted == 0  # not even a connection
    assert "it is nvidia-cuda-mps-control's (4): a control command" in relay_log(root)
    cuda_client(root)  # and the GPU's clients still pass
    assert len(daemon.server_ends) == 1


@pytest.mark.parametrize("after_kind", [
    ["2800000000000000", "7365745f6465766963655f70696e6e65645f6d656d5f6c696d697420343538203020323030470a00"],
    ["04000000", "00000000", "00000000"],  # more words than a client sends
])
def test_a_client_that_sends_more_after_its_kind_is_cut_off(node, after_kind):
    root, daemon, _ = node
    first, kind, _ = WIRE["cuda_client"]["task"]
    with connect(root) as sock:
        for message in (first, kind, *after_kind):
            try:
                sock.send(HEX(message))
            except (BrokenPipeError, ConnectionResetError):
                break
        deadline = time.monotonic() + 5
        while not ended(sock) and time.monotonic() < deadline:
            pass
    sent = daemon.received()
    assert sent == WIRE["cuda_client"]["task"][:2] or sent == []  # its handshake at most, never what came after
    assert "refused" in relay_log(root)


@pytest.mark.parametrize("first, said", [
    ("04000000", "not a client's"),  # no greeting: straight to a kind
    ("4f5554424352454400", "descriptors"),  # the greeting, with a descriptor of the task's: no client passes one
    ("4f55544243524544" + "00" * 100, "more than 64 bytes"),
])
def test_a_first_message_that_is_not_a_greeting_or_that_carries_descriptors_is_refused(node, first, said):
    root, daemon, _ = node
    with connect(root) as sock, open("/dev/null") as passed:
        if said == "descriptors":
            sock.sendmsg([HEX(first)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", passed.fileno()))])
        else:
            sock.send(HEX(first))
        assert ended(sock)
    assert daemon.received() == [] and daemon.accepted == 0
    assert said in relay_log(root)


def test_a_descriptor_with_the_last_word_is_refused(node):
    root, daemon, _ = node
    first, kind, done = WIRE["cuda_client"]["task"]
    with connect(root) as sock, open("/dev/null") as passed:
        sock.send(HEX(first))
        sock.send(HEX(kind))
        assert mps_relay._receive(sock)[0] == HEX(WIRE["cuda_client"]["daemon_after_kind"])
        sock.sendmsg([HEX(done)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", passed.fileno()))])
        assert ended(sock)
    assert daemon.received() == WIRE["cuda_client"]["task"][:2]  # never the word that carried it
    assert "with descriptors" in relay_log(root)


@pytest.mark.parametrize("sends", [[], ["4f5554424352454400"]])  # nothing; its greeting and then nothing
def test_an_idle_connection_never_reaches_the_daemon_and_ends_after_its_time(root, sends):
    """Measured on an H200: one idle connection held the daemon, and every neighbour's new client with it."""
    daemon = fake_daemon(root)
    relay = start_relay(root, handshake_s=1.5)
    try:
        idle = connect(root)
        for message in sends:
            idle.send(HEX(message))
        cuda_client(root)  # a neighbour, while it is held
        assert daemon.accepted == 1 and len(daemon.server_ends) == 1
        assert ended(idle)  # after the relay's 1.5 s
        assert daemon.accepted == 1 and "no client's handshake within 1.5 s" in relay_log(root)
    finally:
        relay.kill()
        relay.wait()
        daemon.sock.close()


def test_a_client_that_keeps_its_last_word_holds_the_daemon_for_a_second_at_most(node):
    root, daemon, _ = node
    first, kind, _ = WIRE["cuda_client"]["task"]
    with connect(root) as sock:
        sock.send(HEX(first))
        sock.send(HEX(kind))
        data, _, fds, _ = mps_relay._receive(sock)
        mps_standin.socket.socket(fileno=fds[0]).close()
        cuda_client(root)  # the next one gets its turn once the relay gives up on the word
        assert len(daemon.server_ends) == 2
    assert f"no last word within {mps_relay.FINAL_S:g} s" in relay_log(root)


FLOOD = r"""
import socket, sys, time
with open(sys.argv[1], "w") as f:  # a container of its own: another cgroup
    f.write(str(__import__("os").getpid()))
held, refused = [], 0
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(sys.argv[2])
        held.append(s)
    except BlockingIOError:
        refused += 1
        s.close()
        time.sleep(0.001)
print(len(held), refused, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def flood(root: Path, count: int):
    """COUNT idle connections from a process in a cgroup of its own (one container's), held while the block runs."""
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"):
        group = Path(base) / f"gpu-swarm-test-flood-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            break
        except OSError:
            continue
    else:
        raise AssertionError("no cgroup hierarchy to put the flooder in a cgroup of its own")
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, str(group / "cgroup.procs"),
                             str(root / GPU / "tasks" / "control"), str(count)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        held, refused = map(int, proc.stdout.readline().split())
        yield held, refused
    finally:
        proc.stdin.close()
        proc.wait(30)
        group.rmdir()


def test_a_flood_of_1000_idle_connections_from_one_container_leaves_its_neighbours_served(root):
    """The relay holds MPS_RELAY_PER_CONTAINER of them and closes the rest at once: no backlog fills, and a
    neighbour's client passes while every one of the flood's connections is still open."""
    daemon = fake_daemon(root)
    relay = start_relay(root, handshake_s=60)
    try:
        with flood(root, 1000) as (held, refused):
            assert held + refused == 1000
            for _ in range(5):
                cuda_client(root)
            assert relay.poll() is None and daemon.accepted == 5
        assert f"MPS_RELAY_PER_CONTAINER" in relay_log(root) and str(MPS_RELAY_PER_CONTAINER) in relay_log(root)
    finally:
        relay.kill()
        relay.wait()
        daemon.sock.close()


def test_a_full_descriptor_table_closes_the_newest_connection_never_the_relay(root):
    """Measured: 600 idle connections under the default 1024 made accept() fail with EMFILE and the relay exit."""
    daemon = fake_daemon(root)
    relay = start_relay(root, nofile=48, handshake_s=2)
    try:
        with flood(root, 200):
            time.sleep(0.5)
            assert relay.poll() is None
        assert "the descriptor table is full" in relay_log(root)
        deadline = time.monotonic() + 10
        while True:  # once the flood's connections are gone, clients pass again
            try:
                cuda_client(root)
                break
            except (OSError, AssertionError):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert relay.poll() is None
    finally:
        relay.kill()
        relay.wait()
        daemon.sock.close()


# ---------------------------------------------------------------- behind it, the stand-in daemon and server


@pytest.fixture
def standin(root):
    daemon = mps_standin.Daemon(root, GPU)
    (root / GPU / "daemon.pid").write_text(f"{daemon.pid}\n")
    daemon.control("set_default_device_pinned_mem_limit 0 4G")
    daemon.control("start_server -uid 0")
    relay = start_relay(root)
    yield daemon, root / GPU / "tasks" / "control"
    relay.kill()
    relay.wait()
    daemon.kill()


def still_serving(daemon: mps_standin.Daemon, relayed: Path) -> None:
    """The daemon answers a command that needs the server, and a client through the relay gets its ceiling."""
    (server,) = daemon.servers()
    assert daemon.control(f"get_device_pinned_mem_limit {server} 0") == "4G"
    assert mps_standin.cuda_client(relayed) == 4096


REFUSED = {  # what a slot task may send, message by message; +fd: with a descriptor of its own
    "nothing": [],
    "greeting only": ["OUTBCRED"],
    "control utility": [*mps_standin.utility_messages("set_device_pinned_mem_limit 1 0 200G")],
    "default through control": [*mps_standin.utility_messages("set_default_device_pinned_mem_limit 0 200G")],
    "kind 3": ["OUTBCRED", struct.pack("<i", 3)],
    "greeting with a descriptor": ["OUTBCRED+fd"],
    "kind with a descriptor": ["OUTBCRED", "2+fd"],
    "text after the greeting": ["OUTBCRED", b"set_default_device_pinned_mem_limit 0 200G\n\0"],
    "two greetings": ["OUTBCRED", "OUTBCRED"],
    "a long message": [b"OUTBCRED\0" + b"x" * 4000],
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_after_each_refused_sequence_the_daemon_and_its_server_still_serve(standin, name):
    daemon, relayed = standin
    with mps_standin.connect(relayed) as sock, open("/dev/null") as passed:
        assert mps_standin.receive(sock)[0] == mps_standin.HELLO
        for message in REFUSED[name]:
            fd = isinstance(message, str) and message.endswith("+fd")
            body = {"OUTBCRED": mps_standin.CRED, "2": mps_standin.CLIENT}.get(
                message.removesuffix("+fd") if isinstance(message, str) else None, message)
            try:
                sock.sendmsg([body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", passed.fileno()))]
                             if fd else [])
            except OSError:
                break
        if not REFUSED[name] or REFUSED[name] == ["OUTBCRED"]:
            pass  # an idle peer: the relay holds it, the daemon never hears of it
        else:
            assert ended(sock)
        still_serving(daemon, relayed)


def test_a_dropped_server_descriptor_after_a_valid_handshake_passes_and_its_task_is_named(standin):
    """MPS's own weakness (measured on an H200): the relay passes the exact handshake, so the server stalls.
    It notes who got that descriptor; the health watcher names it and starts the daemon again."""
    daemon, relayed = standin
    mps_standin.cuda_client(relayed, drop=True)
    with pytest.raises(OSError):
        mps_standin.cuda_client(relayed, timeout=1.5)
    last = [json.loads(line) for line in (relayed.parent.parent / MPS_LAST_CLIENTS).read_text().splitlines()]
    assert [entry["pid"] for entry in last] == [os.getpid(), os.getpid()]


def test_the_relay_names_itself_where_the_guard_looks(root):
    import guard_files
    (root / GPU / "pipe").mkdir(parents=True)
    assert not guard_files.mps_relay_alive(str(root))
    relay = subprocess.Popen([sys.executable, str(REPO / "node" / "mps_relay.py"), str(root), GPU],
                             stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if guard_files.mps_relay_alive(str(root)):
                break
            time.sleep(0.05)
        assert guard_files.mps_relay_alive(str(root))
        assert oct((root / GPU / "tasks" / "control").stat().st_mode & 0o777) == "0o666"
    finally:
        relay.kill()
        relay.wait()
    assert not guard_files.mps_relay_alive(str(root))  # a pid file left behind is not a relay


def test_the_relay_waits_with_poll_and_selectors_never_select():
    """select() breaks on descriptors past 1023, which a relay with a higher limit gets."""
    source = (REPO / "node" / "mps_relay.py").read_text()
    assert "select.select(" not in source and "selectors.DefaultSelector()" in source


def test_no_client_passes_to_a_daemon_gpu_swarm_mps_has_not_named_yet(root):
    """gpu-swarm-mps names a daemon in daemon.pid once its ceilings are set: before that, a daemon would start
    a server without them for the first client it saw."""
    daemon = fake_daemon(root)
    (root / GPU / "daemon.pid").unlink()
    relay = start_relay(root)
    try:
        with pytest.raises(AssertionError):
            cuda_client(root)
        assert daemon.accepted == 0 and "not running, or is starting" in relay_log(root)
        (root / GPU / "daemon.pid").write_text(f"{os.getpid()}\n")
        cuda_client(root)
        assert daemon.accepted == 1
    finally:
        relay.kill()
        relay.wait()
        daemon.sock.close()
