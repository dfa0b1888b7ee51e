"""AWS's prices as the fake answers them: the Price List (aws.pricing.get_product) and the spot price history
(aws.ec2.get_spot_price), in the shapes the provider returns, for localswarm/fake_aws.py's ANSWERS.

The figures are this file's own, plausible and round, not AWS's: a test asserts what the program does with
an answer, never what AWS charges. What each lookup does, as the pinned provider does it
(terraform-provider-aws): getProduct sends every filter as TERM_MATCH to GetProducts and fails unless exactly
one product matches, its `result` the product as JSON text (a Price List product: its attributes, and its
terms, On-Demand and Reserved, each with price dimensions); getSpotPrice asks DescribeSpotPriceHistory for the
price in effect now (StartTime now) and fails unless exactly one price matches, which takes a
product-description filter: each zone has a price per operating system.
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone

REGION = "us-east-1"
LOCATION = "US East (N. Virginia)"
PUBLISHED = "2026-11-14T02:05:31Z"  # the fake Price List's publicationDate
EFFECTIVE = "2026-11-01T00:00:00Z"  # when its On-Demand prices took effect
# Linux on-demand USD per instance-hour, in REGION. A type missing here has no price in the region.
ON_DEMAND = {"t3.medium": "0.0416000000", "t3.large": "0.0832000000", "m7i.large": "0.1008000000",
             "m7i.xlarge": "0.2016000000", "m7g.large": "0.0816000000", "g4dn.xlarge": "0.5260000000",
             "g4dn.12xlarge": "3.9120000000", "g5.xlarge": "1.0060000000", "g6.xlarge": "0.8048000000",
             "g6e.12xlarge": "10.4930000000", "p4d.24xlarge": "21.9600000000", "p5.48xlarge": "55.0400000000",
             "g5g.xlarge": "0.4200000000", "p3.2xlarge": "3.0600000000"}
# The Price List also has, for every type, products of the same type that are no plain on-demand hour: capacity
# reserved but unused, and (for P5) the Capacity Block market. A query without capacitystatus and marketoption
# matches several, and getProduct fails.
_VARIANTS = [("Used", "OnDemand"), ("UnusedCapacityReservation", "OnDemand"),
             ("AllocatedCapacityReservation", "OnDemand")]
_CAPACITY_BLOCK_TYPES = {"p5.48xlarge", "p4d.24xlarge"}
# (instance type, zone) -> days since its spot price was set, for a test to make one old. Every other price was
# set at the last 12-hour mark of UTC, less two hours: 2 to 14 hours ago, the same in every process that asks
# within those 12 hours. EC2 sets spot prices rarely, by long-term supply and demand (EC2 User Guide, "Spot
# Instance pricing history"), so two `pulumi` runs a minute apart read one price set at one time; a time that
# moved with each process made a node's price file change between a preview and the up after it.
SPOT_AGE_DAYS: dict[tuple[str, str], float] = {}
SPOT_SET_EVERY = timedelta(hours=12)


def spot_set_at(now: datetime | None = None) -> datetime:
    """When the spot prices in effect now were set (before SPOT_AGE_DAYS's)."""
    now = now or datetime.now(timezone.utc)
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    return epoch + (now - epoch) // SPOT_SET_EVERY * SPOT_SET_EVERY - timedelta(hours=2)


def _sku(*parts: str) -> str:
    return hashlib.sha1("/".join(parts).encode()).hexdigest()[:16].upper()


def _product(instance_type: str, capacity_status: str, market: str) -> dict:
    sku = _sku(instance_type, capacity_status, market)
    used = capacity_status == "Used" and market == "OnDemand"
    price = ON_DEMAND[instance_type] if used else "0.0000000000"
    term = f"{sku}.JRTCKXETXF"
    attributes = {
        "servicecode": "AmazonEC2", "servicename": "Amazon Elastic Compute Cloud", "productFamily": "Compute Instance",
        "instanceType": instance_type, "instanceFamily": "GPU instance" if instance_type[0] in "gp" else
        "General purpose", "regionCode": REGION, "location": LOCATION, "locationType": "AWS Region",
        "operatingSystem": "Linux", "operation": "RunInstances", "tenancy": "Shared", "preInstalledSw": "NA",
        "licenseModel": "No License required", "capacitystatus": capacity_status, "marketoption": market,
        "usagetype": f"{'BoxUsage' if used else capacity_status}:{instance_type}",
    }
    return {
        "product": {"productFamily": "Compute Instance", "attributes": attributes, "sku": sku},
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {term: {
                "priceDimensions": {f"{term}.6YS6EN2CT7": {
                    "unit": "Hrs", "endRange": "Inf", "beginRange": "0", "appliesTo": [],
                    "rateCode": f"{term}.6YS6EN2CT7",
                    "description": f"${float(price):g} per On Demand Linux {instance_type} Instance Hour",
                    "pricePerUnit": {"USD": price}}},
                "sku": sku, "effectiveDate": EFFECTIVE, "offerTermCode": "JRTCKXETXF", "termAttributes": {}}},
            "Reserved": {f"{sku}.4NA7Y494T4": {
                "priceDimensions": {f"{sku}.4NA7Y494T4.6YS6EN2CT7": {
                    "unit": "Hrs", "endRange": "Inf", "beginRange": "0", "appliesTo": [],
                    "rateCode": f"{sku}.4NA7Y494T4.6YS6EN2CT7", "description": "Linux/UNIX (Amazon VPC), 1 year",
                    "pricePerUnit": {"USD": f"{float(price) * 0.62:.10f}"}}},
                "sku": sku, "effectiveDate": EFFECTIVE, "offerTermCode": "4NA7Y494T4",
                "termAttributes": {"LeaseContractLength": "1yr", "OfferingClass": "standard",
                                   "PurchaseOption": "No Upfront"}}},
        },
        "version": PUBLISHED.replace("-", "").replace(":", "").replace("T", "")[:14],
        "publicationDate": PUBLISHED,
    }


def _products() -> list[dict]:
    out = [_product(t, status, market) for t in ON_DEMAND for status, market in _VARIANTS]
    return out + [_product(t, "Used", "CapacityBlock") for t in ON_DEMAND if t in _CAPACITY_BLOCK_TYPES]


def product(a: dict) -> dict:
    """aws.pricing.get_product: the one product every filter matches (TERM_MATCH), as the provider answers."""
    if a.get("serviceCode") != "AmazonEC2":
        raise Exception(f"reading Pricing Products: no fake AWS answer for service {a.get('serviceCode')}")
    filters = {f["field"]: f["value"] for f in a.get("filters") or []}
    found = [p for p in _products() if all(p["product"]["attributes"].get(k) == v for k, v in filters.items())]
    if not found:
        raise Exception("Pricing product query did not return any elements")
    if len(found) > 1:
        raise Exception(f"Pricing product query not precise enough. Returned {len(found)} elements")
    return {"id": _sku(json.dumps(filters, sort_keys=True)), "serviceCode": "AmazonEC2",
            "filters": a.get("filters"), "result": json.dumps(found[0])}


def spot_price(a: dict, offered: dict[str, set[str]], zones: tuple[str, ...]) -> dict:
    """aws.ec2.get_spot_price: the Linux/UNIX price in effect now in one zone; offered: the zones of each type
    that EC2 offers it in (fake_aws's OFFERED_IN, every zone otherwise)."""
    instance_type, zone = a.get("instanceType") or "", a.get("availabilityZone") or ""
    descriptions = next((f["values"] for f in a.get("filters") or [] if f["name"] == "product-description"), None)
    if instance_type not in ON_DEMAND or zone not in offered.get(instance_type, zones):
        raise Exception("no EC2 Spot Price History found matching criteria; try different search")
    if descriptions != ["Linux/UNIX"]:  # the history has a price per operating system
        raise Exception("multiple EC2 Spot Price History results found matching criteria; try different search")
    # A third to a half of on-demand, different in each zone.
    share = 0.3 + int(hashlib.sha1(zone.encode()).hexdigest(), 16) % 20 / 100
    set_at = spot_set_at() - timedelta(days=SPOT_AGE_DAYS.get((instance_type, zone), 0))
    return {"id": REGION, "instanceType": instance_type, "availabilityZone": zone, "filters": a.get("filters"),
            "spotPrice": f"{float(ON_DEMAND[instance_type]) * share:.6f}",
            "spotPriceTimestamp": set_at.strftime("%Y-%m-%dT%H:%M:%SZ")}
