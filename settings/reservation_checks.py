"""The state of each pool's capacity reservation or Capacity Block, checked at preview.

An active one is used as it is. A Capacity Block bought for later (scheduled) takes no
instance before its start, so the preview says when that is. One that has expired or was
cancelled is named with its state: the provider's read of the reservation (components/
capacity.py) finds none in those states, and would fail every preview with no word on why.
Capacity Blocks are read with aws.ec2.get_capacity_block_reservation, which answers in every
state; On-Demand Capacity Reservations through Cloud Control (pulumi-aws has no data source
for them), whose read, like the provider's, finds none that has ended.
"""
from __future__ import annotations

import dataclasses

from settings import aws_lookups
from settings.model import GpuPool
from settings.reader import Reader

NOT_YET = ("scheduled", "payment-pending", "pending", "assessing", "delayed")
ENDED = ("expired", "cancelled", "failed", "payment-failed", "unsupported")


def reservation_problem(pool: GpuPool, found: aws_lookups.ReservationState) -> str | None:
    """What keeps the pool's nodes out of the reservation now, in words; None when it is active."""
    what = "Capacity Block" if found.capacity_block else "capacity reservation"
    if found.state == "active":
        return None
    if found.state == "scheduled":
        return (f"{found.id} is a Capacity Block that starts at {found.start or 'a later time'}: no instance "
                f"launches in it before then. Run `pulumi up` once it has started, or set the pool's count "
                f"to 0 until then (the rest of the cluster does not wait for it)")
    if found.state in NOT_YET:
        return (f"{found.id} is {found.state}, not yet active: no instance launches in it. Wait until the "
                f"EC2 console shows it active, or set the pool's count to 0 until then")
    since = f" (it ended at {found.end})" if found.end and found.state == "expired" else ""
    if found.capacity_block:
        # Not "remove the block": the pool would then launch P instances on demand, at list price.
        return (f"{found.id} is {found.state}{since}: this Capacity Block takes no instance any more, and AWS "
                "terminated its instances at its end. Set the pool's count to 0 (its nodes leave the swarm), or buy "
                "a new Capacity Block and name its reservation id in capacityReservation")
    return (f"{found.id} is {found.state}{since}: this {what} takes no instance any more. Remove the pool's "
            f"capacityReservation, or name an active one")


def check_reservations(r: Reader, pools: list[GpuPool], region: str) -> list[GpuPool]:
    """The pools, each capacity-block pool with its block's end; problems go to r."""
    out = []
    for pool in pools:
        out.append(pool)
        reservation_id = pool.options.reservation_id
        if not reservation_id or not pool.most_nodes:
            continue
        where = f"{pool.name}.capacityReservation"
        block = pool.options.market_type == "capacity-block"
        try:
            found = (aws_lookups.capacity_block_state if block else aws_lookups.reservation_state)(reservation_id)
        except LookupError as exc:
            if block:
                r.error("gpuPools", f"{where}: AWS describes no Capacity Block {reservation_id} in {region} "
                                    f"({exc}); check the id (aws ec2 describe-capacity-reservations) and the region")
            else:
                r.error("gpuPools", f"{where}: AWS has no active capacity reservation {reservation_id} in {region} "
                                    f"({exc}); one that has expired or was cancelled is gone for good. Remove "
                                    "capacityReservation, or name an active one (aws ec2 "
                                    "describe-capacity-reservations --filters Name=state,Values=active)")
            continue
        problem = reservation_problem(pool, found)
        if problem:
            r.error("gpuPools", f"{where}: {problem}")
        elif block:
            out[-1] = dataclasses.replace(pool, capacity_block_end=found.end)
    return out
