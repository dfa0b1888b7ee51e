"""What the cluster costs per hour, as AWS lists its prices: read at preview, printed, exported, and given to nodes.

Each pool's instances and the managers are priced on their market: on-demand from the AWS Price List
(Linux, shared tenancy, no licensed software), spot from the spot price history of each zone the pool's
nodes go to, an On-Demand Capacity Reservation at the on-demand price (AWS bills a reservation at it,
used or not), and a Capacity Block not at all: it was paid when it was bought, and nothing the program can
read says what it cost. Every price carries its date, and a spot price set more than a day before the
preview is marked. An instance type the Price List has no price for in the region is named, never priced
at 0. Prices are AWS's list prices in USD: no tax, no Savings Plans, Reserved Instances or credits.
Credentials that may not read prices (or no route to AWS) get one warning per kind of price, and the
preview goes on without them. docs/operations/cost.md says what is and is not counted.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pulumi
import pulumi_aws as aws

from settings import GpuPool, Settings, aws_lookups

STALE_AFTER = timedelta(days=1)
# A Price List product is a whole offer: the filters name the one for a Linux instance-hour on demand.
ON_DEMAND_FILTERS = {"operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
                     "licenseModel": "No License required", "capacitystatus": "Used", "marketoption": "OnDemand",
                     "operation": "RunInstances"}
BLOCK_PRICE = ("not known: a Capacity Block is paid when it is bought, and AWS's reservation does not say "
               "what it cost")


@dataclass(frozen=True)
class Price:
    per_hour: float | None  # USD per instance-hour; None: not known, and `why` says why
    date: str = ""  # RFC 3339: when AWS set it (a Price List term's effectiveDate, a spot price's timestamp)
    source: str = ""  # "Price List" or "spot price history"
    why: str = ""
    stale: bool = False  # a spot price set more than STALE_AFTER before the preview


@dataclass(frozen=True)
class Part:
    """Some of a pool's nodes and what each costs: a spot pool has one part per zone, any other pool one."""

    zone: str  # "" when the price is the region's
    nodes: int
    price: Price


@dataclass(frozen=True)
class PoolCost:
    pool: str
    instance_type: str
    market: str  # on-demand, spot, reserved or capacity-block
    reservation: str  # the reservation (or its group) or Capacity Block the nodes run in; "" for none
    parts: tuple[Part, ...]  # an elastic pool's: at its min
    at_max: "PoolCost | None" = None  # an elastic pool at its max (autoscale); None for a pool of a count

    @property
    def nodes(self) -> int:
        return sum(p.nodes for p in self.parts)

    @property
    def per_hour(self) -> float | None:
        """What its nodes cost together; None when a price of a part with nodes is not known."""
        if any(p.price.per_hour is None for p in self.parts if p.nodes):
            return None
        return sum(p.nodes * (p.price.per_hour or 0) for p in self.parts)


class PriceReader:
    """The two lookups, each price asked once, and each kind until it fails for a reason other than "no price":
    then warned once, and not asked again."""

    def __init__(self, region: str, provider: pulumi.ProviderResource | None):
        self.region, self.provider = region, provider
        self.unread: dict[str, str] = {}  # kind -> why its prices could not be read
        self.now = datetime.now(timezone.utc)
        self.read: dict[tuple[str, str], Price] = {}  # (instance type, zone or "") -> its price

    def on_demand(self, instance_type: str) -> Price:
        if (instance_type, "") not in self.read:
            self.read[(instance_type, "")] = self._on_demand(instance_type)
        return self.read[(instance_type, "")]

    def spot(self, instance_type: str, zone: str) -> Price:
        if (instance_type, zone) not in self.read:
            self.read[(instance_type, zone)] = self._spot(instance_type, zone)
        return self.read[(instance_type, zone)]

    def _cannot_read(self, kind: str, action: str, exc: Exception) -> str:
        why = f"{kind} prices not read: {exc}"
        if kind not in self.unread:  # once: the other lookups of this kind are not asked
            pulumi.log.warn(f"{why}; the cost table goes without them" + (
                "" if isinstance(exc, aws_lookups.PermissionMissing) else
                f", and the preview goes on. {action} is asked of AWS's API: check this machine reaches it"))
        self.unread[kind] = why
        return why

    def _on_demand(self, instance_type: str) -> Price:
        if "on-demand" in self.unread:
            return Price(None, why=self.unread["on-demand"])
        try:
            text = aws_lookups.price_list_product({"instanceType": instance_type, "regionCode": self.region,
                                                   **ON_DEMAND_FILTERS}, self.provider)
        except aws_lookups.NoPrice:
            return Price(None, why=f"the Price List has no Linux on-demand price for {instance_type} in {self.region}")
        except (aws_lookups.PermissionMissing, LookupError) as exc:
            return Price(None, why=self._cannot_read("on-demand", "pricing:GetProducts", exc))
        return on_demand_price(text, instance_type)

    def _spot(self, instance_type: str, zone: str) -> Price:
        if "spot" in self.unread:
            return Price(None, why=self.unread["spot"])
        try:
            price, when = aws_lookups.spot_price(instance_type, zone)
        except aws_lookups.NoPrice:
            return Price(None, why=f"the spot price history has no Linux price for {instance_type} in {zone}")
        except (aws_lookups.PermissionMissing, LookupError) as exc:
            return Price(None, why=self._cannot_read("spot", "ec2:DescribeSpotPriceHistory", exc))
        try:
            set_at = datetime.fromisoformat(when.replace("Z", "+00:00"))
            stale = self.now - set_at > STALE_AFTER
            return Price(float(price), when, "spot price history", stale=stale)
        except (TypeError, ValueError):
            return Price(None, why=f"the spot price history answered {price!r} at {when!r} for {instance_type} "
                                   f"in {zone}, which is no price")


def on_demand_price(text: str, instance_type: str) -> Price:
    """The USD per hour of a Price List product's one On-Demand term, with its effective date."""
    try:
        product = json.loads(text)
        terms = list((product.get("terms") or {}).get("OnDemand", {}).values())
        hourly = [(d["pricePerUnit"].get("USD"), term.get("effectiveDate", ""))
                  for term in terms for d in (term.get("priceDimensions") or {}).values() if d.get("unit") == "Hrs"]
        if len(hourly) == 1 and float(hourly[0][0]) > 0:
            return Price(float(hourly[0][0]), hourly[0][1], "Price List")
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return Price(None, why=f"the Price List's product for {instance_type} has no one hourly USD price")


def node_zone(pool: GpuPool, cluster_zones: tuple[str, ...], index: int) -> str:
    """The zone of the pool's node `index`: its subnets go round-robin over the pool's zones (components/
    node_pool.py). A running node keeps its subnet when availabilityZones changes, and is then priced as the
    node of that index would be now."""
    zones = pool.zones or cluster_zones
    return zones[index % len(zones)]


def pool_cost(pool: GpuPool, cluster_zones: tuple[str, ...], prices: PriceReader) -> PoolCost:
    """A pool's cost with its count of nodes; an elastic pool's at its min, and at its max beside it."""
    if pool.autoscale:
        at_min = _pool_cost(pool, cluster_zones, prices, pool.autoscale.min)
        return dataclasses.replace(at_min, at_max=_pool_cost(pool, cluster_zones, prices, pool.autoscale.max))
    return _pool_cost(pool, cluster_zones, prices, pool.count)


def _pool_cost(pool: GpuPool, cluster_zones: tuple[str, ...], prices: PriceReader, count: int) -> PoolCost:
    o = pool.options
    if o.market_type == "capacity-block":
        return PoolCost(pool.name, pool.instance_type, "capacity-block", o.capacity_reservation or "",
                        (Part("", count, Price(None, why=BLOCK_PRICE)),))
    if o.spot:
        placed = [node_zone(pool, cluster_zones, i) for i in range(count)]
        zones = pool.zones or cluster_zones
        return PoolCost(pool.name, pool.instance_type, "spot", "",
                        tuple(Part(z, placed.count(z), prices.spot(pool.instance_type, z)) for z in zones))
    market = "reserved" if o.capacity_reservation else "on-demand"
    return PoolCost(pool.name, pool.instance_type, market, o.capacity_reservation or "",
                    (Part("", count, prices.on_demand(pool.instance_type)),))


def price_list_provider(name: str, region: str, parent: pulumi.Resource) -> aws.Provider | None:
    """A provider in us-east-1 for the Price List, whose API answers in a few regions only (each with every
    region's prices); None when the stack's own region is one. An explicit provider takes none of the stack's
    aws: settings: it gets the profile and shared files, and other credentials from the environment."""
    if region in aws_lookups.PRICE_LIST_REGIONS:
        return None
    files = {key: json.loads(value) for key, value in (
        ("shared_config_files", aws.config.shared_config_files),
        ("shared_credentials_files", aws.config.shared_credentials_files)) if value}
    return aws.Provider(f"{name}-price-list", region=aws_lookups.PRICE_LIST_REGIONS[0], profile=aws.config.profile,
                        **files, opts=pulumi.ResourceOptions(parent=parent))


@dataclass(frozen=True)
class ClusterCost:
    cluster: str
    region: str
    pools: tuple[PoolCost, ...]  # the managers first
    prices: PriceReader | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def per_hour(self) -> float:
        """What the priced pools cost together (elastic pools at their min): see unpriced() for the others."""
        return sum(p.per_hour or 0 for p in self.pools)

    @property
    def per_hour_at_max(self) -> float:
        """The same with every elastic pool at its max."""
        return sum((p.at_max or p).per_hour or 0 for p in self.pools)

    def unpriced(self) -> list[str]:
        return [f"{p.pool} ({p.instance_type}): {why}" for p in self.pools for why in
                dict.fromkeys(part.price.why for part in (p.at_max or p).parts + p.parts
                              if part.nodes and part.price.per_hour is None)]

    def node_price(self, pool: str, zone: str = "") -> tuple[PoolCost, Price]:
        """A node's price: its pool's, and for spot its zone's."""
        cost = next(p for p in self.pools if p.pool == pool)
        if cost.market != "spot":
            return cost, cost.parts[0].price
        part = next((p for p in cost.parts if p.zone == zone), None)
        return cost, part.price if part else Price(None, why=f"{zone} is none of pool {pool}'s zones now")

    def launched_prices(self, pool: GpuPool, zone: str) -> dict[str, tuple[str, Price]]:
        """A node's market and price by the instance's lifecycle ("spot", "capacity-block" or "" for on demand,
        as DescribeInstances reports it): a running node keeps the market it was launched on when its pool's
        marketType changes (components/provider_facts.py), and is priced on it. Read now, for the node's
        price to follow its instance's output: a spot pool's node launched on demand costs the Price List's
        price (read for the managers anyway); an on-demand pool's node launched as spot is not priced (its
        spot price is not read for a pool that has no spot nodes otherwise, and asks another permission)."""
        cost, price = self.node_price(pool.name, zone if pool.spot else "")
        by = {"": (cost.market, price), "spot": (cost.market, price), "capacity-block": (cost.market, price)}
        if cost.market == "spot" and self.prices:
            by[""] = ("on-demand", self.prices.on_demand(pool.instance_type))
        elif cost.market != "spot":
            by["spot"] = ("spot", Price(None, why=f"launched as spot before pool {pool.name}'s marketType changed; "
                                                 "an on-demand pool's spot price is not read"))
        if cost.market != "capacity-block":
            by["capacity-block"] = ("capacity-block", Price(None, why=BLOCK_PRICE))
        return by

    def table(self) -> list[str]:
        return render_table(self)

    def output(self) -> dict:
        """The stack output `cost`: the same figures as the table, and the table itself, a line each."""
        return {
            "currency": "USD", "region": self.region, "perHour": round(self.per_hour, 4),
            "complete": not self.unpriced(),
            **({"perHourAtMax": round(self.per_hour_at_max, 4)} if any(p.at_max for p in self.pools) else {}),
            "pools": [{"pool": p.pool, "instanceType": p.instance_type, "market": p.market, "nodes": p.nodes,
                       **({"reservation": p.reservation} if p.reservation else {}),
                       "perHour": None if p.per_hour is None else round(p.per_hour, 4),
                       "prices": [{**({"zone": part.zone} if part.zone else {}), "nodes": part.nodes,
                                   "perNodeHour": part.price.per_hour, "date": part.price.date or None,
                                   "source": part.price.source or None,
                                   **({"olderThanADay": True} if part.price.stale else {}),
                                   **({"notKnown": part.price.why} if part.price.per_hour is None else {})}
                                  for part in p.parts],
                       **({"elastic": {"min": p.nodes, "max": p.at_max.nodes, "perHourAtMin": _rounded(p.per_hour),
                                       "perHourAtMax": _rounded(p.at_max.per_hour)}} if p.at_max else {})}
                      for p in self.pools],
            "notPriced": self.unpriced(),
            "table": self.table(),
        }


def cluster_cost(s: Settings, region: str, provider: pulumi.ProviderResource | None = None) -> ClusterCost:
    """Read the prices of every pool and the managers (synchronous lookups: the preview prints them)."""
    prices = PriceReader(region, provider)
    managers = PoolCost("managers", s.managers.instance_type, "on-demand", "",
                        (Part("", s.managers.count, prices.on_demand(s.managers.instance_type)),))
    zones = tuple(s.network.availability_zones)
    return ClusterCost(s.cluster_name, region, (managers, *(pool_cost(p, zones, prices) for p in s.gpu_pools)),
                       prices)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.4f}"


def _date(price: Price) -> str:
    if not price.date:
        return ""
    shown = price.date[:10] if price.source == "Price List" else price.date.replace("T", " ")[:16] + " UTC"
    return f"{shown} ({price.source}{', over a day old' if price.stale else ''})"


def render_table(cost: ClusterCost) -> list[str]:
    """The preview's table, in the manner of SkyPilot's: one row per pool (per zone of a spot pool)."""
    header = ("POOL", "NODES", "INSTANCE", "MARKET", "ZONE", "$/NODE-HOUR", "$/HOUR", "PRICE DATED")
    rows = [header]
    for p in cost.pools:
        market = f"{p.market} {p.reservation}".strip()
        for i, part in enumerate(p.parts):
            first = i == 0
            each = part.nodes * part.price.per_hour if part.price.per_hour is not None else None
            rows.append((p.pool if first else "", str(part.nodes), p.instance_type if first else "",
                         market if first else "", part.zone or "(region)", _money(part.price.per_hour),
                         _money(each) if part.nodes else "0", _date(part.price) or "not known"))
        if p.at_max:  # elastic: the rows above are its min; this is its max
            rows.append(("", f"max {p.at_max.nodes}", "", "autoscale", "", "", _money(p.at_max.per_hour),
                         f"at its max (min {p.nodes})"))
    unpriced = cost.unpriced()
    rows.append(("TOTAL", str(sum(p.nodes for p in cost.pools)), "", "", "", "", _money(cost.per_hour),
                 "without the pools not priced below" if unpriced else ""))
    if any(p.at_max for p in cost.pools):
        rows.append(("AT MAX", str(sum((p.at_max or p).nodes for p in cost.pools)), "", "", "", "",
                     _money(cost.per_hour_at_max), "every elastic pool at its max"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"{cost.cluster} in {cost.region}: what its instances cost per hour, in USD at AWS's list prices "
             "(no tax, Savings Plans, Reserved Instances or credits)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"not priced: {why}" for why in unpriced]
    if any(p.market == "reserved" for p in cost.pools):
        lines.append("reserved: a capacity reservation is billed at the on-demand price whether instances run in it "
                     "or not; its unused instances are not in this table")
    return lines
