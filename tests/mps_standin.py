"""The stand-in MPS control daemon (localswarm/standins/nvidia-cuda-mps-control) for tests, and peers of it:
a CUDA client's whole handshake, the control utility's, and a peer that only connects. Real sockets and
processes, so that what a test sees is what node/mps_relay.py and the health watcher see."""
from __future__ import annotations

import array
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

from localswarm import standins

HELLO, CRED, CUFD = b"OUTBHELL\0", b"OUTBCRED\0", b"OUTBCUFD\0"
CLIENT, UTILITY = struct.pack("<i", 2), struct.pack("<i", 4)
CREDS = struct.Struct("3i")


def install(folder: Path) -> Path:
    """The stand-in, as the node image installs it (executable, under its own name)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-cuda-mps-control"
    script.write_bytes(standins.source("nvidia-cuda-mps-control"))
    script.chmod(0o755)
    return script


def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, ancillary, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(16))
    fds = []
    for level, kind, body in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", body[: len(body) - len(body) % 4]).tolist()
    return data, fds


def connect(path: str | Path, timeout: float = 5) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    sock.connect(str(path))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    return sock


def cuda_client(control: str | Path, timeout: float = 5, drop: bool = False) -> int:
    """A CUDA client's connection, as libcuda makes it: the MiB ceiling its server gives it. drop: take the
    server's descriptor and close it unused (what stops a real MPS server). Raises OSError (timeout) when
    nothing serves it."""
    with connect(control, timeout) as sock:
        assert receive(sock)[0] == HELLO
        sock.send(CRED)
        sock.send(CLIENT)
        data, fds = receive(sock)
        if data != CUFD or len(fds) != 1:
            raise OSError(f"no descriptor: {data!r}")
        sock.send(b"\0\0\0\0")
    with socket.socket(fileno=fds[0]) as server:
        if drop:
            return 0
        server.settimeout(timeout)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        server.sendmsg([CRED], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                                 CREDS.pack(os.getpid(), os.getuid(), os.getgid()))])
        answer = server.recv(64)
        if not answer.startswith(b"LIMIT "):
            raise OSError(f"the server said {answer!r}")
        return int(answer[6:].rstrip(b"\0"))


def utility_messages(command: str) -> list[bytes]:
    """What nvidia-cuda-mps-control sends after the greeting (bench/results/gpu-mps-wire/)."""
    text = (command + "\n\0").encode()
    return [CRED, UTILITY, struct.pack("<Q", len(text)), text, b"\0" * 8]


def ui(control: str | Path, command: str, timeout: float = 5) -> str:
    """One command, as nvidia-cuda-mps-control sends it; the daemon's answer text."""
    with connect(control, timeout) as sock:
        assert receive(sock)[0] == HELLO
        for message in utility_messages(command):
            sock.send(message)
        return receive(sock)[0][4:].decode()


class Daemon:
    """One GPU's stand-in daemon under a folder: its pipe, log, and pid."""

    def __init__(self, root: Path, gpu: str = "GPU-x", script: Path | None = None):
        self.pipe, self.log = root / gpu / "pipe", root / gpu / "log"
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        self.script = script or install(root / "bin")
        self.env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log),
                    "CUDA_VISIBLE_DEVICES": gpu}
        subprocess.run([str(self.script), "-d"], env=self.env, check=True, timeout=30)
        self.pid = int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())

    def control(self, command: str, timeout: float = 5) -> str:
        """The control utility (the stand-in's own), as gpu-swarm-mps runs it; raises TimeoutExpired."""
        return subprocess.run([str(self.script)], input=command + "\n", env=self.env, capture_output=True,
                              text=True, check=True, timeout=timeout).stdout.strip()

    def servers(self) -> list[int]:
        return children(self.pid)

    def kill(self) -> None:
        for pid in [*self.servers(), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def gone(pid: int, within: float = 5) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZX":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False
