#!/usr/bin/env python3
"""gpu-swarm's guard: the `create` step of the node's OCI runtime (see gpu-swarm-runtime).

Before the container is created it rewrites the bundle's config.json so that the task
gets exactly the GPUs swarm assigned to it, then hands the same call to the delegate
(nvidia-container-runtime):
- a task that reserved whole GPUs gets NVIDIA_VISIBLE_DEVICES = those UUIDs;
- a task that reserved a slot of a shared GPU gets that GPU: the slot's variable becomes
  the whole-GPU variable the toolkit reads, plus GPU_SWARM_GPU, GPU_SWARM_SLOT, GPU_SWARM_SHARE;
  on an MPS pool also its memory and thread limits and, where its MPS pipe directory goes, the
  GPU's MPS relay folder (mps_relay.py's socket, read-only), never the daemon's own pipe;
- a task that reserved nothing gets NVIDIA_VISIBLE_DEVICES=void, whatever its image says
  (every nvidia/cuda image sets NVIDIA_VISIBLE_DEVICES=all), and loses cdi.k8s.io
  annotations, which the toolkit honours before the environment;
- a task that reserved EFA devices (AWS-EFA) also gets their /dev/infiniband nodes (guard_efa.py);
  many processes share an EFA device, so they are not claimed in the ledger.
Every GPU (or slot) a container is given is written to the ledger (LEDGER in the settings):
a second container that names a GPU a live container holds does not start, whatever its
environment says. A claim lives as long as its holder's bundle and init process, so a crash
leaves nothing behind. A container started by `docker run --gpus` carries the toolkit's
prestart hook, which swarm services cannot add: it is an administrator's explicit request and
passes untouched (unless ALLOW_DOCKER_RUN_GPUS=false), outside the ledger.
It fails closed: anything it cannot read or does not recognise stops the container with a
message that `docker service ps --no-trunc` shows.

Every container start pays for this program, so it imports nothing it can do without: no re
(UUIDs are checked by hand), no json package (whose import pulls in re, enum and more, half of
the start-up; guard_files.py, a sibling, reads and writes the files with the C codec _json;
guard_efa.py is loaded for EFA tasks only, guard_mounts.py on MPS nodes only) and no os. The sh front imports it, so Python caches its bytecode. Stdlib only.
"""

import posix  # os without what it imports (stat, posixpath, _collections_abc): a tenth of a create
import sys
import time

from guard_files import MPS_TASK_DIR, Held, absolute, claim, codec, mps_daemon_alive, mps_relay_alive, rewrite

_HEX = frozenset("0123456789abcdefABCDEF")
_UUID_GROUPS = (8, 4, 4, 4, 12)
TOOLKIT_HOOK = "nvidia-container-runtime-hook"
CDI_ANNOTATION = "cdi.k8s.io/"
MPS_PIPE_ENV, MPS_MEMORY_ENV, MPS_THREADS_ENV = \
    "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def _normpath(path: str) -> str:
    """An absolute path without ., .. and doubled slashes; "" for a relative one (proc, tmpfs)."""
    if not path.startswith("/"):
        return ""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


class Refused(Exception):
    """The container must not start: the message says why and what to do."""


def read_settings(path: str) -> dict[str, str]:
    settings = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                settings[key] = value
    for key in ("DELEGATE", "KIND"):
        if not settings.get(key):
            raise Refused(f"{path} has no {key}; run the GPU agent (systemctl restart gpu-swarm-agent)")
    return settings


def env_name(kind: str) -> str:
    return "DOCKER_RESOURCE_" + kind.upper()  # swarmkit's EnvFormat, as the agent derives it


def _hex_uuid(text: str) -> bool:
    parts = text.split("-")
    return len(parts) == 5 and all(len(p) == n and _HEX.issuperset(p) for p, n in zip(parts, _UUID_GROUPS))


def is_uuid(value: str) -> bool:
    """A full GPU or MIG UUID, as gpu_resources.UUID_RE says (tests keep the two equal)."""
    if value.startswith("MIG-GPU-"):
        uuid, _, rest = value[8:].partition("/")
        gi, sep, ci = rest.partition("/")
        return _hex_uuid(uuid) and bool(sep) and gi.isdigit() and ci.isdigit() and gi.isascii() and ci.isascii()
    return value.startswith(("GPU-", "MIG-")) and _hex_uuid(value[4:])


def slot_of(value: str) -> tuple[str, int] | None:
    """(GPU UUID, slot number) of a slot value such as GPU-...-s3, as gpu_resources.SLOT_RE reads it."""
    gpu, sep, number = value.rpartition("-s")
    if sep and number.isdigit() and number.isascii() and is_uuid(gpu):
        return gpu, int(number)
    return None


def _values(env: list[str], name: str) -> list[str] | None:
    found = None
    for entry in env:
        key, sep, value = entry.partition("=")
        if sep and key == name:
            found = [v for v in value.split(",") if v]  # the last one wins, as in execve
    return found


def _value(env: list[str], name: str) -> str | None:
    found = None
    for entry in env:
        key, sep, value = entry.partition("=")
        if sep and key == name:
            found = value
    return found


def _set(env: list[str], name: str, value: str) -> list[str]:
    return [e for e in env if e.partition("=")[0] != name] + [f"{name}={value}"]


def _has_toolkit_hook(spec: dict) -> bool:
    hooks = spec.get("hooks") or {}
    for stage in ("prestart", "createRuntime"):
        for hook in hooks.get(stage) or []:
            if TOOLKIT_HOOK in (hook.get("path") or "").rpartition("/")[2]:
                return True
    return False


class Decision:
    """What guard() decided: the spec to run, what to log, the ledger keys to claim, and the
    GPU whose MPS daemon must be alive (None: no MPS)."""

    def __init__(self, spec: dict, text: str, claims: list[str], mps_gpu: str | None = None):
        self.spec, self.text, self.claims, self.mps_gpu = spec, text, claims, mps_gpu


def guard(spec: dict, settings: dict[str, str]) -> Decision:
    """The spec as the container may run it, and what was decided."""
    process = spec.setdefault("process", {})
    env = list(process.get("env") or [])
    if settings.get("ALLOW_DOCKER_RUN_GPUS", "true") == "true" and _has_toolkit_hook(spec):
        return Decision(spec, "docker run --gpus: left as requested", [])
    node_gpus = {g for g in settings.get("GPUS", "").split(",") if g}
    slots = int(settings.get("SLOTS_PER_GPU") or 0)
    whole_var = env_name(settings["KIND"])
    whole = _values(env, whole_var)
    shared_kind = settings.get("SHARED_KIND", "")
    shared_var = env_name(shared_kind) if shared_kind else ""
    shared = _values(env, shared_var) if shared_kind else None
    fix = "remove it from the service's environment and reserve GPUs with generic_resources"

    for name in [whole_var] + ([shared_var] if shared_kind else []):
        # Swarm appends its variable after the service's own environment: two of them means
        # the service set it too. (One that the service set alone is caught by the ledger
        # when another container holds that GPU; see README "Isolation".)
        if sum(e.partition("=")[0] == name for e in env) > 1:
            raise Refused(f"{name} is set by the service as well as by swarm; {fix}")
    for uuid in whole or []:
        if not is_uuid(uuid):
            raise Refused(f"{whole_var}={uuid} is not a GPU swarm assigned: swarm sets this variable to full GPU "
                          f"UUIDs. Remove it from the service's environment and reserve GPUs with generic_resources")
        if node_gpus and uuid not in node_gpus:
            raise Refused(f"{whole_var} names {uuid}, which this node does not have; {fix}")
    slot = slot_of(shared[0]) if shared and len(shared) == 1 else None
    if whole and shared and whole != [slot[0] if slot else ""]:
        # (whole == the slot's GPU: this guard mapped the slot already, on an earlier create.)
        raise Refused(f"the task holds whole GPUs and a shared slot ({shared_var}); reserve one kind")
    if whole and shared_kind and not shared:
        # A pool that shares advertises slots only: swarm never sets the whole-GPU variable here.
        raise Refused(f"{whole_var} names a whole GPU, but this node shares its GPUs and swarm gives its tasks "
                      f"slots only; {fix}, of {shared_kind}")
    if shared is not None and len(shared) != 1:
        raise Refused(f"a task may hold one slot of a shared GPU, it holds {len(shared)}: reserve value 1 of "
                      f"{shared_kind}")

    annotations = spec.get("annotations") or {}
    dropped = sorted(k for k in annotations if k.startswith(CDI_ANNOTATION))
    if dropped:
        spec["annotations"] = {k: v for k, v in annotations.items() if k not in dropped}
    mps = settings.get("SHARING") == "mps"
    mps_dir = settings.get("MPS_DIR", "")
    if mps_dir:
        _refuse_mps_mounts(spec, mps_dir, slot[0] if slot and mps else None)
    claims, mps_gpu = [], None
    if shared:
        if not slot or (node_gpus and slot[0] not in node_gpus) or (slots and slot[1] >= slots):
            raise Refused(f"{shared_var}={shared[0]} is not a slot of a GPU of this node")
        gpu = slot[0]
        env = _set(env, whole_var, gpu)  # what the toolkit's swarm-resource reads
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", gpu)
        env = _set(env, "GPU_SWARM_GPU", gpu)
        env = _set(env, "GPU_SWARM_SLOT", shared[0])
        env = _set(env, "GPU_SWARM_SHARE", f"1/{settings.get('SLOTS_PER_GPU', '?')}")
        text = f"slot {shared[0]} of {gpu}"
        if mps:
            env = _mps(spec, env, gpu, settings)
            mps_gpu = gpu
            text += " (MPS)"
        claims = [shared[0]]
    elif whole:
        # The toolkit already prefers the swarm variable; saying it twice holds even if its
        # swarm-resource setting were lost.
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", ",".join(whole))
        text = f"GPUs {','.join(whole)}"
        claims = list(whole)
    else:
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", "void")
        text = "no GPU reserved: none given"
    efa_kind = settings.get("EFA_KIND")  # only on a node that advertises EFA devices
    if efa_kind:
        text += _efa(spec, env, efa_kind, settings.get("EFA_DEVICES", ""))
    if dropped:
        text += f"; removed annotations {', '.join(dropped)}"
    process["env"] = env
    return Decision(spec, text, claims, mps_gpu)


def _efa(spec: dict, env: list[str], kind: str, node_devices: str) -> str:
    """The EFA devices swarm assigned (DOCKER_RESOURCE_AWS-EFA=rdmap16s27,...), given as guard_efa.py gives them."""
    name = env_name(kind)
    fix = f"remove it from the service's environment and reserve {kind} with generic_resources"
    if sum(e.partition("=")[0] == name for e in env) > 1:
        raise Refused(f"{name} is set by the service as well as by swarm; {fix}")
    wanted = _values(env, name)
    if not wanted:
        return ""
    known = dict(item.partition(":")[::2] for item in node_devices.split(",") if item)
    for device in (d for d in wanted if d not in known):
        raise Refused(f"{name} names {device}, which is not an EFA device of this node "
                      f"({', '.join(sorted(known)) or 'none'}); {fix}")
    from guard_efa import NotGiven, add_devices  # only tasks that reserved EFA load it
    try:
        add_devices(spec, [known[device] for device in wanted])
    except NotGiven as e:
        raise Refused(str(e))
    return f"; EFA {','.join(wanted)}"


def _refuse_mps_mounts(spec: dict, mps_dir: str, own_gpu: str | None) -> None:
    """No container reaches an MPS daemon's folder but through the one mount added here: a slot task's GPU's
    relay folder (mps_relay.py), never the daemon's own pipe, whose sockets take control commands. Compared by
    the real host path (guard_mounts.py): a symlink (/var/run), a bind of the folder or of one above it, the
    folder's parents (/run/gpu-swarm, /run, /) and the host's /proc all reach it."""
    from guard_mounts import mount_table, places, reaches, real  # MPS nodes only
    own = f"{mps_dir}/{own_gpu}/{MPS_TASK_DIR}" if own_gpu else None
    found = None
    for mount in spec.get("mounts") or []:
        text = mount.get("source") or ""
        if not text.startswith("/"):
            continue  # proc, tmpfs, overlay: no host path
        source = real(text)
        if own and source == real(own):
            continue
        if found is None:
            found = places(real(mps_dir), mount_table())
        if reaches(source, found):
            where = "" if source == _normpath(text) else f" (on the host: {source})"
            raise Refused(f"the container mounts {text}{where}, which reaches {mps_dir}, where the node's MPS daemons "
                          "listen (or, for /proc, every process's files): only a task that reserved a slot of an MPS "
                          "pool reaches its GPU's daemon, through the relay folder the node mounts for it: remove "
                          "the mount")


def mib(text: str) -> int | None:
    """MiB in a CUDA memory limit such as 4G, 4096M, 0=4G or 0=512MB; None when not one."""
    _, _, text = text.rpartition("=")
    text = text.strip().upper()
    for suffix, factor in (("GB", 1024), ("MB", 1), ("G", 1024), ("M", 1)):
        if text.endswith(suffix):
            number = text[: -len(suffix)]
            return int(number) * factor if number.isdigit() and number.isascii() else None
    return None


def _mps(spec: dict, env: list[str], gpu: str, settings: dict[str, str]) -> list[str]:
    """A slot task on an MPS pool: its GPU's relay folder, mounted where its pipe directory goes, and its limits.

    The memory limit is the slot's share unless the service asks for less with its own
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (never more: the other slots' shares are theirs). The
    thread percentage is a ceiling MPS enforces, not a reservation: a service may set a lower one.
    What holds is the GPU's daemon's ceiling (gpu-swarm-mps sets the share before its server
    starts): a process can change its own environment, and MPS lets a client's variable raise its
    limit, so these are the task's information and a way to ask for less, never the limit itself."""
    share = int(settings["MPS_MEMORY_MIB"])
    asked = _value(env, MPS_MEMORY_ENV)
    limit = share
    if asked is not None:
        limit = mib(asked) or 0
        if "," in asked or not 0 < limit <= share:
            raise Refused(f"{MPS_MEMORY_ENV}={asked}: a slot of this GPU has {share} MiB (its memory / "
                          f"{settings.get('SLOTS_PER_GPU')} slots); ask for at most 0={share}M, such as 0=4G, or "
                          "leave it unset to get the whole share")
    threads = _value(env, MPS_THREADS_ENV)
    ceiling = settings.get("MPS_THREAD_PERCENT") or "100"
    if threads is None:
        threads = ceiling
    elif not (threads.isdigit() and threads.isascii() and 1 <= int(threads) <= 100):
        raise Refused(f"{MPS_THREADS_ENV}={threads}: expected a whole percentage from 1 to 100")
    elif int(threads) > int(ceiling):
        # The daemon holds every client to it (gpu-swarm-mps): more would be less, without a word.
        raise Refused(f"{MPS_THREADS_ENV}={threads}: a slot of this GPU may use at most {ceiling} % of its threads "
                      f"(100 / {settings.get('SLOTS_PER_GPU')} slots, the GPU's MPS daemon's ceiling); ask for at "
                      f"most {ceiling}, or leave it unset")
    pipe = f"{settings['MPS_DIR']}/{gpu}/pipe"
    env = _set(env, MPS_PIPE_ENV, pipe)
    env = _set(env, MPS_MEMORY_ENV, f"0={limit}M")  # device 0: the one GPU the container sees
    env = _set(env, MPS_THREADS_ENV, threads)
    # The relay's folder where the task looks for the pipe: its one socket passes CUDA clients to the daemon
    # and refuses control commands (`set_device_pinned_mem_limit` would raise the GPU's ceiling for every
    # client). Read-only: a client only connects, and no task removes the socket its neighbours need.
    relay = f"{settings['MPS_DIR']}/{gpu}/{MPS_TASK_DIR}"
    mounts = spec.setdefault("mounts", [])
    for mount in mounts:
        if _normpath(mount.get("destination") or "") == pipe and _normpath(mount.get("source") or "") != relay:
            raise Refused(f"the container mounts {mount.get('source') or mount.get('type')} at {pipe}, where the node "
                          "gives a slot task its GPU's MPS socket: remove the mount")
    if not any(m.get("destination") == pipe for m in mounts):
        mounts.append({"destination": pipe, "type": "bind", "source": relay,
                       "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]})
    return env


# ---------------------------------------------------------------- the runtime's create


def bundle_of(args: list[str]) -> str:
    """The bundle of a runc-style `create`: --bundle/-b after the subcommand, else the current directory."""
    after = args[args.index("create") + 1:] if "create" in args else args
    for i, arg in enumerate(after):
        if arg in ("--bundle", "-b") and i + 1 < len(after):
            return after[i + 1]
        if arg.startswith("--bundle="):
            return arg.split("=", 1)[1]
    return "."


def _global_option(args: list[str], name: str) -> str | None:
    """A runc global option's value (before the subcommand): --log PATH or --log=PATH."""
    for i, arg in enumerate(args):
        if arg == "create":
            return None
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def report_error(args: list[str], message: str) -> None:
    """Say why the container did not start where containerd reads a runtime's error: runc's --log
    file (it ignores stderr). Whoever runs the create prints it on stderr too."""
    log = _global_option(args, "--log")
    if not log:
        return
    if _global_option(args, "--log-format") == "json":
        _, dumps = codec()
        line = dumps({"level": "error", "msg": message, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    else:
        line = 'level=error msg="' + message.replace("\\", "\\\\").replace('"', '\\"') + '"'
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def check(config: str, args: list[str]) -> tuple[bool, str]:
    """(True, the delegate to run) when the container may start: its config.json is rewritten and
    its GPUs claimed. (False, why not) otherwise, said where containerd reads it as well. Used by
    main() (a create run here) and by guard_server.py (a create handed over by the sh front)."""
    try:
        settings = read_settings(config)
        loads, dumps = codec()
        bundle = bundle_of(args)
        path = f"{bundle}/config.json"
        with open(path, encoding="utf-8") as f:
            original = f.read()
        spec = loads(original)
        before = dumps(spec)
        decision = guard(spec, settings)
        if decision.mps_gpu and not mps_relay_alive(settings["MPS_DIR"]):
            raise Refused(f"the MPS relay of this node ({settings['MPS_DIR']}/{MPS_TASK_DIR}) is not running, so a "
                          "slot task could not reach its MPS daemon; systemctl restart gpu-swarm-mps")
        if decision.mps_gpu and not mps_daemon_alive(settings["MPS_DIR"], decision.mps_gpu):
            raise Refused(f"the MPS control daemon of {decision.mps_gpu} is not running (see "
                          f"{settings['MPS_DIR']}/{decision.mps_gpu}/log); without it the task would run outside "
                          "MPS and its memory limit. The node's health watcher reports it; systemctl restart "
                          "gpu-swarm-mps")
        after = dumps(decision.spec)
        if after != before:
            rewrite(path, after)
        if decision.claims:
            ledger = settings.get("LEDGER")
            if not ledger:
                raise Refused(f"{config} has no LEDGER, so this GPU's holders cannot be checked; run the GPU agent "
                              "(systemctl restart gpu-swarm-agent)")
            try:
                claim(ledger, decision.claims, args[-1] if args else "", _global_option(args, "--root") or "/run/runc",
                      absolute(bundle), time.time())
            except Held as held:
                what = f"slot {held.key}" if slot_of(held.key) else f"GPU {held.key}"
                # Swarm can give a GPU twice: its scheduler re-books running tasks after a leader change
                # (docs/stacks/isolation.md). So the message names that cause beside a hand-set variable.
                raise Refused(f"{what} is held by container {held.holder[:12]} (since "
                              f"{time.strftime('%H:%M:%S', time.gmtime(held.since))} UTC): a GPU that a running "
                              "container holds is never given to another. If both reserved it, swarm gave it twice, "
                              "as its scheduler does after a leader change, and this task starts once the holder "
                              "ends. If one set DOCKER_RESOURCE_* itself (this service, or the holder: docker ps "
                              f"--filter id={held.holder[:12]}), remove it from that service's environment and "
                              "reserve GPUs with generic_resources")
        if settings.get("LOG"):
            with open(settings["LOG"], "a", encoding="utf-8") as log:
                log.write(f"{args[-1] if args else '?'}: {decision.text}\n")
        return True, settings["DELEGATE"]
    except Refused as e:
        message = f"gpu-swarm guard: {e}; the container was not started"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        message = (f"gpu-swarm guard: cannot check this container ({type(e).__name__}: {e}); it was not started. "
                   f"See {config} and the GPU agent's log")
    report_error(args, message)
    return False, message


def main(argv: list[str]) -> int:
    config, args = argv[0], argv[1:]
    ok, said = check(config, args)
    if not ok:
        print(said, file=sys.stderr)
        return 1
    posix.execv(said, [said, *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
