"""What the swarm did: nodes, their advertised GPUs, and where each task landed.

Every GPU a task holds is read from the task's own process environment
(DOCKER_RESOURCE_<KIND>), not from the scheduler's plan, so the view shows
what a workload would really see.
"""
from __future__ import annotations

import json
from pathlib import Path

from localswarm.host import Engine
from localswarm.nodes import Node, docker
from swarm.commands import advertised_gpus
from swarm.gpu_kind import resource_env_name


def _inspect(manager: Node, engine: Engine, what: str, ids: list[str]) -> list[dict]:
    if not ids:
        return []
    return json.loads(docker(manager, engine, what, "inspect", *ids).stdout)


def _task_gpus(task: dict, env_name: str, nodes_by_id: dict, engine: Engine) -> list[str]:
    status = task.get("Status", {}).get("ContainerStatus", {})
    environ = []
    pid = status.get("PID") or 0
    try:
        # Engines share the host's PID namespace, so the task's PID 1 is readable here.
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if pid else []
    except OSError:
        pass
    if not environ and status.get("ContainerID") and task.get("NodeID") in nodes_by_id:
        node = nodes_by_id[task["NodeID"]]
        out = docker(node, engine, "inspect", "--format", "{{json .Config.Env}}", status["ContainerID"],
                     check=False).stdout
        environ = json.loads(out) if out.strip() else []
    for entry in environ:
        if entry.startswith(env_name + "="):
            return sorted(v for v in entry.split("=", 1)[1].split(",") if v)
    return []


def collect(nodes: list[Node], engine: Engine, kind: str) -> dict:
    """The swarm as the manager sees it, with task GPUs read from each task's environment."""
    manager = next(n for n in nodes if n.role == "manager")
    by_name = {n.name: n for n in nodes}
    node_ids = docker(manager, engine, "node", "ls", "-q").stdout.split()
    view_nodes, nodes_by_id = [], {}
    for info in _inspect(manager, engine, "node", node_ids):
        name = info["Description"]["Hostname"]
        if name in by_name:
            nodes_by_id[info["ID"]] = by_name[name]
        resources = json.dumps(info["Description"].get("Resources", {}).get("GenericResources") or [])
        view_nodes.append({
            "name": name,
            "role": info["Spec"]["Role"],
            "address": info["Status"].get("Addr", ""),
            "state": info["Status"]["State"],
            "gpus": advertised_gpus(resources, kind),
            "id": info["ID"],
        })
    view_nodes.sort(key=lambda n: by_name[n["name"]].index if n["name"] in by_name else 1 << 30)
    names_by_id = {n["id"]: n["name"] for n in view_nodes}

    env_name = resource_env_name(kind)
    services = []
    service_ids = docker(manager, engine, "service", "ls", "-q").stdout.split()
    for svc in _inspect(manager, engine, "service", service_ids):
        task_ids = docker(manager, engine, "service", "ps", "-q", "--no-trunc",
                          "--filter", "desired-state=running", svc["ID"]).stdout.split()
        tasks = []
        for task in _inspect_tasks(manager, engine, task_ids):
            status = task["Status"]
            tasks.append({
                "slot": task.get("Slot", 0),
                "node": names_by_id.get(task.get("NodeID", ""), ""),
                "state": status["State"],
                "gpus": _task_gpus(task, env_name, nodes_by_id, engine),
                "error": status.get("Err", ""),
            })
        replicated = svc["Spec"].get("Mode", {}).get("Replicated")
        services.append({
            "name": svc["Spec"]["Name"],
            "replicas": replicated.get("Replicas", 1) if replicated else None,
            "tasks": sorted(tasks, key=lambda t: (t["slot"], t["node"])),
        })
    for n in view_nodes:
        del n["id"]
    return {"nodes": view_nodes, "services": sorted(services, key=lambda s: s["name"])}


def _inspect_tasks(manager: Node, engine: Engine, ids: list[str]) -> list[dict]:
    # `docker inspect` resolves task IDs too; there is no `docker task inspect`.
    return json.loads(docker(manager, engine, "inspect", *ids).stdout) if ids else []


def converged(view: dict) -> bool:
    """Every wanted task is running, or pending for a reason the scheduler gave."""
    for svc in view["services"]:
        tasks = svc["tasks"]
        if svc["replicas"] is not None and len(tasks) < svc["replicas"]:
            return False
        for t in tasks:
            if not (t["state"] == "running" or (t["state"] == "pending" and t["error"])):
                return False
    return True


def render_table(view: dict) -> str:
    """One row per advertised GPU (free or held), then the tasks that hold none."""
    holders = {}
    for svc in view["services"]:
        for t in svc["tasks"]:
            for gpu in t["gpus"]:
                holders[(t["node"], gpu)] = (svc["name"], t)
    rows = [("NODE", "ROLE", "GPU", "SERVICE", "TASK", "STATE", "REASON")]
    for node in view["nodes"]:
        for gpu in node["gpus"] or ["-"]:
            svc, t = holders.get((node["name"], gpu), ("-", None))
            rows.append((node["name"], node["role"], gpu, svc, str(t["slot"]) if t else "-",
                         t["state"] if t else ("free" if gpu != "-" else node["state"]), ""))
    for svc in view["services"]:
        for t in svc["tasks"]:
            if not t["gpus"]:
                rows.append((t["node"] or "-", "", "-", svc["name"], str(t["slot"]), t["state"], t["error"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
