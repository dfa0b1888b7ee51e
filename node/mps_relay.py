#!/usr/bin/env python3
"""The MPS control socket that slot tasks reach: a CUDA client's exact handshake passes, one client at a time.

    python3 mps_relay.py MPS_DIR UUID...     (node/gpu-swarm-mps starts it after the daemons)

For each GPU it listens on MPS_DIR/<uuid>/tasks/control, the only entry of the folder that the guard mounts
into a slot task (read-only, where the task's CUDA_MPS_PIPE_DIRECTORY points), and passes CUDA clients to the
GPU's control daemon, whose own socket takes control commands (`set_device_pinned_mem_limit <server> 0 200G`
raised a GPU's ceiling, bench/results/gpu-session-2xH100-sharing/). The daemon's pipe folder exists only in its
own mount namespace (gpu-swarm-mps); the relay reaches it through /proc/<pid in <uuid>/daemon.pid>/root.
What a client sends, as recorded on driver 580 (bench/results/gpu-mps-wire/), on SOCK_SEQPACKET: the daemon
says OUTBHELL, the peer OUTBCRED and its kind as a 32-bit word (2 for a CUDA client, 4 for
nvidia-cuda-mps-control, whose command follows); the daemon gives a client OUTBCUFD with a descriptor of its
connection to the MPS server, and the client answers with one word and closes. Every message carries its
sender's credentials; the daemon sees the client's, which root may pass on.
The daemon serves one connection at a time and waits for a peer's credentials with no timeout (measured on an
H200), so no task's pause may reach it:
- the relay greets a task itself and takes its whole first messages, OUTBCRED and the word 2, within
  HANDSHAKE_S, each at most MAX_MESSAGE bytes and without descriptors, before it connects to the daemon;
- it connects to each GPU's daemon for one client at a time, taking clients from each container in turn, so
  that a neighbour waits for at most one exchange per other busy container; the daemon has DAEMON_S to answer,
  the client FINAL_S for its last word after its descriptor;
- a container (a cgroup: the host's processes too) holds at most MPS_RELAY_PER_CONTAINER connections at once,
  the relay MPS_RELAY_MAX_CONNECTIONS; more are closed as soon as they are accepted, so no backlog fills;
  a full descriptor table (EMFILE) closes the newest connection, never the relay.
What it cannot stop is MPS's own weakness: a client that takes its descriptor and never speaks on it stops
the server (GPU-SWARM-FACTS.md). It writes who got each descriptor to <uuid>/last-clients, and the health
watcher (health_mps.py) finds the stall, names that task and starts the daemon again.
Stdlib only: one thread waits (selectors: epoll, no limit of 1024 descriptors) on every listening socket and
every handshake; one thread per GPU talks to its daemon (mps_relay_daemon.py, with the wire both speak).
"""
from __future__ import annotations

import collections
import errno
import os
import re
import resource
import selectors
import socket
import sys
import threading
import time

from contract import MPS_RELAY_MAX_CONNECTIONS, MPS_RELAY_PER_CONTAINER, MPS_RELAY_PID, MPS_TASK_DIR
from mps_relay_daemon import (CLIENT, CRED, CREDS, FINAL_S, LAST_KEPT, MAX_MESSAGE, UTILITY, Gpu, Refused,  # noqa: F401
                              _close, _receive, greet, log, quiet)

HANDSHAKE_S = float(os.environ.get("GPU_SWARM_MPS_HANDSHAKE_S", "5"))  # libcuda sends both within a millisecond
RESERVE_FDS = 32  # besides task connections: stdio, listeners, each GPU's exchange, the spare
_CONTAINER = re.compile(r"[0-9a-f]{64}")


def check(count: int, data: bytes, fds: list[int], flags: int) -> None:
    """The task's COUNT-th message (from 0) before the daemon hears of it: OUTBCRED, then the word 2."""
    if fds or flags & socket.MSG_CTRUNC:
        raise Refused("it passed descriptors, which no client does")
    if flags & socket.MSG_TRUNC:
        raise Refused(f"it sent a message of more than {MAX_MESSAGE} bytes, longer than any a client sends")
    if count == 0 and data != CRED:
        raise Refused(f"its first message is {data[:16]!r}, not a client's {CRED!r}")
    if count == 1 and data != CLIENT:
        said = "nvidia-cuda-mps-control's (4): a control command" if data == UTILITY else repr(data[:16])
        raise Refused(f"it is {said}, not a CUDA client (2); slot tasks may not control the daemon")
    if count >= 2:
        raise Refused("it sent more before its descriptor than a client does")


def peer_of(pid: int) -> tuple[str, str | None]:
    """(the cgroup that counts as one container, the container's id when it is one) of a peer's process."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        text = f"pid {pid}"  # gone already: counted alone, and closed soon
    found = _CONTAINER.search(text)
    return text, found[0] if found else None


class Connection:
    def __init__(self, sock: socket.socket, gpu: "Gpu", pid: int, creds: tuple[int, int, int]):
        self.sock, self.gpu, self.pid, self.creds = sock, gpu, pid, creds
        self.peer, self.container = peer_of(pid)
        self.messages: list[tuple[bytes, tuple[int, int, int]]] = []
        self.deadline = time.monotonic() + HANDSHAKE_S

    def who(self) -> str:
        return f"pid {self.pid}" + (f", container {self.container[:12]}" if self.container else "")


class Counts:
    """Open task connections, per cgroup and in all: the caps."""

    def __init__(self, most: int, per_container: int):
        self.most, self.per_container = most, per_container
        self.by_peer: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def take(self, peer: str) -> str | None:
        with self.lock:
            if sum(self.by_peer.values()) >= self.most:
                return f"the relay holds {self.most} connections already (MPS_RELAY_MAX_CONNECTIONS)"
            if self.by_peer[peer] >= self.per_container:
                return f"its container holds {self.per_container} connections already (MPS_RELAY_PER_CONTAINER)"
            self.by_peer[peer] += 1
            return None

    def give_back(self, peer: str) -> None:
        with self.lock:
            self.by_peer[peer] -= 1
            if self.by_peer[peer] <= 0:
                del self.by_peer[peer]


class Relay:
    """Every GPU's listening socket and the handshakes before the daemon, in one thread."""

    def __init__(self, mps_dir: str, gpus: list[str], most: int, per_container: int):
        self.counts = Counts(most, per_container)
        self.selector = selectors.DefaultSelector()
        self.gpus = [Gpu(mps_dir, uuid, self.counts) for uuid in gpus]
        self.handshakes: dict[int, Connection] = {}
        self.spare = os.open(os.devnull, os.O_RDONLY)  # given up to accept (and close) one when the table is full
        for gpu in self.gpus:
            folder = f"{mps_dir}/{gpu.uuid}/{MPS_TASK_DIR}"
            os.makedirs(folder, mode=0o755, exist_ok=True)
            self.selector.register(listen(folder), selectors.EVENT_READ, gpu)

    def serve(self) -> None:
        for gpu in self.gpus:
            threading.Thread(target=gpu.run, daemon=True, name=gpu.uuid).start()
        while True:
            for key, _ in self.selector.select(timeout=0.5):
                if isinstance(key.data, Gpu):
                    self.accept(key.fileobj, key.data)
                else:
                    self.read(key.data)
            now = time.monotonic()
            for conn in [c for c in self.handshakes.values() if c.deadline < now]:
                self.end(conn, f"it sent no client's handshake within {HANDSHAKE_S:g} s")

    def accept(self, listener: socket.socket, gpu: Gpu) -> None:
        for _ in range(256):  # then the others' turn
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                os.close(self.spare)  # one descriptor, to take the newest connection off the backlog and close it
                try:
                    listener.accept()[0].close()
                except OSError:
                    pass
                self.spare = os.open(os.devnull, os.O_RDONLY)
                quiet("emfile", f"{gpu.uuid}: the descriptor table is full ({e.strerror}): the newest connection "
                      "was closed; raise LimitNOFILE of gpu-swarm-mps.service")
                return
            pid, uid, gid = CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDS.size))
            conn = Connection(sock, gpu, pid, (pid, uid, gid))
            full = self.counts.take(conn.peer)
            if full:
                sock.close()
                quiet(f"full {conn.peer}", f"{gpu.uuid}: closed a connection of {conn.who()} at once: {full}")
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                greet(sock, gpu.greeting_creds())
            except OSError:
                sock.close()
                self.counts.give_back(conn.peer)
                continue
            self.handshakes[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def read(self, conn: Connection) -> None:
        try:
            data, creds, fds, flags = _receive(conn.sock)
        except BlockingIOError:
            return
        except ConnectionResetError:  # closed with the greeting unread: an idle peer that left
            self.end(conn, None)
            return
        except OSError as e:
            self.end(conn, f"it failed: {e}")
            return
        _close(fds)
        if not data and not fds:
            self.end(conn, None)  # libcuda's first connection only looks, and closes
            return
        try:
            check(len(conn.messages), data, fds, flags)
        except Refused as e:
            self.end(conn, str(e))
            return
        conn.messages.append((data, creds or conn.creds))
        if len(conn.messages) == 2:  # the whole of what a client says before its descriptor
            self.selector.unregister(conn.sock)
            del self.handshakes[conn.sock.fileno()]
            conn.gpu.put(conn)

    def end(self, conn: Connection, why: str | None) -> None:
        self.selector.unregister(conn.sock)
        del self.handshakes[conn.sock.fileno()]
        conn.sock.close()
        self.counts.give_back(conn.peer)
        if why:
            quiet(f"{conn.gpu.uuid} {conn.peer} {why[:24]}", f"{conn.gpu.uuid}: refused {conn.who()}: {why}")


def listen(folder: str) -> socket.socket:
    # Through a descriptor of the folder: a socket's path must fit in 108 bytes, the folder's need not.
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        path = f"/proc/self/fd/{fd}/control"
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(path)
        os.chmod(path, 0o666)  # as the daemon's own control socket: any user's client may connect
    finally:
        os.close(fd)
    server.setblocking(False)
    server.listen(4096)  # the kernel's somaxconn caps it: the relay takes them off at once
    return server


def descriptors() -> int:
    """The soft limit, raised to the hard one (systemd sets both: gpu-swarm-mps.service's LimitNOFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: mps_relay.py MPS_DIR UUID...", file=sys.stderr)
        return 2
    mps_dir, gpus = os.path.abspath(argv[0]), argv[1:]
    limit = descriptors()
    if limit < MPS_RELAY_MAX_CONNECTIONS + RESERVE_FDS:
        log(f"only {limit} descriptors (RLIMIT_NOFILE): past about {limit - RESERVE_FDS} connections the newest "
            f"are closed (EMFILE); gpu-swarm-mps.service's LimitNOFILE gives {MPS_RELAY_MAX_CONNECTIONS} room")
    relay = Relay(mps_dir, gpus, MPS_RELAY_MAX_CONNECTIONS, MPS_RELAY_PER_CONTAINER)
    tmp = f"{mps_dir}/{MPS_RELAY_PID}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, f"{mps_dir}/{MPS_RELAY_PID}")
    log(f"slot tasks reach {len(gpus)} GPU(s)' daemons through {mps_dir}/<uuid>/{MPS_TASK_DIR}/control: at most "
        f"{MPS_RELAY_PER_CONTAINER} connections a container, {MPS_RELAY_MAX_CONNECTIONS} in all, {HANDSHAKE_S:g} s "
        "for a client's first messages, one client at a time to each daemon")
    relay.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
