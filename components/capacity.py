"""A pool's capacity: its market (on-demand, spot, Capacity Block), its reservation checked against AWS, and
what to try when AWS has no capacity.

The reservation is read with aws.ec2.CapacityReservation.get, which `pulumi preview` runs
too (pulumi-aws has no data source for On-Demand Capacity Reservations): a reservation of
another instance type, or in a zone where the cluster has no subnet, fails the preview with
both named, before any instance exists. The pool's nodes go to the reservation's zone.

A capacity error (InsufficientInstanceCapacity, no spot capacity) fails that pool's
instance. An error hook then says what to try, naming the zones that offer the type; Pulumi
stops starting new steps after a failure unless `pulumi up --continue-on-error`, so the
README recommends that flag for pools that may meet one: the other pools then join, and
the next `pulumi up` creates what is missing. Nodes join the swarm drained and are given
back only once admitted (swarm/rollout.py), so a run cut short anywhere leaves no node
taking tasks that was not checked.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone

import pulumi
import pulumi_aws as aws
from pulumi.resource_hooks import ErrorHook, ErrorHookArgs

from settings import GpuPool
from settings.quota_checks import ELASTIC_IPS, how_to_raise, vcpu_quota
from settings.reader import key

# What EC2 answers when it has no capacity for the request (RunInstances error codes and the
# spot request's status), and what a full or missing reservation answers.
CAPACITY_ERRORS = re.compile(
    r"InsufficientInstanceCapacity|InsufficientCapacity|InsufficientHostCapacity|capacity-not-available|"
    r"capacity-oversubscribed|ReservationCapacityExceeded|"
    r"InsufficientReservedInstanceCapacity|There is no Spot capacity available")
# What EC2 answers when a quota of the account is too small (settings/quota_checks.py checks them at
# preview, but other instances of the account hold quota too): no zone or market change helps.
QUOTA_ERRORS = re.compile(r"VcpuLimitExceeded|MaxSpotInstanceCountExceeded|AddressLimitExceeded")


def market_options(pool: GpuPool, now: datetime | None = None) -> aws.ec2.InstanceInstanceMarketOptionsArgs | None:
    """Spot (one-time, or persistent for `interruption: stop`), a Capacity Block, or on-demand (None)."""
    o = pool.options
    if o.market_type == "capacity-block":
        return aws.ec2.InstanceInstanceMarketOptionsArgs(market_type="capacity-block")
    if not o.spot:
        return None
    persistent = o.interruption == "stop"
    return aws.ec2.InstanceInstanceMarketOptionsArgs(
        market_type="spot",
        spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
            # `stop` needs a persistent request: AWS keeps it and starts the same instance, with its EBS
            # volume, once it has capacity again (RunInstances takes persistent only with stop or hibernate).
            spot_instance_type="persistent" if persistent else "one-time",
            instance_interruption_behavior=o.interruption,
            max_price=pool.spot_max_price,
            # One-time requests take no end date (RunInstances: InvalidParameterCombination).
            valid_until=spot_request_end(now) if persistent else None,
        ),
    )


# How long a persistent request lives. EC2 ends one at ValidUntil, "Default: 7 days from the current date"
# (EC2 API reference, SpotMarketOptions), and the instance then runs on with no request: it can no longer
# be stopped, and a stopped one is terminated by the Spot service (EC2 User Guide, "Spot request status",
# instance-terminated-by-service). EC2 documents no maximum. Running nodes keep the end date they were
# launched with (instanceMarketOptions is an input they keep, components/provider_facts.py), so the date
# moves only for new nodes, and never rolls a running one.
SPOT_REQUEST_YEARS = 10


def spot_request_end(now: datetime | None = None) -> str:
    """A persistent request's ValidUntil: SPOT_REQUEST_YEARS from the first of this month, in EC2's exact
    form (YYYY-MM-DDTHH:MM:SSZ, no fraction: EC2 refuses milliseconds), the same all month long."""
    now = now or datetime.now(timezone.utc)
    return f"{now.year + SPOT_REQUEST_YEARS:04d}-{now.month:02d}-01T00:00:00Z"


def capacity_specification(pool: GpuPool, reservation_id: pulumi.Input[str] | None
                           ) -> aws.ec2.InstanceCapacityReservationSpecificationArgs | None:
    o = pool.options
    if reservation_id is not None:
        return aws.ec2.InstanceCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.InstanceCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_id=reservation_id))
    if o.capacity_reservation:  # a resource group: AWS picks a reservation of the group at launch
        return aws.ec2.InstanceCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.InstanceCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_resource_group_arn=o.capacity_reservation))
    if o.capacity_preference:
        return aws.ec2.InstanceCapacityReservationSpecificationArgs(
            capacity_reservation_preference=o.capacity_preference)
    return None


class ReservationMismatch(pulumi.RunError):
    """The reservation and the pool disagree; `pulumi preview` prints it without a traceback."""


def checked_reservation(name: str, pool: GpuPool, subnets_by_zone: dict[str, pulumi.Input[str]],
                        parent: pulumi.Resource):
    """(reservation id, the subnet in its zone, its placement group name or None), as Outputs that fail with
    ReservationMismatch when the reservation is not for this pool."""
    reservation_id = pool.options.reservation_id
    read = aws.ec2.CapacityReservation.get(f"{name}-reservation", reservation_id,
                                           opts=pulumi.ResourceOptions(parent=parent))
    zones = sorted(subnets_by_zone)

    def check(values) -> tuple[str, str]:
        instance_type, zone, group_arn = values
        problem = reservation_problem(pool, reservation_id, instance_type, zone, zones, group_arn)
        if problem:
            raise ReservationMismatch(problem)
        return zone, group_arn or ""

    checked = pulumi.Output.all(read.instance_type, read.availability_zone, read.placement_group_arn).apply(check)
    subnet = pulumi.Output.all(checked, *[subnets_by_zone[z] for z in zones]).apply(
        lambda v: v[1 + zones.index(v[0][0])])
    group = checked.apply(lambda c: c[1].rsplit("/", 1)[-1] if c[1] else None)
    return checked.apply(lambda _: reservation_id), subnet, group


def reservation_problem(pool: GpuPool, reservation_id: str, instance_type: str, zone: str, zones,
                        group_arn: str | None = None) -> str | None:
    """Why the reservation cannot hold the pool's nodes, naming both sides; None when it can."""
    where = f"{key('gpuPools')} {pool.name}.capacityReservation: {reservation_id}"
    if instance_type != pool.instance_type:
        return (f"{where} reserves {instance_type}, but the pool's instanceType is {pool.instance_type}; "
                f"use a reservation for {pool.instance_type}, or set instanceType {instance_type}")
    if pool.options.availability_zone and zone != pool.options.availability_zone:
        return (f"{where} is in {zone}, but the pool's availabilityZone is {pool.options.availability_zone}; "
                "remove availabilityZone (the reservation decides) or make them agree")
    if zone not in zones:
        return (f"{where} is in {zone}, but the pool's nodes can go only to {', '.join(zones) or 'no zone'} "
                f"(this cluster's zones that offer {pool.instance_type}); add {zone} to "
                f"{key('availabilityZones')}, or use a reservation in one of them")
    if group_arn and pool.options.placement:
        return (f"{where} was made in the placement group {group_arn}, and its instances must launch there; "
                "remove the pool's placement (it then uses that group)")
    return None


def pool_subnets(name: str, pool: GpuPool, subnets_by_zone: dict[str, pulumi.Input[str]], parent: pulumi.Resource):
    """(the pool's subnets, its reservation id or None, the reservation's placement group or None): a pool with
    a reservation id goes to the reservation's zone, checked against the pool."""
    # A pool of no nodes reads no reservation (as settings/reservation_checks.py checks none): an ended one is
    # gone to the provider's read, and a `get` of it fails the preview (the engine: "resource ... does not
    # exist"), which would make the advice for an ended Capacity Block (count 0) fail the preview it fixes.
    if not pool.options.reservation_id or not pool.most_nodes:
        return [subnets_by_zone[z] for z in pool.zones or subnets_by_zone], None, None
    reservation, subnet, group = checked_reservation(
        f"{name}-{pool.name}", pool, {z: subnets_by_zone[z] for z in pool.zones}, parent)
    return [subnet], reservation, group


def pool_capacity_args(name: str, pool: GpuPool, subnets_by_zone: dict[str, pulumi.Input[str]],
                       parent: pulumi.Resource) -> dict:
    """The NodePoolArgs of a GPU pool's market, reservation, placement, EFA and subnets."""
    subnets, reservation, group = pool_subnets(name, pool, subnets_by_zone, parent)
    return dict(subnet_ids=subnets, market=market_options(pool),
                capacity=capacity_specification(pool, reservation),
                spot=pool.spot, placement_group=group, cluster_placement=pool.options.placement == "cluster",
                efa_interfaces=pool.efa_interfaces, stable_address=bool(pool.efa_interfaces),
                error_hook=capacity_error_hook(pool))


def quota_advice(pool: GpuPool, text: str) -> str | None:
    """The quota that refused a node of `pool`, and how to raise it; None for any other error."""
    found = QUOTA_ERRORS.search(text)
    if not found:
        return None
    if found[0] == "AddressLimitExceeded":
        quota, what = ELASTIC_IPS, "Elastic IPs (one per manager and per EFA node)"
    else:
        quota = vcpu_quota(pool.instance_type, pool.spot or found[0] == "MaxSpotInstanceCountExceeded")
        what = f"vCPUs ({pool.most_nodes} x {pool.instance_type} for this pool, with the rest of the account's)"
    if quota is None:
        return f"pool {pool.name}: an EC2 quota refused {pool.instance_type} ({found[0]}); raise it in Service Quotas"
    return (f"pool {pool.name}: {found[0]}: the EC2 quota {quota.code} ('{quota.name}') is smaller than the "
            f"{what} in use and asked for. {how_to_raise(quota, None, aws.config.region or 'your region')}; "
            "then run `pulumi up` again (nodes made so far stay)")


def capacity_advice(pool: GpuPool, errors: list[str]) -> str | None:
    """What to try when AWS had no capacity, or a quota refused, a node of `pool`; None for any other error."""
    text = " ".join(errors)
    if QUOTA_ERRORS.search(text):
        return quota_advice(pool, text)
    if not CAPACITY_ERRORS.search(text):
        return None
    o = pool.options
    tries = []
    other = [z for z in pool.offered_in if z not in pool.zones]
    if other:
        tries.append(f"another zone: {pool.instance_type} is also offered in {', '.join(other)} (add one to "
                     f"{key('availabilityZones')}, then set the pool's availabilityZone)")
    elif len(pool.zones) > 1 and not o.one_zone:
        tries.append(f"one zone of {', '.join(pool.zones)} with the pool's availabilityZone")
    if o.spot:
        tries.append("marketType on-demand, or a spot pool of another type")
    if not o.capacity_reservation:
        tries.append("an On-Demand Capacity Reservation or an EC2 Capacity Block for ML "
                     "(the pool's capacityReservation, with marketType capacity-block for a block)")
    elif "ReservationCapacityExceeded" in text:
        tries.append(f"a larger reservation than {o.capacity_reservation}, or a smaller count")
    tries.append("a smaller count for now")
    return (f"pool {pool.name}: AWS has no {pool.instance_type} capacity for it now (in "
            f"{', '.join(pool.zones) or 'its zone'}; the type is offered in "
            f"{', '.join(pool.offered_in) or 'no zone'}). "
            f"Try {'; or '.join(tries)}. With `pulumi up --continue-on-error` the other pools go on; "
            "the next `pulumi up` creates the missing nodes, and no node takes tasks before it is checked.")


def capacity_error_hook(pool: GpuPool) -> ErrorHook | None:
    """An error hook that says what to try on a capacity error; None where the Pulumi CLI has no error hooks."""
    from pulumi.runtime import settings as runtime_settings
    from pulumi.runtime.proto import resource_pb2

    if not runtime_settings.monitor_supports_feature(resource_pb2.RESOURCE_MONITOR_FEATURE_ERROR_HOOKS):
        return None

    def advise(args: ErrorHookArgs) -> bool:
        advice = capacity_advice(pool, list(args.errors))
        if advice:
            pulumi.log.error(advice)
        return False  # never retry here: the same zone, a second later, rarely has capacity

    return ErrorHook(f"gpu-swarm-capacity-{pool.name}", advise)
