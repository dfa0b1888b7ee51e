"""Reading what the health machinery says about each node, for people: the inventory and status.

The watcher on each GPU node publishes its condition as engine labels; the reconciler on
the leader drains and reactivates, leaving node labels (swarm/labels.py names them all).
read_conditions() prints one JSON object per node from `docker node inspect`, on a manager.
"""
from __future__ import annotations

import json

from swarm.labels import (CONDITION_GPU_LABEL, CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL,
                          DRAINED_BY_LABEL, ELASTIC_POOL_LABEL, HEALTH_LABEL, HEALTH_LAST_LABEL, INSTANCE_ID_LABEL,
                          SOFTWARE_LABEL, VERIFIED_LABEL)
from swarm.rollout import manager_ready
from swarm.script import node_id, quote, script

# One line of JSON per node. `index` of a label that is not there gives "".
_ENGINE = "(index .Description.Engine.Labels {!r})"
_NODE = "(index .Spec.Labels {!r})"
_FIELDS = {
    "id": ".ID",
    "hostname": ".Description.Hostname",
    "state": ".Status.State",
    "availability": ".Spec.Availability",
    "condition": _ENGINE.format(CONDITION_LABEL),
    "reason": _ENGINE.format(CONDITION_REASON_LABEL),
    "gpu": _ENGINE.format(CONDITION_GPU_LABEL),
    "since": _ENGINE.format(CONDITION_SINCE_LABEL),
    "drainedBy": _NODE.format(DRAINED_BY_LABEL),
    "health": _NODE.format(HEALTH_LABEL),
    "healthLast": _NODE.format(HEALTH_LAST_LABEL),
}
FORMAT = "{" + ",".join(f'"{k}":{{{{json {v}}}}}' for k, v in _FIELDS.items()).replace("'", '"') + "}"
# An elastic pool's node (node/swarm_scaler.py adds and removes them, the program never has them): its own
# word for its pool and instance, where swarm has it, what it advertises, and what its admit proved.
_ELASTIC_FIELDS = {**_FIELDS, "pool": _ENGINE.format(ELASTIC_POOL_LABEL), "instance": _ENGINE.format(INSTANCE_ID_LABEL),
                   "addr": ".Status.Addr", "resources": ".Description.Resources.GenericResources",
                   "software": _NODE.format(SOFTWARE_LABEL), "verified": _NODE.format(VERIFIED_LABEL)}
ELASTIC_FORMAT = "{" + ",".join(f'"{k}":{{{{json {v}}}}}' for k, v in _ELASTIC_FIELDS.items()).replace("'", '"') + "}"


def read_conditions(nodes: list[str], stamp: str | None = None) -> str:
    """On a manager: print each node's health as a JSON line (nodes: the swarm IDs to read).

    stamp, when given, goes into the script as a comment: a new stamp is a new script, which
    pulumi-command runs again (that is how the inventory is read at every `pulumi up`).
    """
    ids = " ".join(node_id(n) for n in sorted(set(nodes)))
    return script(
        *([f"# conditions read at {stamp}"] if stamp else []),
        *manager_ready(),
        f"docker node inspect --format {quote(FORMAT)} {ids}" if ids else "true",
    )


def parse_conditions(stdout: str) -> dict[str, dict]:
    """read_conditions' output by node ID; a node without a watcher has condition None."""
    found = {}
    for line in (stdout or "").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        found[entry.pop("id")] = {k: (v or None) if k != "availability" else v for k, v in entry.items()}
    return found


def read_elastic_nodes(stamp: str | None = None) -> str:
    """On a manager: print a JSON line for each node of an elastic pool (those that say their pool)."""
    return script(
        *([f"# elastic nodes read at {stamp}"] if stamp else []),
        *manager_ready(),
        "ids=$(docker node ls -q)",
        "# shellcheck disable=SC2086 # one node ID a word",
        f"if [ -n \"$ids\" ]; then docker node inspect --format {quote(ELASTIC_FORMAT)} $ids | "
        f"grep -v '\"pool\":\"\"' || true; fi",
    )


def parse_elastic_nodes(stdout: str) -> list[dict]:
    return [json.loads(line) for line in (stdout or "").splitlines() if line.strip().startswith("{")]
