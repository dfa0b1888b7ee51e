#!/usr/bin/env python3
"""gpu-swarm's guard, kept running: the node's runtime hands it each `create`, so no Python starts per container.

    python3 -I -S guard_server.py DIR        (gpu-swarm-guard.service; DIR is GUARD_SERVER in runtime.env)

A Python interpreter's start is most of what a create through gpu_guard.py costs (13 ms on an
H100 host, where the rest of the runtime's work is under 2 ms). Here one interpreter, started
once, makes the same decisions with the same code (gpu_guard.check). The sh front
(gpu-swarm-runtime) makes a FIFO of its own, DIR/reply.<its pid>, writes one request into
DIR/requests (NUL-separated: the number of runtime arguments, the reply FIFO, the settings file,
its working directory, the arguments; one write, so requests never interleave), reads the one-line answer ("ok" or
"refused <why>") and execs the delegate or fails. It uses this server only while DIR/server.pid
names a live process called gpu-swarm-guard; otherwise it runs gpu_guard.py itself, as before.
Fail closed: a request this server cannot read is refused. A server that died with requests
waiting is restarted by systemd; the new one answers every FIFO left waiting with a refusal.
Stdlib only.
"""

import posix
import sys

sys.path.insert(0, __file__.rpartition("/")[0] or ".")  # -I leaves the script's folder out; the guard is there
from gpu_guard import check  # noqa: E402
from guard_files import makedirs  # noqa: E402

NAME = "gpu-swarm-guard"  # the process name the sh front looks for (at most 15 characters: /proc/PID/comm)
RESTARTED = "refused gpu-swarm guard: the guard's server restarted before it answered; the container was " \
            "not started (swarm starts the task again)"


def reply(directory: str, path: str, line: str) -> None:
    """Answer one front, then remove its FIFO. A front that has gone has no reader: nothing is sent."""
    if not (path.startswith(directory + "/reply.") and path[len(directory) + 7:].isdigit()):
        return  # not one of ours: never open or remove anything else
    try:
        fd = posix.open(path, posix.O_WRONLY | posix.O_NONBLOCK)  # ENXIO when nobody reads it
    except OSError:
        fd = None
    try:
        if fd is not None:
            posix.write(fd, (" ".join(line.split()) + "\n").encode())  # one line, whatever the message held
    except OSError:
        pass
    finally:
        if fd is not None:
            posix.close(fd)
        try:
            posix.unlink(path)
        except OSError:
            pass


def take(buffer: bytes) -> tuple[list[str] | None, bytes]:
    """The first whole request in buffer, and what follows it; None while it is not all there.
    A request that does not parse empties the buffer: there is no telling where the next starts."""
    count, sep, rest = buffer.partition(b"\0")
    if not sep:
        return None, buffer
    if not count.isdigit():
        return [], b""
    fields = rest.split(b"\0", int(count) + 3)
    if len(fields) < int(count) + 4:
        return None, buffer
    *request, after = fields
    return [f.decode("utf-8", "surrogateescape") for f in request], after


def handle(directory: str, request: list[str]) -> None:
    if len(request) < 3:
        return  # no reply FIFO to answer: the front that sent it waits for the restart's answer
    path, config, cwd, args = request[0], request[1], request[2], request[3:]
    try:
        posix.chdir(cwd)  # the runtime's own: a bundle given as a relative path, or none (".")
        ok, said = check(config, args)
        line = "ok" if ok else f"refused {said}"
    except Exception as e:  # a bug must not end the server, nor start a container: refuse and go on
        line = f"refused gpu-swarm guard: internal error ({type(e).__name__}: {e}); the container was not started"
    reply(directory, path, line)


def serve(directory: str) -> None:
    makedirs(directory)
    posix.chmod(directory, 0o700)  # only root sends requests
    requests = f"{directory}/requests"
    try:
        posix.unlink(requests)  # a FIFO made by a server before this one holds nothing of use
    except FileNotFoundError:
        pass
    posix.mkfifo(requests, 0o600)
    # Read and write: the FIFO then never reads end-of-file between two fronts, and a front's
    # write never blocks on a server that is starting.
    fd = posix.open(requests, posix.O_RDWR)
    for name in posix.listdir(directory):  # fronts left waiting by the server before this one
        if name.startswith("reply."):
            reply(directory, f"{directory}/{name}", RESTARTED)
    with open("/proc/self/comm", "w") as f:
        f.write(NAME)
    with open(f"{directory}/server.pid.tmp", "w") as f:
        f.write(f"{posix.getpid()}\n")
    posix.replace(f"{directory}/server.pid.tmp", f"{directory}/server.pid")  # the fronts use it from now on
    print(f"{NAME}: serving {requests}", flush=True)
    buffer = b""
    while True:
        buffer += posix.read(fd, 65536)
        while True:
            request, buffer = take(buffer)
            if request is None:
                break
            if request:
                handle(directory, request)
            else:
                print(f"{NAME}: dropped a request that does not parse", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith("/"):
        sys.exit(f"usage: {sys.argv[0]} DIR (an absolute path: GUARD_SERVER in runtime.env)")
    serve(sys.argv[1].rstrip("/"))
