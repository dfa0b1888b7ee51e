"""A GPU pool's capacity and placement keys, each checked on its own, before anything is asked of AWS.

marketType (on-demand, spot, capacity-block), interruption (spot: terminate or stop),
capacityReservation (an On-Demand Capacity Reservation's id or a resource group's ARN, or the
Capacity Block a capacity-block pool runs in), capacityReservationPreference (open or none),
placement (cluster), efa and availabilityZone. settings/pool_placement.py then checks them
against the instance type and the cluster's zones; components/capacity.py against the
reservation itself, which only a resource read can see.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from settings.values import boolean

MARKET_TYPES = ("on-demand", "spot", "capacity-block")
INTERRUPTIONS = ("terminate", "stop")
PREFERENCES = ("open", "none")
PLACEMENTS = ("cluster",)
RESERVATION_ID_RE = re.compile(r"cr-[0-9a-f]{17}")
# arn:<partition>:resource-groups:<region>:<account>:group/<name>
GROUP_ARN_RE = re.compile(r"arn:aws[a-z-]*:resource-groups:([a-z0-9-]+):(\d{12}):group/[A-Za-z0-9._-]{1,128}")
ZONE_RE = re.compile(r"[a-z]{2}(-[a-z]+)+-\d+[a-p]")


@dataclass(frozen=True)
class PoolOptions:
    market_type: str = "on-demand"
    interruption: str = "terminate"  # spot: what AWS does to the instance on a reclaim
    capacity_reservation: str | None = None  # cr-... or a resource group ARN
    capacity_preference: str | None = None  # open or none: whether open reservations may be used
    placement: str | None = None  # "cluster": one cluster placement group per pool
    efa: bool = False
    availability_zone: str | None = None  # all of the pool's nodes in this zone

    @property
    def spot(self) -> bool:
        return self.market_type == "spot"

    @property
    def reservation_id(self) -> str | None:
        """The reservation's id when it is one (not a group): its type and zone can then be checked."""
        return self.capacity_reservation if self.capacity_reservation and \
            RESERVATION_ID_RE.fullmatch(self.capacity_reservation) else None

    @property
    def one_zone(self) -> bool:
        """A placement group, EFA (whose traffic stays in one subnet) and a reservation each hold a pool to one zone."""
        return bool(self.placement or self.efa or self.reservation_id or self.availability_zone)


def read_pool_options(entry: dict, spot: Any, error: Callable[[str, str], None]) -> PoolOptions | None:
    """The pool's options from its config entry; None when a problem was reported.

    `spot: true` is the older spelling of `marketType: spot`, and both are read.
    """
    ok = True
    spot = boolean(spot, False, lambda m: error("spot", m))
    market = str(entry.get("marketType") or "").strip() or ("spot" if spot else "on-demand")
    if market not in MARKET_TYPES:
        error("marketType", f"{market!r} is not a market; use on-demand, spot or capacity-block "
                            "(an EC2 Capacity Block for ML, with capacityReservation)")
        return None
    if spot and market != "spot":
        error("spot", f"says spot, but marketType is {market}; remove spot (marketType: spot is the same)")
        ok = False
    interruption = str(entry.get("interruption") or "").strip()
    if interruption and market != "spot":
        error("interruption", "applies to spot nodes only; set marketType spot, or remove it")
        ok = False
    elif interruption and interruption not in INTERRUPTIONS:
        error("interruption", f"{interruption!r}: use terminate (a reclaimed node is replaced by the next "
                              "pulumi up) or stop (it resumes on the same instance and disk when AWS has capacity)")
        ok = False
    reservation = str(entry.get("capacityReservation") or "").strip() or None
    preference = str(entry.get("capacityReservationPreference") or "").strip() or None
    if reservation:
        group = GROUP_ARN_RE.fullmatch(reservation)
        if not RESERVATION_ID_RE.fullmatch(reservation) and not group:
            error("capacityReservation", f"{reservation!r} is neither a reservation id (cr- and 17 hex digits) nor a "
                                         "resource group ARN (arn:aws:resource-groups:<region>:<account>:group/<name>)")
            ok = False
        elif market == "spot":
            error("capacityReservation", "spot instances cannot run in a capacity reservation; set marketType "
                                         "on-demand to use it, or remove it")
            ok = False
        elif market == "capacity-block" and group:
            error("capacityReservation", "a capacity-block pool needs the Capacity Block's own reservation id "
                                         "(cr-...), not a resource group")
            ok = False
        if preference:
            error("capacityReservationPreference", "AWS takes either a reservation or a preference; remove one")
            ok = False
    elif market == "capacity-block":
        error("capacityReservation", "required with marketType capacity-block: the Capacity Block's reservation "
                                     "id (cr-...), from the EC2 console or aws ec2 describe-capacity-reservations")
        ok = False
    if preference and preference not in PREFERENCES:
        error("capacityReservationPreference", f"{preference!r}: use open (run in any open reservation that "
                                               "matches) or none (never use a reservation)")
        ok = False
    elif preference and market != "on-demand":
        error("capacityReservationPreference", f"applies to on-demand nodes only (this pool is {market})")
        ok = False
    placement = str(entry.get("placement") or "").strip() or None
    if placement and placement not in PLACEMENTS:
        error("placement", f"{placement!r}: use cluster (the pool's nodes close together, in one zone), "
                           "or leave it out")
        ok = False
    elif placement and market == "spot" and interruption == "stop":
        # "You can't launch a Spot Instance that is configured to stop or hibernate on interruption in a
        # placement group" (EC2 User Guide, placement group rules); RunInstances refuses it.
        error("placement", "EC2 launches no spot instance that stops on interruption in a placement group; "
                           "remove placement, or set interruption terminate (a reclaimed node is then replaced by "
                           "the next pulumi up)")
        ok = False
    efa = boolean(entry.get("efa"), False, lambda m: error("efa", m))
    zone = str(entry.get("availabilityZone") or "").strip() or None
    if zone and not ZONE_RE.fullmatch(zone):
        error("availabilityZone", f"{zone!r} is not an availability zone name such as us-east-1a")
        ok = False
    if not ok:
        return None
    return PoolOptions(market, interruption or "terminate", reservation, preference, placement, efa, zone)
