"""What the runtime guard (gpu_guard.py) reads and writes besides its settings: the bundle's
config.json, the ledger of which container holds which GPU, and the MPS daemons' pid files.

Every container start pays for it, like the guard: stdlib modules that load fast only, no
json package (its import pulls in re, enum and more, half of a Python create) and no os
(posix directly). It fails closed: what it cannot read raises, and the guard refuses.
"""

import posix

# contract.py's, spelled again (the guard imports nothing else of ours); tests/test_node_contract.py keeps them equal:
MPS_DAEMON_PID = "daemon.pid"  # <MPS_DIR>/<uuid>/daemon.pid: gpu-swarm-mps names the GPU's control daemon there
MPS_TASK_DIR = "tasks"  # <MPS_DIR>/<uuid>/tasks: mps_relay.py's socket, the folder the guard mounts into a slot task
MPS_RELAY_PID = "relay.pid"  # <MPS_DIR>/relay.pid: mps_relay.py names itself there
CREATE_GRACE_S = 120  # a claim whose runc state is not there yet: the create is still under way


def _isdir(path: str) -> bool:
    try:
        return posix.stat(path).st_mode & 0o170000 == 0o040000
    except OSError:
        return False


def absolute(path: str) -> str:
    return path if path.startswith("/") else f"{posix.getcwd()}/{path}"


def makedirs(path: str) -> None:
    if not path or _isdir(path):
        return
    makedirs(path.rpartition("/")[0])
    try:
        posix.mkdir(path, 0o755)
    except FileExistsError:
        pass


# ---------------------------------------------------------------- the ledger: who holds which GPU


def _json_int(text: str, key: str) -> int | None:
    at = text.find(key)
    if at < 0:
        return None
    digits = text[at + len(key):].lstrip(" ")
    end = 0
    while end < len(digits) and digits[end].isdigit():
        end += 1
    return int(digits[:end]) if end else None


def holder_alive(root: str, container: str, bundle: str, since: float, now: float) -> bool:
    """Whether a claim's container still runs: its bundle is there (containerd removes it when the
    task is deleted) and the init process runc recorded is alive (a crash leaves no claim)."""
    if not _isdir(bundle):
        return False
    try:
        with open(f"{root}/{container}/state.json", encoding="utf-8") as f:
            state = f.read()
    except FileNotFoundError:
        return now - since < CREATE_GRACE_S  # the delegate has not written its state yet
    except OSError:
        return True  # cannot tell: it holds
    pid, started = _json_int(state, '"init_process_pid":'), _json_int(state, '"init_process_start":')
    if not pid:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and (started is None or fields[19] == str(started))


class Held(Exception):
    """A key of the claim is held by a live container."""

    def __init__(self, key: str, holder: str, since: int):
        super().__init__(key)
        self.key, self.holder, self.since = key, holder, since


def claim(ledger: str, keys: list[str], container: str, root: str, bundle: str, now: float) -> None:
    """Record that container holds keys, or raise Held when a live container holds one of them.

    One line per claim (key, container, runc root, bundle, since), tab-separated, rewritten
    whole under an exclusive lock, so two creates at once cannot both take a GPU."""
    import fcntl  # only containers that hold GPUs pay for it
    for field in (container, root, bundle):
        if not field or any(c in field for c in "\t\n"):
            raise ValueError(f"cannot record the claim: {field!r} is not a container id or path")
    makedirs(ledger.rpartition("/")[0])  # /run/gpu-swarm, after a reboot
    lock = posix.open(ledger + ".lock", posix.O_RDWR | posix.O_CREAT | posix.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(ledger, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        kept = []
        for line in lines:
            fields = line.split("\t")
            if len(fields) != 5 or not fields[4].isdigit():
                raise ValueError(f"{ledger} has a line that is not a claim ({line!r}); remove that line")
            key, holder, holder_root, holder_bundle, since = fields
            if holder == container:
                continue  # this very container, created again: its claims are made anew below
            if key in keys:
                if holder_alive(holder_root, holder, holder_bundle, int(since), now):
                    raise Held(key, holder, int(since))
                continue  # its holder is gone
            if _isdir(holder_bundle):
                kept.append(line)
        kept += [f"{key}\t{container}\t{root}\t{bundle}\t{int(now)}" for key in keys]
        tmp = f"{ledger}.{posix.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
        posix.replace(tmp, ledger)
    finally:
        posix.close(lock)  # releases the lock


def mps_daemon_alive(mps_dir: str, gpu: str) -> bool:
    """Whether the GPU's MPS control daemon runs. Without it CUDA would run the task outside MPS,
    without its memory limit (NVIDIA's nvidia-cuda-mps-control(1)), so the task must not start."""
    try:
        with open(f"{mps_dir}/{gpu}/{MPS_DAEMON_PID}", encoding="utf-8") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            comm = f.read()
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return comm.startswith("nvidia-cuda-mps") and state not in ("Z", "X")  # a zombie serves no one
    except (OSError, ValueError, IndexError):
        return False


def mps_relay_alive(mps_dir: str) -> bool:
    """Whether mps_relay.py runs: the socket a slot task reaches its daemon through (gpu-swarm-mps starts it)."""
    try:
        with open(f"{mps_dir}/{MPS_RELAY_PID}", encoding="utf-8") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # python3 /opt/.../mps_relay.py: an argument named so
            return any(arg.rpartition(b"/")[2].startswith(b"mps_relay") for arg in f.read().split(b"\0"))
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------- config.json, read and written fast


def _no_default(value):
    raise TypeError(f"{type(value).__name__} is not JSON")


def codec():
    """(loads, dumps) that json.loads/json.dumps would be, from the C accelerator _json alone."""
    try:
        import _json

        class Context:  # what _json's scanner reads from a JSONDecoder
            strict, object_hook, object_pairs_hook = True, None, None
            parse_float, parse_int, parse_constant = float, int, float

        scan = _json.make_scanner(Context)
        encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ": ", ", ",
                                    False, False, True)
    except (ImportError, AttributeError, TypeError):  # another Python: the package, slower but the same
        import json
        return json.loads, json.dumps

    def loads(text: str):
        text = text.strip(" \t\n\r")
        try:
            value, end = scan(text, 0)
            if end == len(text):
                return value
        except (StopIteration, ValueError, SystemError):  # SystemError: its error needs json.decoder loaded
            pass
        import json  # the error path: the package says what is wrong, and where
        return json.loads(text)

    def dumps(value) -> str:
        return "".join(encode(value, 0))
    return loads, dumps


def rewrite(path: str, text: str) -> None:
    mode = posix.stat(path).st_mode & 0o777
    # The bundle directory is the container's own; one runtime works in it at a time.
    tmp = f"{path.rpartition('/')[0] or '.'}/.config.json.{posix.getpid()}.tmp"
    fd = posix.open(tmp, posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC, 0o600)  # a crashed run's leftover goes
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        posix.chmod(tmp, mode)
        posix.replace(tmp, path)
    except BaseException:
        try:
            posix.unlink(tmp)
        except OSError:
            pass
        raise
