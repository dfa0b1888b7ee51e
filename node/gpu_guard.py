#!/usr/bin/env python3
"""gpu-swarm's guard: the `create` step of the node's OCI runtime (see gpu-swarm-runtime).

Before the container is created it rewrites the bundle's config.json so that the task
gets exactly the GPUs swarm assigned to it, then hands the same call to the delegate
(nvidia-container-runtime):
- a task that reserved whole GPUs gets NVIDIA_VISIBLE_DEVICES = those UUIDs;
- a task that reserved a slot of a shared GPU gets that GPU: the slot's variable becomes
  the whole-GPU variable the toolkit reads, plus GPU_SWARM_GPU, GPU_SWARM_SLOT, GPU_SWARM_SHARE;
- a task that reserved nothing gets NVIDIA_VISIBLE_DEVICES=void, whatever its image says
  (every nvidia/cuda image sets NVIDIA_VISIBLE_DEVICES=all), and loses cdi.k8s.io
  annotations, which the toolkit honours before the environment.
A container started by `docker run --gpus` carries the toolkit's prestart hook, which
swarm services cannot add: it is an administrator's explicit request and passes untouched
(unless ALLOW_DOCKER_RUN_GPUS=false).
It fails closed: anything it cannot read or does not recognise stops the container with a
message that `docker service ps --no-trunc` shows. Stdlib only; Python starts only here.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

_HEX = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
UUID_RE = re.compile(rf"GPU-{_HEX}|MIG-{_HEX}|MIG-GPU-{_HEX}/\d+/\d+")
SLOT_RE = re.compile(rf"(?P<gpu>{UUID_RE.pattern})-s(?P<slot>\d+)")
TOOLKIT_HOOK = "nvidia-container-runtime-hook"
CDI_ANNOTATION = "cdi.k8s.io/"


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


def _values(env: list[str], name: str) -> list[str] | None:
    found = None
    for entry in env:
        key, sep, value = entry.partition("=")
        if sep and key == name:
            found = [v for v in value.split(",") if v]  # the last one wins, as in execve
    return found


def _set(env: list[str], name: str, value: str) -> list[str]:
    return [e for e in env if e.partition("=")[0] != name] + [f"{name}={value}"]


def _has_toolkit_hook(spec: dict) -> bool:
    hooks = spec.get("hooks") or {}
    for stage in ("prestart", "createRuntime"):
        for hook in hooks.get(stage) or []:
            if TOOLKIT_HOOK in os.path.basename(hook.get("path", "")):
                return True
    return False


def guard(spec: dict, settings: dict[str, str]) -> tuple[dict, str]:
    """The spec as the container may run it, and what was decided (for the log)."""
    process = spec.setdefault("process", {})
    env = list(process.get("env") or [])
    if settings.get("ALLOW_DOCKER_RUN_GPUS", "true") == "true" and _has_toolkit_hook(spec):
        return spec, "docker run --gpus: left as requested"
    node_gpus = {g for g in settings.get("GPUS", "").split(",") if g}
    whole_var = env_name(settings["KIND"])
    whole = _values(env, whole_var)
    shared_kind = settings.get("SHARED_KIND", "")
    shared = _values(env, env_name(shared_kind)) if shared_kind else None

    for name in [whole_var] + ([env_name(shared_kind)] if shared_kind else []):
        # Swarm appends its variable after the service's own environment: two of them means
        # the service set it too. (A service that sets it alone, to a GPU of this node, cannot
        # be told from swarm here; the preview refuses that in stack files.)
        if sum(e.partition("=")[0] == name for e in env) > 1:
            raise Refused(f"{name} is set by the service as well as by swarm; remove it from the service's "
                          "environment and reserve GPUs with generic_resources")
    for uuid in whole or []:
        if not UUID_RE.fullmatch(uuid):
            raise Refused(f"{whole_var}={uuid} is not a GPU swarm assigned: swarm sets this variable to full GPU "
                          f"UUIDs. Remove it from the service's environment and reserve GPUs with generic_resources")
        if node_gpus and uuid not in node_gpus:
            raise Refused(f"{whole_var} names {uuid}, which this node does not have; remove it from the service's "
                          "environment and reserve GPUs with generic_resources")
    if whole and shared and whole != [SLOT_RE.fullmatch(shared[0])["gpu"] if SLOT_RE.fullmatch(shared[0]) else ""]:
        # (whole == the slot's GPU: this guard mapped the slot already, on an earlier create.)
        raise Refused(f"the task holds whole GPUs and a shared slot ({env_name(shared_kind)}); reserve one kind")
    if shared is not None and len(shared) != 1:
        raise Refused(f"a task may hold one slot of a shared GPU, it holds {len(shared)}: reserve value 1 of "
                      f"{shared_kind}")

    annotations = spec.get("annotations") or {}
    dropped = sorted(k for k in annotations if k.startswith(CDI_ANNOTATION))
    if dropped:
        spec["annotations"] = {k: v for k, v in annotations.items() if k not in dropped}
    if shared is not None and not shared:
        raise Refused(f"{env_name(shared_kind)} is empty: a task reserves one slot")
    if shared:
        match = SLOT_RE.fullmatch(shared[0])
        if not match or (node_gpus and match["gpu"] not in node_gpus):
            raise Refused(f"{env_name(shared_kind)}={shared[0]} is not a slot of a GPU of this node")
        gpu = match["gpu"]
        env = _set(env, whole_var, gpu)  # what the toolkit's swarm-resource reads
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", gpu)
        env = _set(env, "GPU_SWARM_GPU", gpu)
        env = _set(env, "GPU_SWARM_SLOT", shared[0])
        env = _set(env, "GPU_SWARM_SHARE", f"1/{settings.get('SLOTS_PER_GPU', '?')}")
        decision = f"slot {shared[0]} of {gpu}"
    elif whole:
        # The toolkit already prefers the swarm variable; saying it twice holds even if its
        # swarm-resource setting were lost.
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", ",".join(whole))
        decision = f"GPUs {','.join(whole)}"
    else:
        env = _set(env, "NVIDIA_VISIBLE_DEVICES", "void")
        decision = "no GPU reserved: none given"
    if dropped:
        decision += f"; removed annotations {', '.join(dropped)}"
    process["env"] = env
    return spec, decision


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
    """Say why the container did not start where containerd reads a runtime's error (runc's --log
    file: it ignores stderr), and on stderr for anyone calling by hand."""
    print(message, file=sys.stderr)
    log = _global_option(args, "--log")
    if not log:
        return
    if _global_option(args, "--log-format") == "json":
        line = json.dumps({"level": "error", "msg": message,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    else:
        line = f'level=error msg="{message}"'
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def rewrite(path: str, spec: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o777
    # Not tempfile: its imports (random, shutil) are a tenth of this program's start, paid on
    # every container create. The bundle directory is the container's own; one runtime works in it.
    tmp = os.path.join(directory, f".config.json.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # a crashed run's leftover is overwritten
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    config, args = argv[0], argv[1:]
    try:
        settings = read_settings(config)
        path = os.path.join(bundle_of(args), "config.json")
        with open(path, encoding="utf-8") as f:
            original = f.read()
        spec, decision = guard(json.loads(original), settings)
        if json.dumps(spec) != json.dumps(json.loads(original)):
            rewrite(path, spec)
    except Refused as e:
        report_error(args, f"gpu-swarm guard: {e}; the container was not started")
        return 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        report_error(args, f"gpu-swarm guard: cannot check this container ({type(e).__name__}: {e}); it was not "
                           f"started. See {config} and the GPU agent's log")
        return 1
    if settings.get("LOG"):
        with open(settings["LOG"], "a", encoding="utf-8") as log:
            log.write(f"{args[-1] if args else '?'}: {decision}\n")
    delegate = settings["DELEGATE"]
    os.execv(delegate, [delegate, *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
