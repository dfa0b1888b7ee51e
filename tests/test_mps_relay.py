"""node/mps_relay.py, the only MPS socket a slot task reaches: CUDA clients pass, control commands do not.

Real sockets: the relay runs as its own process (as gpu-swarm-mps starts it), in front of a
daemon played here by a SOCK_SEQPACKET listener that speaks what an MPS control daemon spoke on
driver 580 (tests/data/mps-control-wire.json, written from bench/results/gpu-mps-wire/): it
greets, reads the peer's kind, hands a CUDA client a descriptor and takes a control utility's
command. What matters is what reaches that daemon, and with whose credentials.
"""
import contextlib
import json
import os
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

WIRE = json.loads((REPO / "tests" / "data" / "mps-control-wire.json").read_text())
HEX = bytes.fromhex
GPU = "GPU-a"


class FakeDaemon:
    """The control daemon's side of pipe/control, as recorded: every message it gets, with its sender's pid."""

    def __init__(self, pipe: Path):
        self.got: list[tuple[bytes, int | None]] = []
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
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket):
        with conn, contextlib.suppress(OSError):  # the relay may cut a connection off mid-way
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            conn.sendmsg([HEX(WIRE["daemon_hello"])])
            while True:
                data, creds, fds = mps_relay._receive(conn)
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


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="relay", dir="/tmp"))  # socket paths stay under 108 bytes
    (root / GPU / "pipe").mkdir(parents=True)
    daemon = FakeDaemon(root / GPU / "pipe")
    log = open(root / "relay.log", "w+")
    relay = subprocess.Popen([sys.executable, str(REPO / "node" / "mps_relay.py"), str(root), GPU],
                             stdout=log, stderr=subprocess.STDOUT)
    for _ in range(100):
        if (root / "relay.pid").exists():
            break
        time.sleep(0.05)
    yield root, daemon, relay
    relay.kill()
    relay.wait()
    daemon.sock.close()
    shutil.rmtree(root)


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
        data, _, fds = mps_relay._receive(sock)
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
    # the kernel's credentials of the task's process, passed on: the daemon sees the client, not the relay
    assert {pid for _, pid in daemon.got} == {os.getpid()} and relay.pid != os.getpid()
    assert daemon.server_ends[0].recv(4) == b"ping"  # the descriptor the daemon handed over is the client's


def test_clients_at_once_all_pass(node):
    root, daemon, _ = node
    threads = [threading.Thread(target=cuda_client, args=(root,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    time.sleep(0.2)
    assert len(daemon.server_ends) == 16 and len(daemon.got) == 16 * 3


@pytest.mark.parametrize("command", sorted(WIRE["control_utility"]["commands"]))
def test_nvidia_cuda_mps_control_through_a_tasks_socket_is_refused_before_the_daemon_hears_it(node, command):
    root, daemon, _ = node
    sent = WIRE["control_utility"]["commands"][command]
    with connect(root) as sock:
        sock.send(HEX(sent[0]))
        sock.send(HEX(sent[1]))  # the control utility's kind
        assert ended(sock)
    assert daemon.received() == sent[:1]  # its greeting only: never its kind, let alone the command
    assert "refused a connection: it is nvidia-cuda-mps-control's (4): a control command" in relay_log(root)
    cuda_client(root)  # and the GPU's clients still pass
    assert len(daemon.server_ends) == 1


@pytest.mark.parametrize("after_kind", [
    ["2800000000000000", "7365745f6465766963655f70696e6e65645f6d656d5f6c696d697420343538203020323030470a00"],
    ["04000000", "00000000", "00000000"],  # more words than a client sends
])
def test_a_client_that_sends_a_command_after_its_kind_is_cut_off(node, after_kind):
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
    assert all(len(HEX(m)) == 4 for m in sent[1:]) and len(sent) <= mps_relay.MAX_TASK_MESSAGES
    assert "refused a connection" in relay_log(root)


@pytest.mark.parametrize("first, said", [
    ("04000000", "not a client's"),  # no greeting: straight to a kind
    ("4f5554424352454400", None),
])
def test_a_first_message_that_is_not_a_greeting_or_that_carries_descriptors_is_refused(node, first, said):
    root, daemon, _ = node
    with connect(root) as sock, open("/dev/null") as passed:
        if said:
            sock.send(HEX(first))
        else:  # the greeting, with a descriptor of the task's: no client passes one
            sock.sendmsg([HEX(first)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", passed.fileno()))])
        assert ended(sock)
    assert daemon.received() == []
    assert (said or "descriptors") in relay_log(root)


def test_the_relay_names_itself_where_the_guard_looks():
    import guard_files
    root = Path(tempfile.mkdtemp(prefix="relay", dir="/tmp"))
    (root / GPU / "pipe").mkdir(parents=True)
    try:
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
    finally:
        shutil.rmtree(root)
