"""Volumes of a Compose service on the swarm: what a bind source means on the node a task lands on.

A relative or `~` bind source is a path on the machine that runs `docker stack deploy` (the manager), which
the GPU node does not have, and swarm rejects the task. What to write instead depends on what the service
reads there: a file becomes a swarm config (its own bytes, on any node), the code an image is built from is
removed (the image has it), and a folder of data becomes a named volume. Called from compose_swarm.py.
"""
from __future__ import annotations

import posixpath
import re
from typing import Callable


def volume_problems(where: str, doc: dict, service: dict, context: str | None,
                    is_file: Callable[[str], bool] | None) -> list[str]:
    """Each volume swarm cannot mount as written, with the fix. context: the service's build context (None:
    no build); is_file(path): whether a relative source is a file beside the stack file (None: not known)."""
    volumes = service.get("volumes")
    if not isinstance(volumes, list):
        return []
    problems = []
    declared = doc.get("volumes") if isinstance(doc.get("volumes"), dict) else {}
    for i, volume in enumerate(volumes):
        kind, source = mount_source(volume)
        at = f"{where}.volumes[{i}]"
        if kind == "bind" and source.startswith((".", "~")):
            problems.append(f"{at}: {source} is a path on the machine that deploys (for a stack, the manager), so "
                            "the node the task lands on has no such path and swarm rejects the task. "
                            + _relative_bind_fix(source, mount_target(volume), context, service, is_file))
        elif kind == "volume" and source and source not in declared:
            problems.append(f"{at}: the named volume {source!r} is not declared; add it at the top level: "
                            f"volumes: {{{source}: {{}}}}")
    return problems


def _relative_bind_fix(source: str, target: str, context: str | None, service: dict,
                       is_file: Callable[[str], bool] | None) -> str:
    """What to write instead of a relative bind: it depends on what the service reads there."""
    base = source.rstrip("/").rsplit("/", 1)[-1]
    if is_file(source) if is_file else _looks_like_a_file(base, target):
        # A config holds the file's own bytes, wherever the task lands: the one form that keeps what it reads.
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "config"
        return (f"It is a file, which the service reads at {target}: make it a swarm config, created on a manager "
                f"before the stack deploys (docker config create {name} {source}), and mount it with configs: "
                f"[{{source: {name}, target: {target}}}] in the service and configs: {{{name}: {{external: true}}}} "
                f"at the top level (a named volume would be an empty folder where the service reads {target})")
    if _inside(source, context):
        return (f"It is in the service's build context ({context}), the code its image {str(service.get('image'))!r} "
                f"is built from: remove the mount, so the service runs the code in its image (a named volume "
                f"would keep the first image's copy of {target} and hide every later image's code); if it is "
                "data the service writes, use a named volume instead")
    name = volume_name(source)
    return (f"Use a named volume (`{name}:{target or '/data'}` with `volumes: {{{name}: {{}}}}` at the top level) "
            "or an absolute path that exists on every node the service can land on")


def volume_name(source: str) -> str:
    """A named volume's name after the folder a bind mounts: ~/.cache/huggingface -> huggingface."""
    base = source.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9_-]+", "-", base.lower()).strip("-._") or "data"


def _inside(source: str, context: str | None) -> bool:
    """Whether a relative path lies in a relative build context (both from the stack file's folder)."""
    if context is None or source.startswith("~") or "://" in context:
        return False
    path, root = posixpath.normpath(source), posixpath.normpath(context)
    return root == "." and not path.startswith("..") or path == root or path.startswith(root.rstrip("/") + "/")


def _looks_like_a_file(source: str, target: str) -> bool:
    """With no folder to look in: a source and target named with the same suffix (nginx.conf, router.yml)."""
    suffix = posixpath.splitext(source)[1]
    return bool(suffix) and posixpath.splitext(target)[1] == suffix


def mount_source(volume) -> tuple[str, str]:
    """(bind|volume|other, source) of a short or long volume entry."""
    if isinstance(volume, dict):
        return str(volume.get("type", "volume")), str(volume.get("source", "") or "")
    parts = str(volume).split(":")
    if len(parts) < 2:
        return "volume", ""  # an anonymous volume
    source = parts[0]
    return ("bind" if source.startswith(("/", ".", "~")) else "volume"), source


def mount_target(volume) -> str:
    if isinstance(volume, dict):
        return str(volume.get("target", ""))
    parts = str(volume).split(":")
    return parts[1] if len(parts) > 1 else parts[0]
