"""A user's compose file made runnable here: checked as `pulumi preview` checks it, pointed at images we serve.

Nothing outside this machine is reachable, so every image the local registry does not hold
is replaced by the stand-in: busybox with every applet, plus an nvidia-smi that lists the
GPUs the task was given. The service keeps its own command when the stand-in can run it,
so what users deploy is what runs.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

import yaml

from localswarm import registry
from localswarm.host import RehearsalError
from localswarm.nodes import REGISTRY
from swarm.labels import POOL_LABEL, POOL_SPOT_LABEL
from swarm.stack_files import StackFileError, validate_stack_file


def prepare_stack(path: Path, name: str, kind: str, gpus_per_node: int, total_gpus: int, *, scale: bool,
                  say: Callable[[str], None], shared_kind: str | None = None, total_slots: int = 0) -> dict:
    """{"file", "text"}: the checked compose file as `pulumi up` would deploy it (its Compose GPU
    requests rewritten into reservations, swarm/compose_gpus.py), with its images replaced where needed.

    gpus_per_node: the most whole GPUs a node has (0: every GPU node shares); shared_kind:
    the kind of the slots, when some node shares. With scale, each GPU service gets one
    replica more than there are GPUs (or slots) for it, so one waits. The rehearsal's nodes are
    on-demand: the spot pools' stop grace period is rehearsed on a spot pool of Pulumi's CLI
    (tests/test_pulumi_spot.py).
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise RehearsalError(f"--stack {path}: cannot read it ({e.strerror})") from None
    try:
        info = validate_stack_file(text, kind=kind, max_gpus_per_node=gpus_per_node, shared_kind=shared_kind,
                                   source=str(path), pools={"rehearsal": {POOL_LABEL: "rehearsal",
                                                                          POOL_SPOT_LABEL: "false"}})
    except StackFileError as e:
        raise RehearsalError(str(e)) from None
    for rewrite in info.rewrites:
        say(f"  {name}: rewritten for swarm: {rewrite}")
    for warning in info.warnings:
        say(f"  {name}: warning: {warning}")
    gpu_services = {svc.name: svc for svc in info.gpu_services}
    doc = yaml.safe_load(info.content)
    for svc_name, svc in (doc.get("services") or {}).items():
        image = svc.get("image", "")
        if not image.startswith(REGISTRY + "/"):
            svc["image"] = registry.STANDIN_IMAGE
            missing = _missing_programs(svc)
            note = ""
            if missing:
                svc.pop("command", None)
                svc.pop("entrypoint", None)
                note = f"; its command needs {', '.join(missing)}, which the stand-in lacks, so it runs the stand-in's own"
            say(f"  {name}/{svc_name}: image {image} is not available offline; using the stand-in{note}")
        if scale and svc_name in gpu_services:
            slots = gpu_services[svc_name].slots
            total = total_slots if slots else total_gpus
            if total:
                svc.setdefault("deploy", {})["replicas"] = total + 1
                what = "GPU slots" if slots else "GPUs"
                say(f"  {name}/{svc_name}: scaled to {total + 1} replicas, one more than there are {what}")
    return {"file": str(path), "text": yaml.safe_dump(doc, sort_keys=False)}


def _missing_programs(service: dict) -> list[str]:
    """The programs the service's entrypoint and command start that the stand-in does not have."""
    wanted = []
    for key in ("entrypoint", "command"):
        value = service.get(key)
        words = shlex.split(value) if isinstance(value, str) else list(value or [])
        if words:
            wanted.append(words[0])
            if Path(words[0]).name in ("sh", "bash") and "-c" in words:
                # `sh -c '...'`: the programs of the script it runs.
                script = words[words.index("-c") + 1] if words.index("-c") + 1 < len(words) else ""
                wanted += [part.split()[0] for part in _commands_of(script)]
            break
    have = registry.standin_programs()
    return sorted({Path(w).name for w in wanted if Path(w).name not in have and w not in _SHELL_BUILTINS})


# What `sh -c` runs without a program of that name: `exit 3` needs no `exit` in the image.
_SHELL_BUILTINS = ("exec", "exit", "return", "set", "export", "unset", "cd", "trap", "wait", "shift", "eval",
                   "read", ".", "source", "ulimit", "umask")


def _commands_of(script: str) -> list[str]:
    parts = []
    for piece in script.replace("&&", ";").replace("||", ";").replace("|", ";").split(";"):
        words = piece.split()
        while words and (words[0] in ("exec", "then", "do", "else", "!") or "=" in words[0]):
            words = words[1:]
        if words and words[0] not in ("if", "fi", "done", "for", "while", "case", "esac", "true", "false", ":"):
            parts.append(" ".join(words))
    return parts
