"""The validated stack configuration: frozen dataclasses, and the one error that lists every problem."""
from __future__ import annotations

from dataclasses import dataclass

import pulumi

from swarm.node_contract import (HEALTH_CRITICAL_XIDS_ENV, HEALTH_IGNORE_XIDS_ENV, HEALTH_INTERVAL_ENV,
                                 HEALTH_MAX_DRAINED_PERCENT_ENV, HEALTH_RECOVERY_ENV)
from settings.pool_autoscale import Autoscale
from settings.pool_options import PoolOptions
from swarm.stack_files import StackInfo

PROJECT = "gpu-swarm"


def cluster_name() -> str:
    """The cluster's name, tag and resource prefix: one per stack."""
    return f"{PROJECT}-{pulumi.get_stack()}"


class SettingsError(pulumi.RunError, ValueError):
    """Every problem in the stack configuration. As a RunError, `pulumi up` prints it without a traceback."""

    def __init__(self, problems: list[str]):
        self.problems = tuple(problems)
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"the {PROJECT} stack configuration has {len(problems)} problem(s); nothing was created:\n{listed}"
        )


@dataclass(frozen=True)
class GpuPool:
    name: str
    instance_type: str
    count: int
    spot: bool
    spot_max_price: str | None  # None: pay up to the on-demand price
    root_volume_gib: int
    gpus_per_node: int  # from the instance type, the number each node must advertise
    gpu_model: str
    slots_per_gpu: int = 0  # > 0: each GPU is shared by this many tasks, by sharing_mode
    sharing_mode: str = "time-slicing"  # or mps: each task an MPS client with a memory limit
    # Capacity and placement (settings/pool_options.py, pool_placement.py).
    options: PoolOptions = PoolOptions()
    zones: tuple[str, ...] = ()  # where its nodes go, in the network's order; empty: every zone
    efa_interfaces: int = 0  # EFA interfaces per node (one per network card); 0: no EFA
    offered_in: tuple[str, ...] = ()  # every zone of the region that offers its type (for capacity advice)
    max_unavailable: int = 1  # nodes a roll drains at once: rollout.maxUnavailable (settings/pool_rollout.py)
    # A capacity-block pool: its block's end (RFC 3339, as AWS reads it at preview), which its nodes drain
    # ahead of (the health watcher); an extended block has a later one.
    capacity_block_end: str = ""
    # An elastic pool (settings/pool_autoscale.py): an Auto Scaling group the scaler sizes; its count is 0,
    # as the program makes none of its nodes itself.
    autoscale: Autoscale | None = None

    @property
    def most_nodes(self) -> int:
        """The most nodes the pool can have: what quotas and reservations must hold."""
        return self.autoscale.max if self.autoscale else self.count


@dataclass(frozen=True)
class Managers:
    count: int
    instance_type: str
    root_volume_gib: int
    zones: tuple[str, ...] = ()  # where they go (zones that offer their type); empty: every zone


@dataclass(frozen=True)
class Network:
    """Either a VPC to create (vpc_cidr, subnet_cidrs) or an existing one (vpc_id, subnet_ids)."""

    availability_zones: tuple[str, ...]  # one per subnet, in subnet order
    vpc_cidr: str | None = None
    subnet_cidrs: tuple[str, ...] = ()
    vpc_id: str | None = None
    subnet_ids: tuple[str, ...] = ()
    # An existing VPC's route tables for subnet_ids: the nodes reach the node software's
    # bucket through an S3 gateway endpoint on them (components/node_bundle.py).
    route_table_ids: tuple[str, ...] = ()
    s3_endpoint_id: str | None = None  # the VPC's own S3 gateway endpoint, when it has one that serves them
    # Where new nodes go (availabilityZones, else the kept zones); empty: all of availability_zones. A
    # zone dropped from availabilityZones keeps its subnet, which running nodes may still use.
    active_zones: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackFile:
    name: str
    file: str  # relative to the project directory, so the state does not hold this machine's paths
    sha256: str
    content: str  # deployed from this text: the file on disk may change after the checks; holds its secrets
    info: StackInfo
    wait_seconds: int = 600  # stacks[].waitSeconds: the deploy's bound on waiting for the stack to settle

    @property
    def deployed(self) -> pulumi.Input[str]:
        """What the deploy sends: a Pulumi secret when the file holds values of gpu-swarm:stackSecrets."""
        return pulumi.Output.secret(self.content) if self.info.secrets else self.content


@dataclass(frozen=True)
class Health:
    """GPU health: what the watcher on each GPU node counts as a fault, and how the managers act."""

    ignore_xids: tuple[int, ...] = ()  # besides the application XIDs the watcher ignores anyway
    critical_xids: tuple[int, ...] = ()  # never ignored
    check_interval_s: int = 10
    recovery_s: int = 300  # checks must pass this long after an event before the node is healthy
    max_drained_percent: int = 50  # the reconciler drains at most this share of nodes for faults
    inventory_each_up: bool = True  # read each node's condition at every `pulumi up`

    def node_env(self) -> dict[str, str]:
        """health.env (HEALTH_ENV_PATH on the node), which the watcher and the reconciler read."""
        return {
            HEALTH_IGNORE_XIDS_ENV: ",".join(map(str, self.ignore_xids)),
            HEALTH_CRITICAL_XIDS_ENV: ",".join(map(str, self.critical_xids)),
            HEALTH_INTERVAL_ENV: str(self.check_interval_s),
            HEALTH_RECOVERY_ENV: str(self.recovery_s),
            HEALTH_MAX_DRAINED_PERCENT_ENV: str(self.max_drained_percent),
        }


@dataclass(frozen=True)
class Monitoring:
    """The monitoring stack (stacks/monitoring.yml): Prometheus and Grafana on the managers."""

    enabled: bool = False
    images: tuple[tuple[str, str], ...] = ()  # (service, image pinned by digest) replacing the stack file's


@dataclass(frozen=True)
class Settings:
    cluster_name: str
    allowed_ssh_cidrs: tuple[str, ...]
    network: Network
    managers: Managers
    gpu_pools: tuple[GpuPool, ...]
    image: str
    manager_ami_id: str
    gpu_ami_id: str
    ami_from_ssm: bool  # "latest" AMIs change under us; see NodePool's ignore_changes
    gpu_kind: str
    stacks: tuple[StackFile, ...]
    tags: tuple[tuple[str, str], ...]
    ssh_user: str
    ssh_public_key: str | None
    ssh_private_key: pulumi.Output[str] | None  # secret; None: generate a key pair
    imds_hop_limit: int
    overlay_address_pool: str  # swarm overlay networks are cut from it, /24 each
    ssh_authorized_keys: tuple[str, ...]  # besides the program's own key
    shared_gpu_kind: str  # the kind of the slots of shared GPUs
    health: Health = Health()
    monitoring: Monitoring = Monitoring()

    @property
    def max_whole_gpus_per_node(self) -> int:
        """The most whole GPUs a task can reserve: the largest pool that does not share (0: none)."""
        return max((p.gpus_per_node for p in self.gpu_pools if not p.slots_per_gpu), default=0)

    @property
    def shares_gpus(self) -> bool:
        return any(p.slots_per_gpu for p in self.gpu_pools)

    @property
    def max_gpus_per_node(self) -> int:
        return max((p.gpus_per_node for p in self.gpu_pools), default=0)

    @property
    def elastic_pools(self) -> tuple[GpuPool, ...]:
        return tuple(p for p in self.gpu_pools if p.autoscale)

    @property
    def tag_map(self) -> dict[str, str]:
        return dict(self.tags)


