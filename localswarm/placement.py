"""What the swarm did: nodes, their state and GPUs, and where each task landed with which GPUs.

A task's GPUs are read from its container's configuration on its node (`docker inspect`
.Config.Env, DOCKER_RESOURCE_<KIND>): what dockerd handed the runtime, whatever the
task's processes did with their environment since. When the node cannot be asked (its
engine is down), the manager's record of the assignment is shown and marked as such.
Tasks that ended are shown too (node/stack_tasks.py decides what counts as settled).
Everything is read through the engines' API (localswarm.api): `status` and the tests poll this.
"""
from __future__ import annotations

import http.client
import json
import threading
from typing import TYPE_CHECKING, Callable

from localswarm import api
from localswarm.host import Engine, RehearsalError
from localswarm import task_runs
from swarm.gpu_kind import resource_env_name, slot_gpu
from swarm.labels import POOL_LABEL, CONDITION_LABEL, DRAINED_BY_LABEL, HEALTH_LABEL, HEALTH_LAST_LABEL, MAINTENANCE_LABEL
from swarm.node_contract import AUTOSCALE_STATUS_LABEL, SENTINEL_SERVICE
from swarm.rollout import advertised_gpus

if TYPE_CHECKING:
    from localswarm.pulumi_host import ViewNode as Node  # a machine of Pulumi's CLI, as this reads it


def _get(node: Node, path: str, **query):
    try:
        return api.get(node.sock, path, **query)
    except (OSError, api.ApiError, http.client.HTTPException) as e:
        raise RehearsalError(f"{node.name}: GET {path}: {e}") from None


def _container_env(node: Node, container: str) -> list[str] | None:
    try:
        return api.get(node.sock, f"/containers/{container}/json")["Config"]["Env"] or []
    except (OSError, api.ApiError, http.client.HTTPException, KeyError, TypeError):
        return None


def _assigned(task: dict, kind: str) -> list[str]:
    """The scheduler's assignment, as the manager records it on the task."""
    return sorted(r["NamedResourceSpec"]["Value"] for r in task.get("GenericResources") or []  # the Engine API's name
                  if r.get("NamedResourceSpec", {}).get("Kind") == kind)


def _gpus_and_slots(whole: list[str], slots: list[str]) -> tuple[list[str], list[str]]:
    """A task's or node's real GPUs (a slot counts as its GPU), and its slots of shared GPUs."""
    return sorted(set(whole) | {slot_gpu(s) for s in slots}), sorted(slots)


def _from_env(env: list[str], name: str) -> list[str]:
    for entry in env:
        if entry.startswith(name + "="):
            return sorted(v for v in entry.split("=", 1)[1].split(",") if v)
    return []


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
    view_nodes, nodes_by_id, node_docs = [], {}, _get(manager, "/nodes")
    for info in node_docs:
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

    def gpus_of(task: dict) -> tuple[list[str], list[str], str]:
        """The task's GPUs and slots, from its container when its node answers, else the scheduler's record."""
        node_id = task.get("NodeID", "")
        container = task["Status"].get("ContainerStatus", {}).get("ContainerID")
        if container and node_id in nodes_by_id and state_of.get(node_id) == "ready":
            env = _container_env(nodes_by_id[node_id], container)
            if env is not None:
                return (*_gpus_and_slots(_from_env(env, env_name), _from_env(env, shared_env) if shared_env else []),
                        "container")
        return (*_gpus_and_slots(_assigned(task, kind), _assigned(task, shared_kind)), "scheduler")

    # The health reconciler's sentinel is the machinery's, not a stack's: it is not shown.
    service_docs = [s for s in _get(manager, "/services") if s["Spec"]["Name"] != SENTINEL_SERVICE]
    kept = {s["ID"] for s in service_docs}
    services = services_view(service_docs, [t for t in _get(manager, "/tasks") if t.get("ServiceID") in kept], gpus_of,
                             names_by_id, state_of, task_runs.node_faults(node_docs))
    for n in view_nodes:
        del n["id"]
    return {"nodes": view_nodes, "services": services, "autoscale": autoscale_status(node_docs)}


def autoscale_status(node_docs: list[dict]) -> dict:
    """Each elastic pool's numbers and last decision, as the scaler left them on its leader's node
    (node/swarm_scaler.py); the newest where managers hold several (a leader change)."""
    found: dict = {}
    for info in node_docs:
        try:
            pools = json.loads((info["Spec"].get("Labels") or {}).get(AUTOSCALE_STATUS_LABEL) or "{}")
        except ValueError:
            continue
        for pool, numbers in pools.items():
            if str(numbers.get("last", "")) >= str(found.get(pool, {}).get("last", "")):
                found[pool] = numbers
    return dict(sorted(found.items()))


def services_view(services_docs: list[dict], tasks_docs: list[dict], gpus_of, names_by_id: dict,
                  state_of: dict, faults: dict | None = None) -> list[dict]:
    """Every service with one entry per slot (node/stack_tasks.py, the deploy command's own rules)."""
    return task_runs.services_view(services_docs, tasks_docs, gpus_of, names_by_id, state_of, faults)


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


def render_table(view: dict) -> str:
    """Nodes with their state, then one row per advertised GPU (free or held), then tasks without GPUs,
    then the tasks that ran to their end: the last run's state, exit code and GPUs."""
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
            for held in [] if t.get("ended") else t["slots"] or t["gpus"]:  # an ended task holds nothing
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
            if not t["gpus"] and not t.get("ended"):
                reason = t["reason"]
                if reason and t.get("reason_age_s") is not None:
                    reason += f" ({t['reason_age_s']:.0f}s ago)"
                rows.append((t["node"] or "-", "-", svc["name"], str(t["slot"]), t["state"], reason))
    out.append(_table(rows))
    rows = [("SERVICE", "TASK", "NODE", "GPUS", "LAST RUN", "EXIT", "RUNS", "NOW")]
    for svc in view["services"]:
        for t in svc["tasks"]:
            run = t.get("last_run")
            if run:
                runs = t.get("runs", {})
                rows.append((svc["name"], str(t["slot"]), run["node"] or "-", ",".join(run["gpus"]) or "-",
                             f"{run['state']} {run.get('age_s') or 0:.0f}s ago",
                             "-" if run["exit_code"] is None else str(run["exit_code"]),
                             f"{runs.get('completed', 0)} completed, {runs.get('failed', 0)} failed"
                             + (f", {runs['lost']} lost by the engine" if runs.get("lost") else ""),
                             "ended" if t.get("ended") else t["state"]))
    if len(rows) > 1:
        out.append(_table(rows))
    elastic = [("ELASTIC POOL", "DESIRED", "READY", "BOOTING", "LEAVING", "WAITING", "LAST DECISION")]
    for pool, n in (view.get("autoscale") or {}).items():
        elastic.append((pool, f"{n.get('desired')} ({n.get('min')}-{n.get('max')})", str(n.get("ready")),
                        str(n.get("booting")), str(n.get("leaving")), str(n.get("waiting")), n.get("last") or "-"))
    if len(elastic) > 1:
        out.append(_table(elastic))
    failed = [f"{svc['name']} task {t['slot']} failed {task_runs.fault_text(fault, t['last_run']['node'])}"
              for svc in view["services"] for t in svc["tasks"] if (fault := (t.get("last_run") or {}).get("hardware"))]
    if failed:
        out.append("HARDWARE\n" + "\n".join(failed))
    out.append("TASK is the replica's slot number (service.slot in `docker service ps`). CONDITION is what the "
               "node's GPU health watcher reported, as the manager last heard it."
               + (" LAST RUN is the newest of a task's runs that ended, and RUNS counts the runs swarm still "
                  "remembers (its task history keeps a few per task); NOW is `ended` when swarm starts no "
                  "other." if len(rows) > 1 else ""))
    return "\n\n".join(out)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class DrainWatcher(threading.Thread):
    """What the swarm itself says while `pulumi up` runs: the most nodes of each pool taken out of service at
    once, i.e. drained after this watcher saw them active. Not a node an operator had drained before (the
    roll leaves it drained, swarm/rollout.py), nor a new node, which joins drained and is given its tasks
    only once its admit has checked it: neither served, so neither is a GPU the run took away.
    nodes() gives the machines as they are now (a run adds and removes them); the first manager is asked."""

    def __init__(self, nodes: Callable[[], list]):
        super().__init__(daemon=True)
        self.nodes, self.peak, self._done = nodes, {}, threading.Event()
        self.served: set[str] = set()  # the IDs of the nodes seen active

    def run(self) -> None:
        while not self._done.wait(0.5):
            try:
                managers = [n for n in self.nodes() if n.role == "manager"]
                infos = api.get(managers[0].sock, "/nodes", timeout=5) if managers else []
            except (OSError, api.ApiError, http.client.HTTPException, ValueError):
                continue  # no swarm yet, or its engine restarts
            self.served |= {i["ID"] for i in infos if i["Spec"].get("Availability") == "active"}
            counts: dict[str, int] = {}
            for info in infos:
                if info["Spec"].get("Availability") == "drain" and info["ID"] in self.served:
                    pool = (info["Spec"].get("Labels") or {}).get(POOL_LABEL, "?")
                    counts[pool] = counts.get(pool, 0) + 1
            for pool, n in counts.items():
                self.peak[pool] = max(self.peak.get(pool, 0), n)

    def stop(self) -> None:
        self._done.set()
        self.join()
