"""One GPU's side of the MPS relay (mps_relay.py): its clients taken to its control daemon one at a time, each
container in turn, and the wire both sides speak. The daemon serves one connection at a time and waits for a
peer forever, so what reaches it here is a client's whole first messages, already taken by the relay; the
daemon has DAEMON_S to answer, the client FINAL_S for its last word after its descriptor. Who got each
descriptor to the server goes to <uuid>/last-clients (the health watcher names the task before a stall).
Stdlib only.
"""
from __future__ import annotations

import array
import collections
import json
import os
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from contract import MPS_DAEMON_PID, MPS_LAST_CLIENTS

if TYPE_CHECKING:
    from mps_relay import Connection, Counts  # a task's connection, and the caps: the relay's side

HELLO, CRED, CUFD = b"OUTBHELL\x00", b"OUTBCRED\x00", b"OUTBCUFD\x00"
CLIENT, UTILITY = struct.pack("<i", 2), struct.pack("<i", 4)
WORD = 4  # a client's last message, after its descriptor: one 32-bit word
MAX_MESSAGE = 64  # longer than any message a client sends; a longer one is cut off (MSG_TRUNC) and refused
CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY = socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(4 * 4)
DAEMON_S = 30.0  # the daemon may be starting a server for the client
FINAL_S = 1.0
QUEUED_S = 20.0  # a client that waited this long for its turn has given up: the daemon never hears of it
LAST_KEPT = 16


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
        if not pid:  # none, or one gpu-swarm-mps has not given its ceilings yet: it would start a server without
            raise OSError(f"no {MPS_DAEMON_PID}: the GPU's daemon is not running, or is starting")
        # Through a descriptor of the folder: its path in the daemon's namespace (/proc/<pid>/root/...) need not
        # fit in a socket address's 108 bytes.
        folder = os.open(f"/proc/{pid}/root{self.mps_dir}/{self.uuid}/pipe", os.O_PATH | os.O_DIRECTORY)
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
