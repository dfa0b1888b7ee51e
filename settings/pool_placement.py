"""Where each pool's nodes go, and what they get: the zones of the cluster that offer its type, EFA interfaces.

The cluster's subnets are chosen once and kept (settings/aws_checks.py); each pool, the
managers included, then goes to those of the cluster's zones that offer its instance type.
So a new pool whose type is offered in fewer zones narrows only itself: no subnet is
deleted or made for it. A pool held to one zone (a placement group, EFA, a reservation, or
availabilityZone) gets one zone here, or, with a reservation id, the zone that
components/capacity.py reads from the reservation, among these.
"""
from __future__ import annotations

from dataclasses import dataclass

from settings import aws_lookups
from settings.config_checks import PoolConfig
from settings.model import Network
from settings.pool_options import GROUP_ARN_RE
from settings.reader import Reader, key

# Named in the error for a pool that asks for EFA on a type without it.
EFA_EXAMPLES = "p4d.24xlarge, p5.48xlarge, p5en.48xlarge, p6-b200.48xlarge, or g6e.8xlarge and larger"


@dataclass(frozen=True)
class Placement:
    zones: tuple[str, ...]  # where the pool's nodes go, in the network's order
    efa_interfaces: int = 0
    offered_in: tuple[str, ...] = ()  # every zone of the region that offers the type


def place(r: Reader, network: Network, managers_type: str | None, pools: list[PoolConfig], facts: dict,
          pinned: bool) -> tuple[tuple[str, ...], dict[int, Placement]]:
    """The managers' zones, and each pool's Placement by its index; problems go to r."""
    types = list(dict.fromkeys(([managers_type] if managers_type else []) + [p.instance_type for p in pools]))
    try:
        offered = aws_lookups.zones_offering(types)
    except LookupError as exc:
        r.error("gpuPools", f"could not list where the instance types are offered ({exc})")
        return (), {}
    active = network.active_zones or network.availability_zones

    def candidates(name: str, instance_type: str) -> tuple[str, ...]:
        found = tuple(z for z in active if z in offered.get(instance_type, ()))
        if not found:
            r.error(*_nowhere(name, instance_type, network, active, sorted(offered.get(instance_type, ())), pinned))
        return found

    manager_zones = candidates("managerInstanceType", managers_type) if managers_type else ()
    placed = {}
    for p in pools:
        found = facts.get(p.instance_type)
        if not found or not p.valid:
            continue
        zones = candidates(f"gpuPools[{p.index}].instanceType", p.instance_type)
        o = p.options
        where = f"gpuPools[{p.index}]"
        efa = found.efa_interfaces if o.efa else 0
        if o.efa and not found.efa_interfaces:
            r.error(f"{where}.efa", f"{p.instance_type} has no EFA; choose a type that has it ({EFA_EXAMPLES}), "
                                    "or remove efa")
        group = GROUP_ARN_RE.fullmatch(o.capacity_reservation or "")
        if group and group[1] != _region():
            r.error(f"{where}.capacityReservation", f"the resource group is in {group[1]}, this stack deploys to "
                                                    f"{_region()}; use a group of this region")
        if o.availability_zone and zones and o.availability_zone not in zones:
            r.error(f"{where}.availabilityZone", _zone_problem(o.availability_zone, p.instance_type, zones, active))
        if not zones:
            continue
        if o.availability_zone:
            zones = (o.availability_zone,)
        elif o.one_zone and not o.reservation_id:
            zones = zones[:1]  # the reservation's own zone is read from AWS (components/capacity.py)
        placed[p.index] = Placement(zones, efa, tuple(sorted(offered.get(p.instance_type, ()))))
    return manager_zones, placed


def _region() -> str:
    import pulumi_aws as aws
    return aws.config.region or ""


def _nowhere(name: str, instance_type: str, network: Network, active, offered: list[str], pinned: bool):
    """(key, message) for a type that no zone of the cluster offers: the fix depends on how the zones came."""
    where = ", ".join(offered) or "no zone of this region"
    if network.vpc_id:
        subnets = [f"{s} is in {z}" for s, z in zip(network.subnet_ids, network.availability_zones)]
        return "subnetIds", f"{'; '.join(subnets)}, which does not offer {instance_type}; use subnets in {where}"
    if pinned:
        return "availabilityZones", (f"{', '.join(active)} does not offer {instance_type} ({key(name)}); add a zone "
                                     f"that does: {where}")
    return name, (f"{instance_type} is offered in {where}, and none of this cluster's zones ({', '.join(active)}); "
                  f"add one of them to {key('availabilityZones')} (a new subnet; the others stay)")


def _zone_problem(zone: str, instance_type: str, zones: tuple[str, ...], active) -> str:
    if zone not in active:
        return (f"{zone} is not one of this cluster's zones ({', '.join(active)}); add it to "
                f"{key('availabilityZones')}, or choose one of {', '.join(zones)}")
    return f"{zone} does not offer {instance_type}; this cluster's zones that do: {', '.join(zones)}"
