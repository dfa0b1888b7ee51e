#!/usr/bin/env python3
"""The MPS control socket that slot tasks reach: CUDA clients pass, control commands do not.

    python3 mps_relay.py MPS_DIR UUID...     (node/gpu-swarm-mps starts it after the daemons)

For each GPU it listens on MPS_DIR/<uuid>/tasks/control, the only entry of the folder that the
guard mounts into a slot task (read-only, where the task's CUDA_MPS_PIPE_DIRECTORY points), and
relays each connection to the daemon's own MPS_DIR/<uuid>/pipe/control.
Why: the daemon serves CUDA clients and nvidia-cuda-mps-control on the same socket, and a task
that reached it could send `set_device_pinned_mem_limit <server> 0 200G` and raise the ceiling
of every client of its GPU (measured on H100s, bench/results/gpu-session-2xH100-sharing/).
What passes, as recorded on driver 580 (bench/results/gpu-mps-wire/): the socket is SOCK_SEQPACKET;
the daemon says OUTBHELL, the peer OUTBCRED and then its kind as a 32-bit word, 2 for a CUDA client
and 4 for nvidia-cuda-mps-control, whose command then follows. A client gets OUTBCUFD with a
descriptor of its own connection to the MPS server, answers with one word, and closes. So the
relay passes a task's OUTBCRED, the word 2, and words after it; anything else ends the connection
before the daemon sees it. Every message carries its sender's credentials, as the kernel gives
them (root may pass a peer's on), so the daemon sees the client's pid, not the relay's.
Stdlib only: one thread per GPU and one per connection, each connection a handful of messages.
"""
from __future__ import annotations

import array
import os
import select
import socket
import struct
import sys
import threading

from contract import MPS_RELAY_PID, MPS_TASK_DIR

HELLO = b"OUTBCRED\x00"  # the peer's first message, after the daemon's OUTBHELL
CLIENT = struct.pack("<i", 2)  # a CUDA client's kind; nvidia-cuda-mps-control's is 4
WORD = 4  # what a client may send after its kind: one word (an 8-byte length and a command are a UI's)
CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY = socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(8 * 4)
TIMEOUT_S = 60.0  # a client may wait this long for the daemon to start its server
MAX_TASK_MESSAGES = 3  # OUTBCRED, the kind 2, one word: all a client sent on driver 580


class Refused(Exception):
    """A task's connection that is not a CUDA client's."""


def _receive(sock: socket.socket) -> tuple[bytes, tuple[int, int, int] | None, list[int]]:
    data, ancillary, _, _ = sock.recvmsg(65536, ANCILLARY)
    creds, fds = None, []
    for level, kind, body in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            creds = CREDS.unpack(body[:CREDS.size])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", body[: len(body) - len(body) % 4]).tolist()
    return data, creds, fds


def _send(sock: socket.socket, data: bytes, creds: tuple[int, int, int] | None, fds: list[int]) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, CREDS.pack(*creds))] if creds else []
    if fds:
        ancillary.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
    sock.sendmsg([data], ancillary)


def check(count: int, data: bytes, fds: list[int]) -> None:
    """The task's COUNT-th message (from 0) may pass: what a CUDA client sends, and nothing else."""
    if fds:
        raise Refused("it passed descriptors, which no client does")
    if count >= MAX_TASK_MESSAGES:
        raise Refused(f"it sent more than the {MAX_TASK_MESSAGES} messages a client sends")
    if count == 0 and data != HELLO:
        raise Refused(f"its first message is {data[:16]!r}, not a client's {HELLO!r}")
    if count == 1 and data != CLIENT:
        said = "nvidia-cuda-mps-control's (4): a control command" if data == struct.pack("<i", 4) else repr(data[:16])
        raise Refused(f"it is {said}, not a CUDA client (2); slot tasks may not control the daemon")
    if count >= 2 and len(data) != WORD:
        raise Refused(f"after its kind it sent {len(data)} bytes, not a client's one word")


def relay(task: socket.socket, daemon_path: str) -> str:
    """One task connection to the daemon; what happened, for the log. Raises Refused."""
    peer = CREDS.unpack(task.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDS.size))
    task.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as daemon:
        daemon.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        daemon.settimeout(TIMEOUT_S)
        daemon.connect(daemon_path)
        sent = 0
        while True:
            ready, _, _ = select.select([task, daemon], [], [], TIMEOUT_S)
            if not ready:
                raise Refused(f"nothing for {TIMEOUT_S:.0f} s")
            for source in ready:
                data, creds, fds = _receive(source)
                try:
                    if not data and not fds:
                        return f"pid {peer[0]}: {sent} messages passed"
                    if source is task:
                        check(sent, data, fds)
                        sent += 1
                        _send(daemon, data, creds or peer, [])
                    else:
                        _send(task, data, creds, fds)
                finally:
                    for fd in fds:
                        os.close(fd)


def _serve_one(task: socket.socket, daemon_path: str, gpu: str) -> None:
    with task:
        try:
            relay(task, daemon_path)
        except Refused as e:
            print(f"mps-relay {gpu}: refused a connection: {e}", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"mps-relay {gpu}: a connection ended: {e}", file=sys.stderr, flush=True)


def listen(path: str) -> socket.socket:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    os.chmod(path, 0o666)  # as the daemon's own control socket: any user's client may connect
    server.listen(128)
    return server


def serve(server: socket.socket, daemon_path: str, gpu: str) -> None:
    while True:
        task, _ = server.accept()
        threading.Thread(target=_serve_one, args=(task, daemon_path, gpu), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: mps_relay.py MPS_DIR UUID...", file=sys.stderr)
        return 2
    mps_dir, gpus = argv[0], argv[1:]
    threads = []
    for gpu in gpus:
        folder = f"{mps_dir}/{gpu}/{MPS_TASK_DIR}"
        os.makedirs(folder, mode=0o755, exist_ok=True)
        # Through descriptors of the folders: a socket's path must fit in 108 bytes, these need not.
        tasks, pipe = (os.open(path, os.O_PATH | os.O_DIRECTORY) for path in (folder, f"{mps_dir}/{gpu}/pipe"))
        server = listen(f"/proc/self/fd/{tasks}/control")
        threads.append(threading.Thread(target=serve, args=(server, f"/proc/self/fd/{pipe}/control", gpu),
                                        daemon=True))
    for thread in threads:
        thread.start()
    tmp = f"{mps_dir}/{MPS_RELAY_PID}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, f"{mps_dir}/{MPS_RELAY_PID}")
    print(f"mps-relay: slot tasks reach {len(gpus)} GPU(s)' daemons through {mps_dir}/<uuid>/{MPS_TASK_DIR}/control",
          flush=True)
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
