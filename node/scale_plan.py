"""What the scaler does to each elastic pool, decided from what the swarm and the Auto Scaling groups say. Pure.

plan(pools, nodes, tasks, groups, now) takes `docker node inspect`'s JSON of every node, the Engine
API's tasks, each pool's group as DescribeAutoScalingGroups has it, and the time; it returns the
actions, each with its reason, and what it could not do. node/swarm_scaler.py carries them out on the
swarm leader, one round at a time; everything a round needs from the last is in node labels (Raft),
so a new leader goes on where the last stopped.

- Scale out: a task pending for a GPU ("no suitable node") is given to the first pool, smallest nodes
  first, whose nodes could run it: every kind it reserves is the pool's, no more units than a node
  has, and each placement constraint holds for a node of the pool (its node labels, role worker,
  linux, x86_64; a constraint on what only a booted node can say, such as engine labels or a
  hostname, holds for none). Tasks fill what the pool has first (free units of ready nodes, nodes
  still booting, nodes on their way out, which are given back), then new nodes, up to max; the
  group's desired capacity grows by the new nodes. A task no pool could run is reported, not scaled for.
- Scale in: only in a pool no pending task was given to this round, down to min. A node that has held
  no GPU task for idleSeconds is paused (no new task lands), looked at again (a task that landed
  between the two looks gives it back), drained (its tasks stop within their grace periods), and
  terminated with the group's desired capacity decremented; its swarm node is removed once down.
- A node whose software is not the pool's release is replaced the same way when it is idle and the pool
  is at min (above it, the node goes at its idle time anyway), at most maxUnavailable at a time, the group
  launching the new one (no decrement).
- A node that joined is admitted (the pool's admit script: labels and the post-join GPU check) once
  the group lists its instance and no other node claims it.
A node running a GPU task is never paused, drained or terminated.
Stdlib and its siblings contract.py and task_fit.py (reading the swarm's JSON, and what a pool's node fits).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from contract import (AUTOSCALE_LABEL, DRAINED_BY_AUTOSCALE, DRAINED_BY_HEALTH, DRAINED_BY_LABEL,  # noqa: E402
                      ELASTIC_POOL_LABEL, IDLE_SINCE_LABEL, INSTANCE_ID_LABEL, SOFTWARE_LABEL)
from task_fit import (NO_SUITABLE_NODE, _engine, _holding, _int, _labels, _max_replicas,  # noqa: E402,F401
                      _name, _pending_s, _ready, _spec, constraint_problem, fit_problem, reserved)

# Group instances that are or will be nodes (Auto Scaling lifecycle states: Pending, Pending:Wait,
# Pending:Proceed, InService); Terminating*, Terminated, Detach* and Standby are not.
LIVE_LIFECYCLE = re.compile(r"Pending(:\w+)?|InService")
# A node being taken out: AUTOSCALE_LABEL's goals and phases.
REMOVE, REPLACE = "remove", "replace"
PAUSED, DRAINING, TERMINATING = "paused", "draining", "terminating"
TERMINATE_AGAIN_S = 300  # a terminated instance the group still lists as in service after this: ask again
STUCK_S = 120  # a pending task that would fit a ready node's free units for this long: something else keeps it out


@dataclass(frozen=True)
class Pool:
    """One elastic pool, as AUTOSCALE_POOLS_PATH has it (components/elastic_pool.py writes it)."""

    name: str
    group: str
    min: int
    max: int
    idle_s: int
    kind: str  # what its nodes advertise: the GPU kind, or the shared kind of a pool that shares
    units: int  # how many of that kind each node advertises
    labels: dict  # the node labels admit gives its nodes (swarm/labels.py pool_labels)
    release: str  # the release its nodes run (to_node/software.py); one that runs another is replaced
    max_unavailable: int = 1
    gpu_kinds: tuple[str, ...] = ()  # every GPU kind of the cluster: a task reserving one is a GPU task

    @classmethod
    def from_json(cls, d: dict) -> Pool:
        return cls(str(d["name"]), str(d["group"]), int(d["min"]), int(d["max"]), int(d["idleSeconds"]),
                   str(d["kind"]), int(d["units"]), dict(d.get("labels") or {}), str(d.get("release") or ""),
                   max(1, int(d.get("maxUnavailable") or 1)), tuple(d.get("gpuKinds") or (d["kind"],)))


@dataclass(frozen=True)
class Group:
    """A pool's Auto Scaling group: its desired capacity and its instances (id -> lifecycle state)."""

    desired: int
    min: int
    max: int
    instances: dict


@dataclass(frozen=True)
class Action:
    kind: str  # label, admit, scale-out, pause, drain, give-back, terminate, forget
    pool: str
    reason: str
    node_id: str = ""
    node: str = ""  # hostname, for people
    args: tuple[str, ...] = ()  # docker node update's, the node ID last
    desired: int = 0  # scale-out: the group's new desired capacity
    instance: str = ""  # terminate
    decrement: bool = True  # terminate: whether the group's desired capacity goes down with it
    give_back: tuple[str, ...] = ()  # terminate: docker node update's, should the group refuse to shrink


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    reports: list[str] = field(default_factory=list)  # what it could not do, and why: said, not acted on
    status: dict = field(default_factory=dict)  # pool -> {desired, booting, ready, leaving, waiting}


# ---------------------------------------------------------------- the plan

@dataclass
class _Slot:
    """A node that can take pending tasks in the plan: a ready one, one booting, one to give back, or a new one."""

    where: str  # ready, booting, give-back, new
    free: int
    node: dict | None = None
    services: dict = field(default_factory=dict)  # service ID -> its tasks on the node


@dataclass
class _PoolView:
    pool: Pool
    group: Group | None
    ready: list = field(default_factory=list)  # admitted, active
    leaving: list = field(default_factory=list)  # (node, goal, phase, since)
    unavailable: list = field(default_factory=list)  # admitted, drained or paused by someone else
    joined: list = field(default_factory=list)  # not admitted yet
    booting: int = 0
    slots: list = field(default_factory=list)
    new: int = 0
    demand: int = 0  # pending tasks given to the pool this round


def plan(pools: list[Pool], nodes: list[dict], tasks: list[dict], groups: dict[str, Group | None], now: int,
         admitting: frozenset[str] = frozenset()) -> Plan:
    """The round's actions. admitting: node IDs whose admit is still running (left alone)."""
    out = Plan()
    by_pool = {p.name: p for p in pools}
    holding = [t for t in tasks if _holding(t)]
    gpu_kinds = {k for p in pools for k in p.gpu_kinds}
    on_node: dict[str, list[dict]] = {}
    for t in holding:
        on_node.setdefault(t["NodeID"], []).append(t)
    views = {p.name: _PoolView(p, groups.get(p.group)) for p in pools}
    claims: dict[str, list[dict]] = {}
    for n in nodes:
        if _engine(n).get(ELASTIC_POOL_LABEL) in by_pool and _engine(n).get(INSTANCE_ID_LABEL):
            claims.setdefault(_engine(n)[INSTANCE_ID_LABEL], []).append(n)

    def gpu_tasks(n: dict) -> list[dict]:
        return [t for t in on_node.get(n["ID"], []) if set(reserved(t)) & gpu_kinds]

    for n in nodes:
        pool = by_pool.get(_engine(n).get(ELASTIC_POOL_LABEL))
        if pool is None:
            continue
        v = views[pool.name]
        if v.group is None:
            continue
        instance = _engine(n).get(INSTANCE_ID_LABEL, "")
        live = LIVE_LIFECYCLE.fullmatch(v.group.instances.get(instance, "") or "") is not None
        rivals = [o for o in claims.get(instance, []) if o is not n and _ready(o)]
        if not live or (rivals and not _ready(n)):
            if not _ready(n) and n["ID"] not in admitting:  # the instance is gone, or this is a stale copy
                why = "its instance left the group" if not live else f"another node claims its instance {instance}"
                out.actions.append(Action("forget", pool.name, f"{why}, and the node is down", n["ID"], _name(n),
                                          ("--force", n["ID"])))
            elif not live and not _labels(n).get(SOFTWARE_LABEL):
                out.reports.append(f"node {_name(n)} ({n['ID'][:12]}) says it is instance {instance} of pool "
                                   f"{pool.name}, which group {pool.group} does not list: not admitted")
            continue
        if rivals:
            out.reports.append(f"node {_name(n)} ({n['ID'][:12]}) and {len(rivals)} other(s) claim instance "
                               f"{instance} of pool {pool.name}: none is admitted; remove the wrong one by hand")
            continue
        labels = _labels(n)
        goal = _goal(labels)
        if goal:
            v.leaving.append((n, *goal))
        elif not labels.get(SOFTWARE_LABEL):
            v.joined.append(n)
        elif _spec(n).get("Availability") == "active" and _ready(n):
            v.ready.append(n)
        else:  # drained or paused by someone else (health, the GPU check, an operator), or down
            v.unavailable.append(n)
    for v in views.values():
        if v.group is None:
            out.reports.append(f"pool {v.pool.name}: its Auto Scaling group {v.pool.group} was not found; "
                                "nothing is scaled until it is")
            continue
        _count_booting(v, taken={_engine(n).get(INSTANCE_ID_LABEL) for n, *_ in v.leaving}
                       | {_engine(n).get(INSTANCE_ID_LABEL) for n in v.ready + v.unavailable})
        _admissions(v, admitting, out)
        _idle_labels(v, gpu_tasks, now, out)
        for n in v.ready:
            used = sum(reserved(t).get(v.pool.kind, 0) for t in on_node.get(n["ID"], []))
            v.slots.append(_Slot("ready", v.pool.units - used, n, _services(on_node.get(n["ID"], []))))
        v.slots += [_Slot("booting", v.pool.units) for _ in range(v.booting)]
        for n, goal, phase, _ in v.leaving:
            if goal == REMOVE and phase in (PAUSED, DRAINING) and not gpu_tasks(n):
                v.slots.append(_Slot("give-back", v.pool.units, n, _services(on_node.get(n["ID"], []))))
    _place_pending(tasks, pools, views, now, out)
    for v in views.values():
        if v.group is None:
            continue
        _scale_out(v, out)
        _leaving(v, gpu_tasks, on_node, now, out)
        if not v.demand:
            _scale_in(v, gpu_tasks, now, out)
        out.status[v.pool.name] = {
            "desired": v.group.desired + v.new, "min": v.pool.min, "max": v.pool.max, "ready": len(v.ready),
            "booting": v.booting + v.new, "leaving": len(v.leaving), "unavailable": len(v.unavailable),
            "waiting": v.demand}
    return out


def _goal(labels: dict) -> tuple[str, str, int] | None:
    parts = (labels.get(AUTOSCALE_LABEL) or "").split(":")
    if len(parts) == 3 and parts[0] in (REMOVE, REPLACE) and parts[1] in (PAUSED, DRAINING, TERMINATING):
        return parts[0], parts[1], _int(parts[2]) or 0
    return None


def _services(tasks: list[dict]) -> dict:
    out: dict[str, int] = {}
    for t in tasks:
        out[t.get("ServiceID", "")] = out.get(t.get("ServiceID", ""), 0) + 1
    return out


def _count_booting(v: _PoolView, taken: set) -> None:
    """Nodes on their way: instances the group will launch, and those it has that are no admitted node yet
    (booting, or joined and waiting for their admit)."""
    live = [i for i, state in v.group.instances.items() if LIVE_LIFECYCLE.fullmatch(state or "")]
    v.booting = max(0, v.group.desired - len(live)) + sum(1 for i in live if i not in taken)


def _admissions(v: _PoolView, admitting: frozenset[str], out: Plan) -> None:
    for n in v.joined:
        if n["ID"] in admitting or not _ready(n):
            continue
        if _spec(n).get("Availability") != "drain" or _labels(n).get(DRAINED_BY_LABEL):
            out.reports.append(f"node {_name(n)} of pool {v.pool.name} joined but is not drained as a new node is "
                                "(someone changed it): not admitted")
            continue
        instance = _engine(n)[INSTANCE_ID_LABEL]
        out.actions.append(Action("admit", v.pool.name, f"joined from instance {instance} of group {v.pool.group}",
                                  n["ID"], _name(n), instance=instance))


def _idle_labels(v: _PoolView, gpu_tasks, now: int, out: Plan) -> None:
    """Each admitted node's IDLE_SINCE_LABEL: set when it holds no GPU task, gone when it holds one."""
    for n in v.ready + v.unavailable:
        busy, since = bool(gpu_tasks(n)), _labels(n).get(IDLE_SINCE_LABEL)
        if busy and since is not None:
            out.actions.append(Action("label", v.pool.name, "it holds a GPU task", n["ID"], _name(n),
                                      ("--label-rm", IDLE_SINCE_LABEL, n["ID"])))
        elif not busy and since is None:
            out.actions.append(Action("label", v.pool.name, "it holds no GPU task", n["ID"], _name(n),
                                      ("--label-add", f"{IDLE_SINCE_LABEL}={now}", n["ID"])))


def _place_pending(tasks: list[dict], pools: list[Pool], views: dict, now: int, out: Plan) -> None:
    gpu_kinds = {k for p in pools for k in p.gpu_kinds}
    pending = [t for t in tasks if t.get("DesiredState") == "running" and (t.get("Status") or {}).get("State") == "pending"
               and NO_SUITABLE_NODE in ((t.get("Status") or {}).get("Err") or "") and set(reserved(t)) & gpu_kinds]
    pending.sort(key=lambda t: (-max(reserved(t).values()), t.get("ID", "")))
    by_size = sorted(pools, key=lambda p: (p.units, p.name))
    for t in pending:
        shown = f"task {t.get('ID', '')[:12]} (service {t.get('ServiceID', '')[:12]}, slot {t.get('Slot', '-')})"
        fits = [(p, fit_problem(t, p)) for p in by_size if views[p.name].group is not None]
        able = [p for p, problem in fits if problem is None]
        if not able:
            why = "; ".join(f"pool {p.name}: {problem}" for p, problem in fits) or "no elastic pool has a group"
            out.reports.append(f"{shown} waits for GPUs no elastic pool can give ({why})")
            continue
        for p in able:
            where = _fit(views[p.name], t)
            if where is None:
                continue
            views[p.name].demand += 1
            if where.where == "ready" and _pending_s(t, now) >= STUCK_S:
                out.reports.append(f"{shown} has waited {_pending_s(t, now)} s though node {_name(where.node)} of "
                                    f"pool {p.name} has {where.free + reserved(t).get(p.kind, 0)} free "
                                    f"{p.kind}: something besides GPUs keeps it out (its CPU or memory "
                                    "reservation, or a constraint); no node is added for it")
            break
        else:
            out.reports.append(f"{shown} waits: pool(s) {', '.join(p.name for p in able)} could run it but are at "
                                f"their max ({', '.join(str(p.max) for p in able)} nodes)")


def _fit(v: _PoolView, task: dict) -> _Slot | None:
    """Where in the pool the task goes: the first slot with room (ready, booting, given back), else a new node."""
    need = reserved(task).get(v.pool.kind, 0)
    service, limit = task.get("ServiceID", ""), _max_replicas(task)
    for slot in v.slots:
        if slot.free >= need and (not limit or slot.services.get(service, 0) < limit):
            slot.free -= need
            slot.services[service] = slot.services.get(service, 0) + 1
            return slot
    if v.group.desired + v.new >= v.pool.max:
        return None
    v.new += 1
    slot = _Slot("new", v.pool.units - need, services={service: 1})
    v.slots.append(slot)
    return slot


def _scale_out(v: _PoolView, out: Plan) -> None:
    for slot in v.slots:
        if slot.where == "give-back":
            if slot.free < v.pool.units:  # a pending task was given to it
                n = slot.node
                out.actions.append(Action("give-back", v.pool.name, "pending GPU tasks fit on it: it stays",
                                          n["ID"], _name(n), _give_back_args(n)))
    if v.new:
        desired = v.group.desired + v.new
        out.actions.append(Action("scale-out", v.pool.name,
                                  f"{v.demand} pending GPU task(s) fit the pool; {v.new} more node(s) than its "
                                  f"{v.group.desired} (booting: {v.booting})", desired=desired))


def _give_back_args(n: dict) -> tuple[str, ...]:
    labels = _labels(n)
    drop = [arg for key in (AUTOSCALE_LABEL, DRAINED_BY_LABEL, IDLE_SINCE_LABEL) if key in labels
            for arg in ("--label-rm", key)]
    return ("--availability", "active", *drop, n["ID"])


def _leaving(v: _PoolView, gpu_tasks, on_node: dict, now: int, out: Plan) -> None:
    given_back = {a.node_id for a in out.actions if a.kind == "give-back"}
    for n, goal, phase, since in v.leaving:
        if n["ID"] in given_back:
            continue
        instance = _engine(n).get(INSTANCE_ID_LABEL, "")
        if phase == PAUSED:
            if gpu_tasks(n):
                out.actions.append(Action("give-back", v.pool.name, "a GPU task landed on it before the pause held",
                                          n["ID"], _name(n), _give_back_args(n)))
                continue
            out.actions.append(Action("drain", v.pool.name, f"paused and still without a GPU task: its tasks stop "
                                      f"within their grace periods ({goal})", n["ID"], _name(n),
                                      ("--availability", "drain", "--label-add",
                                       f"{AUTOSCALE_LABEL}={goal}:{DRAINING}:{now}", n["ID"])))
        elif phase == DRAINING:
            left = on_node.get(n["ID"], [])
            if left:
                continue  # swarm stops them within their grace periods
            if goal == REMOVE and v.group.desired <= v.group.min:
                out.actions.append(Action("give-back", v.pool.name, f"the group is at its min ({v.group.min}): "
                                          "it cannot shrink", n["ID"], _name(n), _give_back_args(n)))
                continue
            out.actions.append(Action("terminate", v.pool.name,
                                      "drained, no task left" + (": the group launches a node of the pool's release"
                                                                  if goal == REPLACE else ""),
                                      n["ID"], _name(n), instance=instance, decrement=goal == REMOVE,
                                      args=("--label-add", f"{AUTOSCALE_LABEL}={goal}:{TERMINATING}:{now}", n["ID"]),
                                      give_back=_give_back_args(n)))
        elif phase == TERMINATING and gpu_tasks(n):
            out.reports.append(f"node {_name(n)} of pool {v.pool.name} holds a GPU task though its instance was "
                               "terminated: someone made it active again; it is not terminated again")
        elif phase == TERMINATING and now - since >= TERMINATE_AGAIN_S:
            out.actions.append(Action("terminate", v.pool.name, f"the group still lists it {now - since} s after "
                                      "its termination: asked again", n["ID"], _name(n), instance=instance,
                                      decrement=False,
                                      args=("--label-add", f"{AUTOSCALE_LABEL}={goal}:{TERMINATING}:{now}", n["ID"])))


def _scale_in(v: _PoolView, gpu_tasks, now: int, out: Plan) -> None:
    """Pause idle nodes (remove), down to min; and idle nodes of another release (replace), maxUnavailable at once."""
    going = sum(1 for _, goal, phase, _ in v.leaving if goal == REMOVE and phase != TERMINATING)
    budget = v.group.desired - v.pool.min - going
    idle = []
    for n in v.ready + [n for n in v.unavailable if _labels(n).get(DRAINED_BY_LABEL) == DRAINED_BY_HEALTH]:
        since = _int(_labels(n).get(IDLE_SINCE_LABEL))
        if since is not None and not gpu_tasks(n):
            idle.append((since, n["ID"], n))
    idle.sort(key=lambda x: (x[0], x[1]))
    paused = set()
    for since, _, n in idle:
        if budget <= 0 or now - since < v.pool.idle_s:
            continue
        budget -= 1
        paused.add(n["ID"])
        out.actions.append(Action("pause", v.pool.name, f"no GPU task for {now - since} s (idle after "
                                  f"{v.pool.idle_s} s); the pool keeps at least {v.pool.min}", n["ID"], _name(n),
                                  _pause_args(n, REMOVE, now)))
    # Replaced only where the pool cannot shrink: above min, an idle node of another release goes at its idle
    # time anyway, and replacing it would launch a node that idles too.
    if budget > 0:
        return
    replacing = sum(1 for _, goal, _, _ in v.leaving if goal == REPLACE)
    for since, _, n in idle:
        if replacing >= v.pool.max_unavailable:
            break
        if n["ID"] in paused or not v.pool.release or _labels(n).get(SOFTWARE_LABEL) == v.pool.release:
            continue
        replacing += 1
        out.actions.append(Action("pause", v.pool.name, f"it runs release {_labels(n).get(SOFTWARE_LABEL, '')[:12]}, "
                                  f"the pool's is {v.pool.release[:12]}, and it holds no GPU task: replaced",
                                  n["ID"], _name(n), _pause_args(n, REPLACE, now)))


def _pause_args(n: dict, goal: str, now: int) -> tuple[str, ...]:
    return ("--availability", "pause", "--label-add", f"{DRAINED_BY_LABEL}={DRAINED_BY_AUTOSCALE}",
            "--label-add", f"{AUTOSCALE_LABEL}={goal}:{PAUSED}:{now}", n["ID"])
