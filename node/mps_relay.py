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
every handshake, one thread per GPU talks to its daemon.
"""
from __future__ import annotations

import array
import collections
import errno
import json
import os
import re
import resource
import select
import selectors
import socket
import struct
import sys
import threading
import time

from contract import (MPS_DAEMON_PID, MPS_LAST_CLIENTS, MPS_RELAY_MAX_CONNECTIONS, MPS_RELAY_PER_CONTAINER,
                      MPS_RELAY_PID, MPS_TASK_DIR)

HELLO, CRED, CUFD = b"OUTBHELL\x00", b"OUTBCRED\x00", b"OUTBCUFD\x00"
CLIENT, UTILITY = struct.pack("<i", 2), struct.pack("<i", 4)
WORD = 4  # a client's last message, after its descriptor: one 32-bit word
MAX_MESSAGE = 64  # longer than any message a client sends; a longer one is cut off (MSG_TRUNC) and refused
CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY = socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(4 * 4)
HANDSHAKE_S = float(os.environ.get("GPU_SWARM_MPS_HANDSHAKE_S", "5"))  # libcuda sends both within a millisecond
DAEMON_S = 30.0  # the daemon may be starting a server for the client
FINAL_S = 1.0
QUEUED_S = 20.0  # a client that waited this long for its turn has given up: the daemon never hears of it
RESERVE_FDS = 32  # besides task connections: stdio, listeners, each GPU's exchange, the spare
LAST_KEPT = 16
_CONTAINER = re.compile(r"[0-9a-f]{64}")


class Refused(Exception):
    """A task's connection that is not a CUDA client's exact handshake."""


def log(message: str) -> None:
    print(f"mps-relay {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}", flush=True)


class Quiet:
    """At most one line per key every PERIOD_S, with a count of those left out (a flood must not fill /run)."""
    PERIOD_S = 10.0

    def __init__(self):
        self.last: dict[str, tuple[float, int]] = {}
        self.lock = threading.Lock()

    def __call__(self, key: str, message: str) -> None:
        now = time.monotonic()
        with self.lock:
            at, left_out = self.last.get(key, (0.0, 0))
            if now - at < self.PERIOD_S and at:
                self.last[key] = (at, left_out + 1)
                return
            self.last[key] = (now, 0)
        log(message + (f" (and {left_out} more like it in the last {self.PERIOD_S:.0f} s)" if left_out else ""))


quiet = Quiet()


def _receive(sock: socket.socket, size: int = MAX_MESSAGE) -> tuple[bytes, tuple[int, int, int] | None, list[int],
                                                                       int]:
    data, ancillary, flags, _ = sock.recvmsg(size, ANCILLARY)
    creds, fds = None, []
    for level, kind, body in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            creds = CREDS.unpack(body[:CREDS.size])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", body[: len(body) - len(body) % 4]).tolist()
    return data, creds, fds, flags


def _send(sock: socket.socket, data: bytes, creds: tuple[int, int, int] | None, fds: list[int]) -> None:
    """data with its sender's credentials (root may pass another process's on) and descriptors. A sender that
    has exited by now (a client's last word, sent as it ends) cannot be named: the relay's own go instead."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    if creds:
        try:
            sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, CREDS.pack(*creds)), *rights])
            return
        except ProcessLookupError:
            pass
    sock.sendmsg([data], rights)


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


class Gpu:
    """One GPU: its listening socket, and the thread that takes its clients to its daemon, one at a time."""

    def __init__(self, mps_dir: str, uuid: str, counts: Counts):
        self.mps_dir, self.uuid, self.counts = mps_dir, uuid, counts
        self.queue: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self.ready = threading.Condition()

    # ---- where the daemon is

    def daemon_pid(self) -> int | None:
        try:
            with open(f"{self.mps_dir}/{self.uuid}/{MPS_DAEMON_PID}", encoding="utf-8") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def greeting_creds(self) -> tuple[int, int, int] | None:
        """The daemon's credentials, which its OUTBHELL carries: the relay greets with them."""
        pid = self.daemon_pid()
        return (pid, 0, 0) if pid else None

    def connect_daemon(self) -> socket.socket:
        pid = self.daemon_pid()
        pipe = f"{self.mps_dir}/{self.uuid}/pipe"
        # Through a descriptor of the folder: its path in the daemon's namespace (/proc/<pid>/root/...) need not
        # fit in a socket address's 108 bytes.
        folder = os.open(f"/proc/{pid}/root{pipe}" if pid else pipe, os.O_PATH | os.O_DIRECTORY)
        daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            daemon.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            daemon.settimeout(DAEMON_S)
            deadline = time.monotonic() + DAEMON_S
            while True:
                try:
                    daemon.connect(f"/proc/self/fd/{folder}/control")
                    return daemon
                except BlockingIOError:  # its backlog is full: the connect of a socket with a timeout says so at once
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except BaseException:
            daemon.close()
            raise
        finally:
            os.close(folder)

    # ---- the queue: each container in turn

    def put(self, conn: Connection) -> None:
        with self.ready:
            self.queue.setdefault(conn.peer, collections.deque()).append((time.monotonic(), conn))
            self.ready.notify()

    def take(self) -> tuple[float, Connection]:
        with self.ready:
            while not self.queue:
                self.ready.wait()
            peer, waiting = next(iter(self.queue.items()))
            item = waiting.popleft()
            del self.queue[peer]
            if waiting:
                self.queue[peer] = waiting  # to the back: the other containers' clients come first
            return item

    def run(self) -> None:
        while True:
            since, conn = self.take()
            try:
                if time.monotonic() - since > QUEUED_S:
                    raise Refused(f"it waited {QUEUED_S:.0f} s for its turn")
                waiting = pending(conn.sock)
                if waiting == "closed":
                    continue  # gone while it waited: the daemon must not hand a descriptor to no one
                if waiting == "more":
                    raise Refused("it sent more before its descriptor than a client does")
                self.exchange(conn)
            except Refused as e:
                quiet(f"{self.uuid} {conn.peer} {e}", f"{self.uuid}: refused {conn.who()}: {e}")
            except OSError as e:
                quiet(f"{self.uuid} {conn.peer} error", f"{self.uuid}: {conn.who()}: the exchange ended: {e}")
            finally:
                conn.sock.close()
                self.counts.give_back(conn.peer)

    def exchange(self, conn: Connection) -> None:
        """The client's handshake with the daemon, its messages already in hand; the daemon's answers passed on."""
        task = conn.sock
        task.setblocking(True)
        with self.connect_daemon() as daemon:
            data, creds, fds, _ = _receive(daemon)
            _close(fds)
            if data != HELLO:
                raise OSError(f"the daemon greeted with {data[:16]!r}")
            for message, sender in conn.messages:
                _send(daemon, message, sender, [])
            poller = select.poll()
            for sock in (daemon, task):
                poller.register(sock, select.POLLIN)
            deadline, descriptor = time.monotonic() + DAEMON_S, False
            while True:
                left = deadline - time.monotonic()
                ready = poller.poll(max(left, 0) * 1000) if left > 0 else []
                if not ready and descriptor:
                    raise Refused(f"it sent no last word within {FINAL_S:g} s of its descriptor")
                if not ready:
                    raise OSError(f"the daemon did not answer within {DAEMON_S:g} s")
                for fd, _ in ready:
                    if fd == daemon.fileno():
                        data, creds, fds, _ = _receive(daemon)
                        try:
                            if not data and not fds:
                                return  # the daemon ended the exchange
                            if data == CUFD:  # noted first: a descriptor the task never gets stalls the server too
                                descriptor, deadline = True, time.monotonic() + FINAL_S
                                self.note_descriptor(conn)
                            task.settimeout(FINAL_S)
                            _send(task, data, creds, fds)
                        finally:
                            _close(fds)
                    else:
                        data, creds, fds, flags = _receive(task)
                        _close(fds)
                        if not data and not fds:
                            return  # the client closed
                        if not descriptor or fds or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) != WORD:
                            raise Refused(f"after its kind it sent {len(data)} bytes"
                                          f"{' with descriptors' if fds else ''}"
                                          f"{'' if descriptor else ' before its descriptor'}, not one word after it")
                        _send(daemon, data, creds or conn.creds, [])
                        return  # all a client says: the daemon is free for the next one

    def note_descriptor(self, conn: Connection) -> None:
        """Who got a descriptor to the server, kept for the health watcher: a stalled server names its task."""
        path = f"{self.mps_dir}/{self.uuid}/{MPS_LAST_CLIENTS}"
        try:
            with open(path, encoding="utf-8") as f:
                kept = f.read().splitlines()[-(LAST_KEPT - 1):]
        except OSError:
            kept = []
        kept.append(json.dumps({"at": round(time.time(), 3), "pid": conn.pid, "container": conn.container,
                                "cgroup": conn.peer.splitlines()[-1][:200]}))
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(kept) + "\n")
        os.replace(f"{path}.tmp", path)
        quiet(f"{self.uuid} {conn.peer} descriptor", f"{self.uuid}: OUTBCUFD, a descriptor to the MPS server, to "
              f"{conn.who()} (every one: {path})")


def pending(sock: socket.socket) -> str:
    """What waits on a task's connection, read without taking it: "none", "more" (a message) or "closed".
    Looked at before the daemon is asked for a descriptor, which the relay must then hand over: the server
    stalls on one that is dropped."""
    try:
        return "more" if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else "closed"
    except BlockingIOError:
        return "none"
    except OSError:
        return "closed"


def greet(sock: socket.socket, creds: tuple[int, int, int] | None) -> None:
    """OUTBHELL, as the daemon says it: with its credentials (its pid file's), else the relay's own."""
    _send(sock, HELLO, creds, [])


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


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
