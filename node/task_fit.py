"""Reading the swarm's JSON for the scaler, and whether a node of an elastic pool could run a task. Pure.

node/scale_plan.py decides with these; they read `docker node inspect`'s nodes and the Engine API's tasks.
Stdlib only.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone

# Task states in which a task holds its node's resources (swarmkit api/types.proto TaskState, from assigned on).
HOLDING = ("assigned", "accepted", "preparing", "ready", "starting", "running")
NO_SUITABLE_NODE = "no suitable node"  # swarmkit's scheduler, for a task that fits no node (resources or constraints)
_CONSTRAINT = re.compile(r"\s*([A-Za-z0-9._/-]+)\s*(==|!=)\s*(.*?)\s*")
# What a node of a pool is known to be before it boots: placement constraints on anything else are unknowable.
_KNOWN = {"node.role": "worker", "node.platform.os": "linux", "node.platform.arch": "x86_64"}


def _spec(n: dict) -> dict:
    return n.get("Spec") or {}


def _labels(n: dict) -> dict:
    return _spec(n).get("Labels") or {}


def _engine(n: dict) -> dict:
    return ((n.get("Description") or {}).get("Engine") or {}).get("Labels") or {}


def _name(n: dict) -> str:
    return (n.get("Description") or {}).get("Hostname") or n["ID"]


def _ready(n: dict) -> bool:
    return (n.get("Status") or {}).get("State") == "ready"


def _int(text) -> int | None:
    return int(text) if isinstance(text, str) and text.isdigit() else None


def reserved(task: dict) -> dict[str, int]:
    """Kind -> units of the discrete generic resources a task reserves."""
    out: dict[str, int] = {}
    res = (((task.get("Spec") or {}).get("Resources") or {}).get("Reservations") or {}).get("GenericResources") or []
    for entry in res:
        spec = entry.get("DiscreteResourceSpec")
        if spec and spec.get("Kind"):
            out[spec["Kind"]] = out.get(spec["Kind"], 0) + int(spec.get("Value") or 0)
    return out


def _constraints(task: dict) -> list[str]:
    return list(((task.get("Spec") or {}).get("Placement") or {}).get("Constraints") or [])


def _max_replicas(task: dict) -> int:
    return int(((task.get("Spec") or {}).get("Placement") or {}).get("MaxReplicas") or 0)


def _holding(task: dict) -> bool:
    return (task.get("Status") or {}).get("State") in HOLDING and bool(task.get("NodeID"))


def constraint_problem(constraints: list[str], labels: dict) -> str | None:
    """None when every constraint holds for a new node with these node labels; else the first that does not,
    or cannot be known before the node boots. Values compare as swarmkit's do (case-insensitive)."""
    for text in constraints:
        found = _CONSTRAINT.fullmatch(text)
        if not found:
            return f"constraint {text!r} is not key==value or key!=value"
        key, op, want = found[1], found[2], found[3]
        lowered = key.lower()
        if lowered.startswith("node.labels."):
            have = labels.get(key[len("node.labels."):])
        elif lowered in _KNOWN:
            have = _KNOWN[lowered]
        else:
            return f"constraint {text!r} names what only a booted node can say"
        equal = have is not None and have.lower() == want.lower()
        if equal != (op == "=="):
            return f"constraint {text!r} does not hold for its nodes"
    return None


def fit_problem(task: dict, pool) -> str | None:
    """Why a node of `pool` could never run `task`; None when it could."""
    wants = reserved(task)
    other = sorted(k for k in wants if k != pool.kind)
    if other:
        return f"it reserves {', '.join(other)}, and the pool's nodes advertise {pool.kind}"
    if wants.get(pool.kind, 0) > pool.units:
        return f"it reserves {wants[pool.kind]} {pool.kind}, and a node of the pool has {pool.units}"
    return constraint_problem(_constraints(task), pool.labels)


def _pending_s(task: dict, now: int) -> int:
    """Seconds since the task's status last changed (RFC 3339 Status.Timestamp, UTC), 0 when unreadable."""
    stamp = (task.get("Status") or {}).get("Timestamp") or ""
    found = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", stamp)
    if not found:
        return 0
    return max(0, now - int(datetime.strptime(found[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()))
