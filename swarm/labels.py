"""Every label name, from its one definition in node/contract.py (which says who writes and who reads each)."""
from __future__ import annotations

from swarm.node_contract import (  # noqa: F401 (re-exported)
    CHECK_SERVICE_LABEL, CONDITION_GPU_LABEL, CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL,
    DRAINED_BY_GPU_CHECK, DRAINED_BY_HEALTH, DRAINED_BY_LABEL, DRAINED_BY_ROLLOUT, GPU_COMPUTE_LABEL, GPU_COUNT_LABEL,
    GPU_CUDA_LABEL, GPU_DRIVER_LABEL, GPU_LABEL_PREFIX, GPU_MEMORY_LABEL, GPU_PRODUCT_LABEL, GPU_REPLICAS_LABEL,
    GPU_SHARING_LABEL, HEALTH_LABEL, HEALTH_LAST_LABEL, LABEL_PREFIX, MAINTENANCE_LABEL, POOL_GPU_COUNT_LABEL,
    POOL_GPU_MODEL_LABEL, POOL_INSTANCE_TYPE_LABEL, POOL_LABEL, POOL_SLOTS_PER_GPU_LABEL, POOL_SPOT_LABEL,
    SIGNALLED_LABEL, SOFTWARE_LABEL, STACK_LABEL, STACK_NAMESPACE_LABEL, VERIFIED_LABEL)
from swarm.node_contract import EFA_COUNT_LABEL, EFA_LABEL_PREFIX  # noqa: F401 (re-exported)
from swarm.node_contract import (AUTOSCALE_LABEL, AUTOSCALE_STATUS_LABEL, DRAINED_BY_AUTOSCALE,  # noqa: F401
                                 ELASTIC_POOL_LABEL, IDLE_SINCE_LABEL, INSTANCE_ID_LABEL)


def node_label_function() -> str:
    """A bash function for manager-side scripts: label $2 of node $1, empty when unset."""
    return "node_label() { docker node inspect --format \"{{index .Spec.Labels \\\"$2\\\"}}\" \"$1\"; }"


def pool_labels(pool, spot: bool | None = None) -> dict[str, str]:
    """The node labels of a GPU pool's nodes (settings' GpuPool), set when a node is admitted. Named after what
    they describe, so placement constraints read naturally: node.labels.gpu-swarm.pool == training,
    node.labels.gpu-swarm.gpu-model == H100. The stack files' spot rule reads them too (swarm/compose_spot.py).
    spot: whether the node's instance runs as spot, when known (a running node keeps the market it was launched
    on when its pool's marketType changes); else the pool's setting."""
    return {
        POOL_LABEL: pool.name,
        POOL_INSTANCE_TYPE_LABEL: pool.instance_type,
        POOL_GPU_MODEL_LABEL: pool.gpu_model,
        POOL_GPU_COUNT_LABEL: str(pool.gpus_per_node),
        POOL_SPOT_LABEL: "true" if (pool.spot if spot is None else spot) else "false",
        POOL_SLOTS_PER_GPU_LABEL: str(pool.slots_per_gpu),
    }
