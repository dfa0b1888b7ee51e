"""Time to checkpoint before a spot node goes: stop_grace_period 90s where a service can land on a spot pool.

AWS gives two minutes' notice before it reclaims a spot instance (and schedules maintenance events
ahead). The node's health watcher reads the notice from IMDS and the reconciler drains the node
(node/gpu_health.py, node/swarm_reconciler.py). Swarm then stops each task of the node as it stops any:
its stop_signal (SIGTERM unless the stack says otherwise), then SIGKILL once stop_grace_period has passed.
Swarm's own default grace is 10 s, too short to write a training checkpoint; 90 s leaves the drain its
own delay within the two minutes.

This is the one copy of the rule, applied where the file is made what swarm runs (swarm/stack_files.py,
so at preview and in the rehearsal). It cannot wait for the drain: the grace is part of the service's
spec, and a changed spec replaces the service's tasks, which is no way to stop them.
"""
from __future__ import annotations

import re
from typing import Mapping

from swarm.compose_yaml import scalar
from swarm.node_contract import POOL_SLOTS_PER_GPU_LABEL, POOL_SPOT_LABEL

SPOT_STOP_GRACE = "90s"
# A placement constraint on a node label: node.labels.<name> == <value> (or !=).
_CONSTRAINT = re.compile(r"\s*node\.labels\.(?P<name>[^=!\s]+)\s*(?P<op>==|!=)\s*(?P<value>.*?)\s*")


def can_land_on(service: dict, labels: Mapping[str, str], kind: str, shared_kind: str | None) -> bool:
    """Whether the service's GPU reservation and placement constraints let it run on a node with these
    pool labels. A pool that shares its GPUs advertises only shared_kind's slots, one that does not only
    kind's GPUs. A constraint on anything the pool's labels do not say (a hostname, a label set by hand)
    could hold there: only the pool labels rule a pool out."""
    deploy = service.get("deploy") if isinstance(service.get("deploy"), dict) else {}
    reservations = ((deploy.get("resources") or {}).get("reservations") or {}) if isinstance(deploy, dict) else {}
    reserved = {str((r.get("discrete_resource_spec") or {}).get("kind"))
                for r in reservations.get("generic_resources") or [] if isinstance(r, dict)}
    sharing = labels.get(POOL_SLOTS_PER_GPU_LABEL, "0") not in ("", "0")
    if (kind in reserved and sharing) or (shared_kind in reserved and not sharing):
        return False
    placement = deploy.get("placement") if isinstance(deploy.get("placement"), dict) else {}
    for constraint in placement.get("constraints") or []:
        match = _CONSTRAINT.fullmatch(str(constraint))
        if match and match["name"] in labels and (labels[match["name"]] == match["value"]) != (match["op"] == "=="):
            return False
    return True


def spot_grace(doc: dict, pools: Mapping[str, Mapping[str, str]], kind: str, shared_kind: str | None) -> list[str]:
    """Give stop_grace_period SPOT_STOP_GRACE to each service that sets none and can land on a spot pool.
    pools: each pool's node labels (swarm/labels.py pool_labels), the spot label among them; kind and
    shared_kind: the cluster's GPU kinds. Returns what changed, for the preview."""
    spot = [labels for labels in pools.values() if labels.get(POOL_SPOT_LABEL) == "true"]
    changes = []
    for name, service in (doc.get("services") or {}).items():
        if not isinstance(service, dict) or "stop_grace_period" in service:
            continue
        if any(can_land_on(service, labels, kind, shared_kind) for labels in spot):
            service["stop_grace_period"] = scalar(SPOT_STOP_GRACE)
            changes.append(f"services.{name}.stop_grace_period: {SPOT_STOP_GRACE} (it can run on a spot pool: on a "
                           f"reclaim notice its tasks get {service.get('stop_signal', 'SIGTERM')} and "
                           f"{SPOT_STOP_GRACE} to checkpoint, not swarm's 10 s; set stop_grace_period to choose)")
    return changes
