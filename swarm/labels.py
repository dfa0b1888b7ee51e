"""The node labels the program owns, in one place: who reads and writes which is in its comment."""
from __future__ import annotations

POOL_LABEL = "gpu-swarm.pool"  # the node's pool; cluster.py sets it with the other pool labels
SOFTWARE_LABEL = "gpu-swarm.software"  # the release (node software + settings) the node runs; admit sets it
MAINTENANCE_LABEL = "gpu-swarm.maintenance"  # the pool's lease during a software change: "<since>:<release>"
DRAINED_BY_LABEL = "gpu-swarm.drained-by"  # who drained it: rollout, gpu-check, health; none: an operator
VERIFIED_LABEL = "gpu-swarm.gpus-verified"  # the release whose GPUs the post-join check last proved
# Health (node/gpu_health.py on each GPU node, node/swarm_reconciler.py on the managers,
# which keep their own copies of these names: they are stdlib-only programs on the node).
CONDITION_LABEL = "gpu-swarm.condition"  # an ENGINE label: healthy, degraded, unhealthy or reclaim;
# with .reason, .gpu and .since beside it. The node's watcher writes them.
HEALTH_LABEL = "gpu-swarm.health"  # "<condition>:<reason>" while the reconciler holds the node drained
HEALTH_LAST_LABEL = "gpu-swarm.health.last"  # the reconciler's last action: "drained|reactivated:<time>:<why>"


def node_label_function() -> str:
    """A bash function for manager-side scripts: label $2 of node $1, empty when unset."""
    return "node_label() { docker node inspect --format \"{{index .Spec.Labels \\\"$2\\\"}}\" \"$1\"; }"
