"""What the swarm did: nodes, their state and GPUs, and where each task landed with which GPUs.

A task's GPUs are read from its container's configuration on its node (`docker inspect`
.Config.Env, DOCKER_RESOURCE_<KIND>): what dockerd handed the runtime, whatever the
task's processes did with their environment since. When the node cannot be asked (its
engine is down), the manager's record of the assignment is shown and marked as such.
Everything is read through the engines' API (localswarm.api): `up` and the tests poll this.
"""
from __future__ import annotations

import http.client
import json
import re
import time
from datetime import datetime, timezone

from localswarm import api
from localswarm.host import Engine, RehearsalError
from localswarm.nodes import Node
from swarm.gpu_kind import resource_env_name, slot_gpu
from swarm.labels import CONDITION_LABEL, DRAINED_BY_LABEL, HEALTH_LABEL, HEALTH_LAST_LABEL, MAINTENANCE_LABEL
from swarm.rollout import advertised_gpus


def _get(node: Node, path: str, **query):
    try:
        return api.get(node.sock, path, **query)
    except (OSError, api.ApiError, http.client.HTTPException) as e:
        raise RehearsalError(f"{node.name}: GET {path}: {e}") from None


def _running_tasks(manager: Node, service_id: str) -> list[dict]:
    return _get(manager, "/tasks", filters={"service": [service_id], "desired-state": ["running"]})


def _container_env(node: Node, container: str) -> list[str] | None:
    try:
        return api.get(node.sock, f"/containers/{container}/json")["Config"]["Env"] or []
    except (OSError, api.ApiError, http.client.HTTPException, KeyError, TypeError):
        return None


def _assigned(task: dict, kind: str) -> list[str]:
    """The scheduler's assignment, as the manager records it on the task."""
    return sorted(r["NamedResourceSpec"]["Value"] for r in task.get("AssignedGenericResources") or []
                  if r.get("NamedResourceSpec", {}).get("Kind") == kind)


def _gpus_and_slots(whole: list[str], slots: list[str]) -> tuple[list[str], list[str]]:
    """A task's or node's real GPUs (a slot counts as its GPU), and its slots of shared GPUs."""
    return sorted(set(whole) | {slot_gpu(s) for s in slots}), sorted(slots)


def _from_env(env: list[str], name: str) -> list[str]:
    for entry in env:
        if entry.startswith(name + "="):
            return sorted(v for v in entry.split("=", 1)[1].split(",") if v)
    return []


def _age(timestamp: str) -> float | None:
    """Seconds since a Docker timestamp such as 2026-11-22T23:08:24.123456789Z."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", timestamp or "")
    if not match:
        return None
    when = datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return max(0.0, time.time() - when - float(match[2] or 0))


def collect(nodes: list[Node], engine: Engine, kind: str, shared_kind: str = "") -> dict:
    """The swarm as a manager sees it, with task GPUs read from each task's container.

    Each node and task lists its real GPUs ("gpus") and, where GPUs are shared, the slots it
    has or holds ("slots"): a task holding slot GPU-x-s2 is on GPU-x.
    """
    by_name = {n.name: n for n in nodes}
    manager = next((n for n in nodes if n.role == "manager" and _answers(n, engine)), None)
    if manager is None:
        return {"nodes": [{"name": n.name, "role": n.role, "address": n.address, "state": "unknown",
                           "availability": "unknown", "condition": "unknown", "gpus": [], "drained_by": "",
                           "maintenance": ""}
                          for n in nodes], "services": [], "error": "no manager's engine answers"}
    view_nodes, nodes_by_id = [], {}
    for info in _get(manager, "/nodes"):
        name = info["Description"]["Hostname"]
        if name in by_name:
            nodes_by_id[info["ID"]] = by_name[name]
        labels = info["Spec"].get("Labels") or {}
        resources = json.dumps(info["Description"].get("Resources", {}).get("GenericResources") or [])
        gpus, slots = _gpus_and_slots(advertised_gpus(resources, kind),
                                      advertised_gpus(resources, shared_kind) if shared_kind else [])
        view_nodes.append({
            "name": name,
            "id": info["ID"],
            "role": info["Spec"]["Role"],
            "address": info["Status"].get("Addr", ""),
            "state": info["Status"]["State"],  # ready / down / unknown
            "availability": info["Spec"].get("Availability", "active"),  # active / pause / drain
            **_condition(info["Description"].get("Engine", {}).get("Labels") or {}, labels),
            "drained_by": labels.get(DRAINED_BY_LABEL, ""),
            "maintenance": labels.get(MAINTENANCE_LABEL, ""),
            "gpus": gpus,
            "slots": slots,
        })
    view_nodes.sort(key=lambda n: (by_name[n["name"]].index if n["name"] in by_name else 1 << 30, n["id"]))
    state_of = {n["id"]: n["state"] for n in view_nodes}
    names_by_id = {n["id"]: n["name"] for n in view_nodes}

    env_name = resource_env_name(kind)
    shared_env = resource_env_name(shared_kind) if shared_kind else ""
    services = []
    for svc in _get(manager, "/services"):
        tasks = []
        for task in _running_tasks(manager, svc["ID"]):
            status = task["Status"]
            node_id = task.get("NodeID", "")
            state = status["State"]
            whole, slots, source = _assigned(task, kind), _assigned(task, shared_kind), "scheduler"
            container = status.get("ContainerStatus", {}).get("ContainerID")
            if container and node_id in nodes_by_id and state_of.get(node_id) == "ready":
                env = _container_env(nodes_by_id[node_id], container)
                if env is not None:
                    whole, source = _from_env(env, env_name), "container"
                    slots = _from_env(env, shared_env) if shared_env else []
            gpus, slots = _gpus_and_slots(whole, slots)
            if node_id and state_of.get(node_id) == "down" and state == "running":
                state = "unknown"  # its node is down: the manager has not rescheduled it yet
            reason = status.get("Err", "")
            tasks.append({
                "slot": task.get("Slot", 0),
                "node": names_by_id.get(node_id, ""),
                "state": state,
                "gpus": gpus,
                "slots": slots,
                "gpus_from": source,
                "reason": reason,
                "error": reason,  # the old name of "reason"
                "reason_age_s": round(_age(status.get("Timestamp", "")) or 0, 1) if reason else None,
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


def _condition(engine_labels: dict, labels: dict) -> dict:
    """What the node's health watcher reports (its engine labels, as the manager last heard them)
    and what the reconciler did about it (node labels)."""
    return {"condition": engine_labels.get(CONDITION_LABEL) or "unknown",  # no watcher has reported
            "condition_reason": engine_labels.get(f"{CONDITION_LABEL}.reason", ""),
            "condition_gpu": engine_labels.get(f"{CONDITION_LABEL}.gpu", ""),
            "health": labels.get(HEALTH_LABEL, ""), "health_last": labels.get(HEALTH_LAST_LABEL, "")}


def _answers(node: Node, engine: Engine) -> bool:
    try:
        api.get(node.sock, "/nodes", timeout=10)  # only a manager answers
        return True
    except (OSError, api.ApiError, http.client.HTTPException):
        return False


def looks_converged(nodes: list[Node], engine: Engine) -> bool:
    """converged() by the manager's records alone: two reads, where collect() asks every task's node too."""
    manager = next((n for n in nodes if n.role == "manager" and _answers(n, engine)), None)
    if manager is None:
        return False
    tasks = _get(manager, "/tasks", filters={"desired-state": ["running"]})
    services = []
    for svc in _get(manager, "/services"):
        replicated = svc["Spec"].get("Mode", {}).get("Replicated")
        services.append({"replicas": replicated.get("Replicas", 1) if replicated else None,
                         "tasks": [{"state": t["Status"]["State"], "reason": t["Status"].get("Err", "")}
                                   for t in tasks if t["ServiceID"] == svc["ID"]]})
    return converged({"services": services})


def converged(view: dict) -> bool:
    """Every wanted task is running, or pending for a reason the scheduler gave."""
    for svc in view["services"]:
        tasks = svc["tasks"]
        if svc["replicas"] is not None and len(tasks) < svc["replicas"]:
            return False
        for t in tasks:
            if not (t["state"] == "running" or (t["state"] == "pending" and t["reason"])):
                return False
    return True


def render_table(view: dict) -> str:
    """Nodes with their state, then one row per advertised GPU (free or held), then tasks without GPUs."""
    rows = [("NODE", "ROLE", "STATE", "AVAILABILITY", "CONDITION", "GPUS")]
    for node in view["nodes"]:
        availability = node["availability"] + (f" ({node['drained_by']})" if node.get("drained_by") else "")
        condition = node.get("condition", "unknown")
        if condition not in ("healthy", "unknown") and node.get("condition_reason", "-") != "-":
            condition += f": {node['condition_reason']}"  # the reason names the GPU
        rows.append((node["name"], node["role"], node["state"], availability, condition, str(len(node["gpus"]))))
    out = [_table(rows)]

    holders = {}
    for svc in view["services"]:
        for t in svc["tasks"]:
            for held in t["slots"] or t["gpus"]:
                holders[(t["node"], held)] = (svc["name"], t)
    rows = [("NODE", "GPU", "SERVICE", "TASK", "STATE", "REASON")]
    for node in view["nodes"]:
        shared = {slot_gpu(s) for s in node.get("slots", [])}
        for gpu in [g for g in node["gpus"] if g not in shared] + node.get("slots", []):
            svc, t = holders.get((node["name"], gpu), ("-", None))
            if gpu in node.get("slots", []):
                gpu = f"{slot_gpu(gpu)} slot {gpu.rsplit('-s', 1)[1]}"
            if t:
                state = t["state"]
            elif node["state"] != "ready":
                state = f"unusable (node {node['state']})"
            elif node["availability"] != "active":
                state = f"unusable (node {node['availability']})"
            else:
                state = "free"
            rows.append((node["name"], gpu, svc, str(t["slot"]) if t else "-", state, ""))
    for svc in view["services"]:
        for t in svc["tasks"]:
            if not t["gpus"]:
                reason = t["reason"]
                if reason and t.get("reason_age_s") is not None:
                    reason += f" ({t['reason_age_s']:.0f}s ago)"
                rows.append((t["node"] or "-", "-", svc["name"], str(t["slot"]), t["state"], reason))
    out.append(_table(rows))
    out.append("TASK is the replica's slot number (service.slot in `docker service ps`). CONDITION is what the "
               "node's GPU health watcher reported, as the manager last heard it.")
    return "\n\n".join(out)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
