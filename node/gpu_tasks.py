#!/usr/bin/env python3
"""Which swarm task holds each GPU of this node, and which task a GPU process belongs to.

For the metrics exporter (gpu_metrics.py). Both come from what dockerd already knows:
- a task's GPUs are the DOCKER_RESOURCE_<KIND> (and <SHARED_KIND>, for slots) that swarm put in
  its container's configuration (.Config.Env), as the runtime guard reads them at its start;
- its service and task are Docker's com.docker.swarm.* labels on that container;
- a GPU process (NVML's running compute processes) is in a container when its cgroup path
  names the container's ID, which holds for cgroup v1 and v2 and for both of dockerd's cgroup
  drivers (/docker/<id>, /system.slice/docker-<id>.scope).
Only the container list is asked at each scrape; a container's configuration never changes, so
each is inspected once. Stdlib only: the Engine API over its unix socket.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.parse
from dataclasses import dataclass

from contract import DOCKER_SERVICE_NAME, DOCKER_SOCKET, DOCKER_TASK_ID, DOCKER_TASK_NAME
from gpu_resources import SLOT_RE, resource_env_name

_CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


class DockerUnavailable(Exception):
    """dockerd did not answer: holders are unknown, the GPUs' own readings go on."""


@dataclass(frozen=True)
class Holder:
    service: str
    task: str  # <service>.<slot>.<task id>, as `docker ps` names the container
    container: str  # the container's short ID (12 hex digits), as `docker ps` shows it
    slot: str = ""  # the slot of a shared GPU (GPU-<uuid>-s<k>); "" for a whole GPU


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def docker_get(sock: str, path: str, timeout: float = 5, **query):
    """GET an Engine API path; query values that are not strings go as JSON (filters)."""
    return json.loads(docker_request(sock, "GET", path, timeout, **query))


def docker_request(sock: str, method: str, path: str, timeout: float = 5, **query) -> bytes:
    """An Engine API call with no body; its answer's body, when dockerd says 200 or 204."""
    params = urllib.parse.urlencode({k: v if isinstance(v, str) else json.dumps(v) for k, v in query.items()})
    conn = _UnixConnection(sock, timeout)
    try:
        conn.request(method, path + (f"?{params}" if params else ""))
        answer = conn.getresponse()
        body = answer.read()
    except (OSError, http.client.HTTPException) as e:
        raise DockerUnavailable(f"dockerd at {sock} did not answer {method} {path} ({e})")
    finally:
        conn.close()
    if answer.status not in (200, 204):
        raise DockerUnavailable(f"dockerd at {sock} answered {method} {path} with HTTP {answer.status}: "
                                f"{body.decode(errors='replace').strip()[:200]}")
    return body


def holders_from_env(env: list[str], labels: dict, container: str, kind: str, shared_kind: str) -> dict[str, Holder]:
    """{GPU UUID: Holder} of one task container, from swarm's variables in its configuration."""
    values = dict(entry.split("=", 1) for entry in env if "=" in entry)
    holder = Holder(labels.get(DOCKER_SERVICE_NAME, ""), labels.get(DOCKER_TASK_NAME, ""), container[:12])
    held = {}
    for value in values.get(resource_env_name(kind), "").split(","):
        if value:
            held[value] = holder
    for value in values.get(resource_env_name(shared_kind), "").split(",") if shared_kind else ():
        slot = SLOT_RE.fullmatch(value)
        if slot:
            held[slot["gpu"]] = Holder(holder.service, holder.task, holder.container, value)
    return held


def container_of(pid: int, proc: str = "/proc") -> str | None:
    """The 64-hex container ID in the process's cgroup path, or None (a process of the host)."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8") as f:
            found = _CONTAINER_ID.findall(f.read())
    except OSError:
        return None  # gone since NVML listed it, or in a PID namespace we cannot see
    return found[-1] if found else None  # nested: the innermost container


class Tasks:
    """The node's running task containers, refreshed at each scrape (one API call)."""

    def __init__(self, kind: str, shared_kind: str, sock: str = DOCKER_SOCKET, proc: str = "/proc"):
        self.kind, self.shared_kind, self.sock, self.proc = kind, shared_kind, sock, proc
        self._inspected: dict[str, tuple[dict[str, Holder], Holder]] = {}  # id -> (GPUs held, holder)
        self.by_gpu: dict[str, list[Holder]] = {}
        self.error: str | None = None

    def refresh(self) -> None:
        try:
            listed = docker_get(self.sock, "/containers/json", filters={"label": [DOCKER_TASK_ID]})
            alive = {c["Id"]: c.get("Labels") or {} for c in listed}
            for cid in set(self._inspected) - set(alive):
                del self._inspected[cid]  # gone: forget it
            for cid, labels in alive.items():
                if cid not in self._inspected:
                    env = (docker_get(self.sock, f"/containers/{cid}/json").get("Config") or {}).get("Env") or []
                    held = holders_from_env(env, labels, cid, self.kind, self.shared_kind)
                    self._inspected[cid] = (held, Holder(labels.get(DOCKER_SERVICE_NAME, ""),
                                                         labels.get(DOCKER_TASK_NAME, ""), cid[:12]))
            self.error = None
        except DockerUnavailable as e:
            self._inspected, self.error = {}, str(e)
        by_gpu: dict[str, list[Holder]] = {}
        for held, _ in self._inspected.values():
            for uuid, holder in held.items():
                by_gpu.setdefault(uuid, []).append(holder)
        self.by_gpu = {uuid: sorted(hs, key=lambda h: (h.slot, h.task)) for uuid, hs in by_gpu.items()}

    def holder_of_process(self, pid: int, gpu: str) -> Holder | None:
        """The task a GPU process runs in (with the slot it holds on that GPU), or None."""
        cid = container_of(pid, self.proc)
        if cid is None or cid not in self._inspected:
            return None
        held, holder = self._inspected[cid]
        return held.get(gpu, holder)
