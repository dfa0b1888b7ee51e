"""Read-only AWS lookups that settings/ checks the stack configuration against, and the prices components/cost.py reads.

They are synchronous invokes, so every check runs, and fails, before the first
resource is registered: a bad value stops `pulumi preview` with nothing created.
Each lookup raises LookupError carrying AWS's own words; settings/aws_checks.py adds
the config key and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

# Tags the program puts on everything it makes (components/cluster.py, node_pool.py); lookups find them by it.
CLUSTER_TAG = "gpu-swarm:cluster"
ROLE_TAG = "gpu-swarm:role"
POOL_TAG = "gpu-swarm:pool"
# Every tag the program sets itself, as many as any one resource gets (a node: settings/tag_checks.py counts them).
OWN_TAGS = ("Name", CLUSTER_TAG, ROLE_TAG, POOL_TAG)
# Public SSM parameters that always name the newest image of each kind (amd64).
UBUNTU_AMI_PARAMETER = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
DEEP_LEARNING_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)


@dataclass(frozen=True)
class InstanceTypeFacts:
    name: str
    architectures: tuple[str, ...]
    nvidia_gpus: int  # per instance; 0 when the type has no NVIDIA GPU
    gpu_model: str  # e.g. "L40S"; "" without NVIDIA GPUs
    other_gpus: str  # non-NVIDIA GPUs, named for error messages (e.g. "AMD Radeon Pro V520")
    # EFA, as DescribeInstanceTypes has it: how many EFA interfaces an instance takes, one per
    # network card (p5.48xlarge: 32 cards, 32 EFA). 0: the type has no EFA.
    efa_interfaces: int = 0
    vcpus: int = 0  # DefaultVCpus: what EC2's instance quotas count


@dataclass(frozen=True)
class AmiFacts:
    id: str
    architecture: str
    root_snapshot_gib: int  # the root volume may not be smaller
    root_device: str = ""  # the root volume's device name (an elastic pool's launch template names it)


@dataclass(frozen=True)
class SubnetFacts:
    id: str
    vpc_id: str
    availability_zone: str


class PermissionMissing(Exception):
    """The credentials of `pulumi preview` or `up` may not call an action a lookup needs: said as that, never as
    the lookup's own failure (a reservation that Cloud Control may not read is not one that has ended). Not a
    LookupError, so no check takes it for an answer about its value."""

    def __init__(self, action: str, words: str):
        self.action = action
        super().__init__(f"the AWS credentials of this `pulumi up` may not call {action} ({words}); allow it, as "
                         "the operator policy does (docs/reference/operator-policy.md)")


# IAM's words in every service's AccessDenied: "... is not authorized to perform: ec2:DescribeImages ..."
_DENIED = re.compile(r"not authorized to perform: ([a-z0-9-]+:[A-Za-z0-9*]+)")


def _aws_error(exc: Exception) -> LookupError | PermissionMissing:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    denied = _DENIED.search(str(exc))
    if denied:
        return PermissionMissing(denied[1], first_line.split(": AccessDenied")[0].strip()[:200])
    return LookupError(first_line)


def describe_instance_type(name: str) -> InstanceTypeFacts:
    try:
        result = aws.ec2.get_instance_type(instance_type=name)
    except Exception as exc:  # the invoke's error is the only description of what went wrong
        raise _aws_error(exc) from None
    gpus = result.gpuses or []
    nvidia = [g for g in gpus if g.manufacturer == "NVIDIA"]
    cards = result.maximum_network_cards or len(result.network_cards or []) or 1
    efa = min(result.efa_maximum_interfaces or 0, cards) if result.efa_supported else 0
    return InstanceTypeFacts(
        name=name,
        architectures=tuple(result.supported_architectures or ()),
        nvidia_gpus=sum(g.count for g in nvidia),
        gpu_model="+".join(sorted({g.name for g in nvidia})),
        other_gpus=", ".join(f"{g.manufacturer} {g.name}" for g in gpus if g.manufacturer != "NVIDIA"),
        efa_interfaces=efa,
        vcpus=int(result.default_vcpus or 0),
    )


def zones_offering(instance_types: list[str]) -> dict[str, frozenset[str]]:
    """For each instance type, the availability zones (names) of this region that offer it."""
    try:
        result = aws.ec2.get_instance_type_offerings(
            location_type="availability-zone",
            filters=[{"name": "instance-type", "values": sorted(set(instance_types))}],
        )
    except Exception as exc:
        raise _aws_error(exc) from None
    offered: dict[str, set[str]] = {t: set() for t in instance_types}
    for instance_type, zone in zip(result.instance_types, result.locations):
        offered.setdefault(instance_type, set()).add(zone)
    return {t: frozenset(zones) for t, zones in offered.items()}


def available_zones() -> tuple[str, ...]:
    """The region's availability zones this account can use; Local and Wavelength Zones left out."""
    try:
        result = aws.get_availability_zones(
            state="available", filters=[{"name": "zone-type", "values": ["availability-zone"]}]
        )
    except Exception as exc:
        raise _aws_error(exc) from None
    return tuple(sorted(result.names))


def ssm_parameter(name: str) -> str:
    try:
        # insecure_value: an AMI id is not a secret, and `value` is always marked as one.
        return aws.ssm.get_parameter(name=name).insecure_value
    except Exception as exc:
        raise _aws_error(exc) from None


def describe_ami(ami_id: str) -> AmiFacts:
    try:
        result = aws.ec2.get_ami(
            filters=[{"name": "image-id", "values": [ami_id]}], include_deprecated=True
        )
    except Exception as exc:
        raise _aws_error(exc) from None
    root = next(
        (m for m in result.block_device_mappings or [] if m.device_name == result.root_device_name),
        None,
    )
    size = int((root.ebs or {}).get("volume_size", 0)) if root else 0
    return AmiFacts(id=ami_id, architecture=result.architecture, root_snapshot_gib=size,
                    root_device=result.root_device_name or "")


def vpc_cidrs(vpc_id: str) -> tuple[str, ...]:
    """Every IPv4 range of an existing VPC: its primary block and any associated ones."""
    try:
        result = aws.ec2.get_vpc(id=vpc_id)
    except Exception as exc:
        raise _aws_error(exc) from None
    blocks = [result.cidr_block] + [a.cidr_block for a in result.cidr_block_associations or []]
    return tuple(dict.fromkeys(b for b in blocks if b))


def describe_subnet(subnet_id: str) -> SubnetFacts:
    try:
        result = aws.ec2.get_subnet(id=subnet_id)
    except Exception as exc:
        raise _aws_error(exc) from None
    return SubnetFacts(id=subnet_id, vpc_id=result.vpc_id, availability_zone=result.availability_zone)


def route_table_of(subnet_id: str, vpc_id: str) -> str:
    """The route table a subnet uses: its own association, else the VPC's main table.

    Plural lookups: a failing invoke fails the whole program, even when its error is caught,
    and "no table of its own" is no error here.
    """
    try:
        own = aws.ec2.get_route_tables(vpc_id=vpc_id, filters=[{"name": "association.subnet-id",
                                                                "values": [subnet_id]}]).ids
        if own:
            return own[0]
        main = aws.ec2.get_route_tables(vpc_id=vpc_id, filters=[{"name": "association.main", "values": ["true"]}]).ids
    except Exception as exc:
        raise _aws_error(exc) from None
    if not main:
        raise LookupError(f"{vpc_id} has no main route table")
    return main[0]


def vpc_endpoint(endpoint_id: str) -> tuple[str, str, str, tuple[str, ...]]:
    """(VPC, service name, type, route tables) of an existing VPC endpoint."""
    try:
        result = aws.ec2.get_vpc_endpoint(id=endpoint_id)
    except Exception as exc:
        raise _aws_error(exc) from None
    return result.vpc_id, result.service_name, result.vpc_endpoint_type, tuple(result.route_table_ids or ())


def cluster_subnet_zones(cluster: str) -> dict[str, str]:
    """Zone -> subnet id of the subnets this cluster's VPC already has (tag gpu-swarm:cluster), {} for a new one.

    The program keeps them: a subnet with instances in it cannot be deleted (DependencyViolation).
    get_subnets answers an empty list, not an error, when there are none.
    """
    try:
        ids = aws.ec2.get_subnets(tags={CLUSTER_TAG: cluster}).ids or []
        return {describe_subnet(i).availability_zone: i for i in sorted(ids)}
    except Exception as exc:
        raise _aws_error(exc) from None


def running_names(cluster: str, role: str, names: list[str]) -> tuple[str, ...]:
    """Which of `names` (Name tags) name an instance of this cluster and role that is running now.

    One lookup per name: aws.ec2.get_instances answers ids, not tags, and a name is what stays
    when an instance is replaced."""
    running = []
    for name in names:
        try:
            ids = aws.ec2.get_instances(instance_tags={CLUSTER_TAG: cluster, ROLE_TAG: role, "Name": name},
                                        instance_state_names=["running"]).ids or ()
        except Exception as exc:
            raise _aws_error(exc) from None
        if ids:
            running.append(name)
    return tuple(running)


def stopped_instance_ids(cluster: str) -> frozenset[str]:
    """The ids of this cluster's instances that are stopped or stopping now: an operator's stop, or a spot
    node that AWS stopped on an interruption (interruption: stop), which AWS starts again once it has the
    capacity (EC2 User Guide, "Behavior of Spot Instance interruptions"). One lookup for the cluster."""
    try:
        found = aws.ec2.get_instances(instance_tags={CLUSTER_TAG: cluster}, instance_state_names=["stopping", "stopped"])
    except Exception as exc:
        raise _aws_error(exc) from None
    return frozenset(found.ids or ())


def service_quota(service: str, code: str) -> float:
    """The account's value of a Service Quotas quota in this region; LookupError when it cannot be read."""
    try:
        return float(aws.servicequotas.get_service_quota(service_code=service, quota_code=code).value)
    except Exception as exc:
        raise _aws_error(exc) from None


@dataclass(frozen=True)
class ReservationState:
    id: str
    state: str  # active, scheduled, expired, cancelled, pending, payment-pending, failed...
    start: str  # RFC 3339; "" when AWS gives none
    end: str
    capacity_block: bool


def capacity_block_state(reservation_id: str) -> ReservationState:
    """A Capacity Block's state and dates (aws.ec2.get_capacity_block_reservation, every state)."""
    try:
        result = aws.ec2.get_capacity_block_reservation(id=reservation_id)
    except Exception as exc:
        raise _aws_error(exc) from None
    return ReservationState(reservation_id, result.state, result.start_date or "", result.end_date or "", True)


def reservation_state(reservation_id: str) -> ReservationState:
    """An On-Demand Capacity Reservation, through Cloud Control (pulumi-aws has no data source for one).

    Its read, as the provider's, finds no reservation that has expired or was cancelled: that
    is a LookupError here, and the caller says so."""
    import json

    try:
        result = aws.cloudcontrol.get_resource(type_name="AWS::EC2::CapacityReservation", identifier=reservation_id)
    except Exception as exc:
        raise _aws_error(exc) from None
    props = json.loads(result.properties or "{}")
    return ReservationState(reservation_id, str(props.get("State") or "active"), str(props.get("StartDate") or ""),
                            str(props.get("EndDate") or ""), False)



# The Price List API answers in these regions only, each with every region's prices (pulumi-aws's getProduct:
# "only available in a us-east-1 or ap-south-1 provider").
PRICE_LIST_REGIONS = ("us-east-1", "ap-south-1")


class NoPrice(LookupError):
    """AWS lists no such price: the Price List has no such product, or the zone no spot price for the type."""


def _price_error(exc: Exception, no_price: str) -> Exception:
    """NoPrice when the provider's words (in any line: the bridge puts the reason under "1 error occurred:")
    say AWS has none, PermissionMissing for an AccessDenied, else a LookupError with the whole text."""
    words = re.sub(r"(invoke of|invocation of|invoking) [\w:/]+( failed| returned an error)?: |1 error occurred: \* ",
                   "", " ".join(str(exc).split()))  # the SDK's and the bridge's wrapping, which says nothing
    if no_price in words:
        return NoPrice(words[:300])
    error = _aws_error(exc)
    return error if isinstance(error, PermissionMissing) else LookupError(words[:300])


def price_list_product(filters: dict[str, str], provider: pulumi.ProviderResource | None = None) -> str:
    """The one AmazonEC2 product of the Price List that every filter matches (sent as TERM_MATCH), as JSON text.
    provider: one in a PRICE_LIST_REGIONS region, when the stack's region is none of them."""
    try:
        return aws.pricing.get_product(service_code="AmazonEC2",
                                       filters=[{"field": k, "value": v} for k, v in filters.items()],
                                       opts=pulumi.InvokeOptions(provider=provider) if provider else None).result
    except Exception as exc:
        raise _price_error(exc, "Pricing product query did not return any elements") from None


def spot_price(instance_type: str, zone: str) -> tuple[str, str]:
    """(USD per hour, when it was set, RFC 3339): the Linux spot price in effect now in `zone`."""
    try:
        result = aws.ec2.get_spot_price(instance_type=instance_type, availability_zone=zone,
                                        filters=[{"name": "product-description", "values": ["Linux/UNIX"]}])
    except Exception as exc:
        raise _price_error(exc, "no EC2 Spot Price History found matching criteria") from None
    return result.spot_price, result.spot_price_timestamp
