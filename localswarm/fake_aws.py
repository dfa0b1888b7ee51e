"""AWS as the Pulumi mocks see it: the answers of the data sources the program asks, and what AWS fills in.

One catalogue for the unit tests (tests/conftest.py) and the rehearsal's `localswarm pulumi up`
(localswarm/pulumi_cli.py). A lookup that AWS would refuse raises, with the provider's words,
as a failing invoke does; nothing here is reached over a network. What the program made in
an earlier run (its subnets, its instances and their state) is an Account (localswarm/fake_account.py):
the plural lookups answer from it, as AWS answers a second `pulumi up` from what the first one made.
"""
from __future__ import annotations

import hashlib
import json

from localswarm.fake_account import (  # noqa: F401 (the account's model, where the tests and the rehearsal find it)
    ACCOUNT, ACCOUNT_ID, Account, AwsError, allocate_address, associate_address, check_tags, launch, launch_template,
    provider_delete, provider_read, put_object, request_spot, reset_account, ssm_parameter, tag)
from components import operator_policy
from localswarm import fake_prices
from settings import aws_lookups

REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f")

# instance type -> (architecture, [(manufacturer, model, count)])
INSTANCE_TYPES = {
    "t3.medium": ("x86_64", []),
    "t3.large": ("x86_64", []),
    "m7i.large": ("x86_64", []),
    "m7i.xlarge": ("x86_64", []),
    "m7g.large": ("arm64", []),
    "g4dn.xlarge": ("x86_64", [("NVIDIA", "T4", 1)]),
    "g4dn.12xlarge": ("x86_64", [("NVIDIA", "T4", 4)]),
    "g5.xlarge": ("x86_64", [("NVIDIA", "A10G", 1)]),
    "g6.xlarge": ("x86_64", [("NVIDIA", "L4", 1)]),
    "g6e.12xlarge": ("x86_64", [("NVIDIA", "L40S", 4)]),
    "p4d.24xlarge": ("x86_64", [("NVIDIA", "A100", 8)]),
    "p5.48xlarge": ("x86_64", [("NVIDIA", "H100", 8)]),
    "g5g.xlarge": ("arm64", [("NVIDIA", "T4g", 1)]),
    "g4ad.xlarge": ("x86_64", [("AMD", "Radeon Pro V520", 1)]),
    "p3.2xlarge": ("x86_64", [("NVIDIA", "V100", 1)]),
}
# vCPUs per instance (DescribeInstanceTypes' DefaultVCpus): the unit of EC2's instance quotas.
VCPUS = {"t3.medium": 2, "t3.large": 2, "m7i.large": 2, "m7i.xlarge": 4, "m7g.large": 2, "g4dn.xlarge": 4,
         "g4dn.12xlarge": 48, "g5.xlarge": 4, "g6.xlarge": 4, "g6e.12xlarge": 48, "p4d.24xlarge": 96,
         "p5.48xlarge": 192, "g5g.xlarge": 4, "g4ad.xlarge": 4, "p3.2xlarge": 8}
GPU_MEMORY_MIB = {"T4": 15360, "A10G": 23028, "L4": 23034, "L40S": 46068, "A100": 40960, "H100": 81559, "T4g": 15360, "V100": 16384}
# EFA: instance type -> (efa_maximum_interfaces, maximum_network_cards), for the types that have it.
EFA = {"p5.48xlarge": (32, 32), "p4d.24xlarge": (4, 4), "g6e.12xlarge": (1, 1), "g4dn.12xlarge": (1, 1)}
# Where a type is offered, when not in every zone.
OFFERED_IN = {"p5.48xlarge": {"us-east-1a", "us-east-1c"}, "p4d.24xlarge": {"us-east-1b"}}
UBUNTU_AMI = "ami-0a1b2c3d4e5f60718"
DEEP_LEARNING_AMI = "ami-0d1e2a3b4c5d6e7f8"
CUSTOM_AMI = "ami-0123456789abcdef0"
CUSTOM_AMI_NEXT = "ami-0123456789abcdef1"
ARM_AMI = "ami-0fedcba9876543210"
AMIS = {UBUNTU_AMI: ("x86_64", 8), DEEP_LEARNING_AMI: ("x86_64", 75), CUSTOM_AMI: ("x86_64", 30),
        CUSTOM_AMI_NEXT: ("x86_64", 30), ARM_AMI: ("arm64", 8)}
VPC = "vpc-0abc1234def567890"
OTHER_VPC = "vpc-0fff0000fff000011"
VPC_CIDRS = {VPC: ("10.0.0.0/16", "10.1.0.0/16"), OTHER_VPC: ("10.200.0.0/16",)}
SUBNETS = {
    "subnet-0aaaaaaaaaaaaaaaa": (VPC, "us-east-1a"),
    "subnet-0cccccccccccccccc": (VPC, "us-east-1c"),
    "subnet-0bbbbbbbbbbbbbbbb": (VPC, "us-east-1b"),
    "subnet-0eeeeeeeeeeeeeeee": (OTHER_VPC, "us-east-1e"),
}
# Subnets with a route table of their own; the others use their VPC's main table.
SUBNET_ROUTE_TABLES = {"subnet-0aaaaaaaaaaaaaaaa": "rtb-0aaaaaaaaaaaaaaaa"}
MAIN_ROUTE_TABLES = {VPC: "rtb-0main000000000001", OTHER_VPC: "rtb-0main000000000002"}
# The S3 gateway endpoints VPCs already have: (id, route tables).
S3_ENDPOINTS = {VPC: ("vpce-0abc0000000000001", ("rtb-0aaaaaaaaaaaaaaaa",))}


# Capacity reservations (DescribeCapacityReservations), as aws.ec2.CapacityReservation.get reads them.
RESERVATION = "cr-0a5a0000000000001"  # On-Demand, p5.48xlarge in us-east-1a
BLOCK_RESERVATION = "cr-0b10c000000000002"  # a Capacity Block, p5.48xlarge in us-east-1c
EXPIRED_RESERVATION = "cr-0e0000000000000e1"  # On-Demand, ended at its end date
SCHEDULED_BLOCK = "cr-0b10c000000000003"  # a Capacity Block bought for later
EXPIRED_BLOCK = "cr-0b10c000000000004"  # a Capacity Block whose time is over
BLOCK_START = "2026-12-01T11:30:00Z"
RESERVATIONS = {
    RESERVATION: {"instanceType": "p5.48xlarge", "availabilityZone": "us-east-1a", "instanceCount": 2,
                  "instanceMatchCriteria": "targeted", "endDateType": "unlimited", "placementGroupArn": "",
                  "state": "active", "reservationType": "default"},
    BLOCK_RESERVATION: {"instanceType": "p5.48xlarge", "availabilityZone": "us-east-1c", "instanceCount": 2,
                        "instanceMatchCriteria": "targeted", "endDateType": "limited", "placementGroupArn": "",
                        "state": "active", "reservationType": "capacity-block", "startDate": "2026-11-20T11:30:00Z",
                        "endDate": "2026-12-04T11:30:00Z"},
    "cr-0d0000000000000d1": {"instanceType": "g6e.12xlarge", "availabilityZone": "us-east-1d", "instanceCount": 1,
                             "instanceMatchCriteria": "open", "endDateType": "unlimited", "placementGroupArn": "",
                             "state": "active", "reservationType": "default"},
    EXPIRED_RESERVATION: {"instanceType": "p5.48xlarge", "availabilityZone": "us-east-1a", "instanceCount": 2,
                          "instanceMatchCriteria": "targeted", "endDateType": "limited", "placementGroupArn": "",
                          "state": "expired", "reservationType": "default", "endDate": "2026-11-01T00:00:00Z"},
    SCHEDULED_BLOCK: {"instanceType": "p5.48xlarge", "availabilityZone": "us-east-1c", "instanceCount": 2,
                      "instanceMatchCriteria": "targeted", "endDateType": "limited", "placementGroupArn": "",
                      "state": "scheduled", "reservationType": "capacity-block", "startDate": BLOCK_START,
                      "endDate": "2026-12-08T11:30:00Z"},
    EXPIRED_BLOCK: {"instanceType": "p5.48xlarge", "availabilityZone": "us-east-1c", "instanceCount": 2,
                    "instanceMatchCriteria": "targeted", "endDateType": "limited", "placementGroupArn": "",
                    "state": "expired", "reservationType": "capacity-block", "startDate": "2026-11-01T11:30:00Z",
                    "endDate": "2026-11-08T11:30:00Z"},
}
# Service Quotas (GetServiceQuota, service ec2): a generous account unless a test sets ACCOUNT.quotas.
DEFAULT_QUOTA = 5000.0
QUOTA_NAMES = {"L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
               "L-DB2E81BA": "Running On-Demand G and VT instances", "L-417A185B": "Running On-Demand P instances",
               "L-34B43A08": "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
               "L-3819A6DF": "All G and VT Spot Instance Requests",
               "L-7212CCBC": "All P4, P3 and P2 Spot Instance Requests", "L-C4BD4855": "All P5 Spot Instance Requests",
               "L-0263D0A3": "EC2-VPC Elastic IPs"}


def _instance_type(a: dict) -> dict:
    if a["instanceType"] not in INSTANCE_TYPES:
        raise Exception("InvalidInstanceType: The following supplied instance types do not exist")
    arch, gpus = INSTANCE_TYPES[a["instanceType"]]
    efa, cards = EFA.get(a["instanceType"], (0, 1))
    return {"instanceType": a["instanceType"], "supportedArchitectures": [arch],
            "defaultVcpus": VCPUS[a["instanceType"]],
            "gpuses": [{"manufacturer": m, "name": n, "count": c, "memorySize": GPU_MEMORY_MIB.get(n, 24576)}
                       for m, n, c in gpus],
            "efaSupported": bool(efa), "efaMaximumInterfaces": efa, "maximumNetworkCards": cards,
            "networkCards": [{"index": i, "maximumInterfaces": 2, "baselineBandwidth": 100.0, "peakBandwidth": 100.0,
                              "performance": "100 Gigabit"} for i in range(cards)]}


def _offerings(a: dict) -> dict:
    wanted = a["filters"][0]["values"]
    pairs = [(t, z) for t in wanted if t in INSTANCE_TYPES for z in sorted(OFFERED_IN.get(t, ZONES))]
    return {"instanceTypes": [t for t, _ in pairs], "locations": [z for _, z in pairs],
            "locationTypes": ["availability-zone"] * len(pairs)}


# The public "latest" parameters and the image each names today (a rehearsal moves them: localswarm/aws_moves.py).
LATEST = {aws_lookups.UBUNTU_AMI_PARAMETER: UBUNTU_AMI, aws_lookups.DEEP_LEARNING_AMI_PARAMETER: DEEP_LEARNING_AMI}


def _ssm(a: dict) -> dict:
    if a["name"] not in LATEST:
        raise Exception(f"ParameterNotFound: {a['name']}")
    ami = LATEST[a["name"]]
    return {"name": a["name"], "type": "String", "value": ami, "insecureValue": ami}


def _ami(a: dict) -> dict:
    ami = a["filters"][0]["values"][0]
    if ami not in AMIS:
        raise Exception("Your query returned no results. Please change your search criteria and try again.")
    arch, size = AMIS[ami]
    return {"id": ami, "architecture": arch, "rootDeviceName": "/dev/sda1",
            "blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"volume_size": str(size)}}]}


def _vpc(a: dict) -> dict:
    if a["id"] not in VPC_CIDRS:
        raise Exception(f"no matching EC2 VPC found: {a['id']}")
    return {"id": a["id"], "cidrBlock": VPC_CIDRS[a["id"]][0],
            "cidrBlockAssociations": [{"cidrBlock": c, "associationId": f"a-{i}", "state": "associated"}
                                      for i, c in enumerate(VPC_CIDRS[a["id"]])]}


def _subnet(a: dict) -> dict:
    if a["id"] in ACCOUNT.subnets:
        made = ACCOUNT.subnets[a["id"]]
        return {"id": a["id"], "vpcId": made["vpcId"], "availabilityZone": made["availabilityZone"]}
    if a["id"] not in SUBNETS:
        raise Exception(f"no matching EC2 Subnet found: {a['id']}")
    vpc, zone = SUBNETS[a["id"]]
    return {"id": a["id"], "vpcId": vpc, "availabilityZone": zone}


def _tag_filters(a: dict) -> dict[str, list[str]]:
    wanted = {f"tag:{k}": [v] for k, v in (a.get("tags") or a.get("instanceTags") or {}).items()}
    wanted.update({f["name"]: f["values"] for f in a.get("filters") or []})
    return wanted


def _matches(tags: dict, wanted: dict[str, list[str]]) -> bool:
    return all(tags.get(name[4:]) in values for name, values in wanted.items() if name.startswith("tag:"))


def _subnets(a: dict) -> dict:
    """aws.ec2.get_subnets: an empty list when nothing matches, as the provider answers."""
    wanted = _tag_filters(a)
    ids = [i for i, s in ACCOUNT.subnets.items() if _matches(s["tags"], wanted)]
    return {"id": REGION, "ids": ids}


def _instances(a: dict) -> dict:
    """aws.ec2.get_instances: ids and addresses of the matching instances in the wanted states; empty lists if none."""
    wanted, states = _tag_filters(a), a.get("instanceStateNames") or ["running"]
    found = [(i, inst) for i, inst in ACCOUNT.instances.items()
             if inst["state"] in states and _matches(inst["tags"], wanted)]
    return {"id": REGION, "ids": [i for i, _ in found], "privateIps": [inst["privateIp"] for _, inst in found],
            "publicIps": [inst.get("publicIp") or "" for _, inst in found], "ipv6Addresses": []}


# What the resource aws.ec2.CapacityReservation reads: its schema has no state, type or start date.
_RESERVATION_READ = ("instanceType", "availabilityZone", "instanceCount", "instanceMatchCriteria", "endDateType",
                     "placementGroupArn")


def capacity_reservation_state(reservation_id: str) -> dict:
    """What aws.ec2.CapacityReservation.get reads; raises as the provider does for an id it cannot find.

    The provider's read counts a cancelled or expired reservation as gone (terraform-provider-aws
    findCapacityReservationByID: NotFound for those states), so reading one fails as an unknown id does."""
    found = RESERVATIONS.get(reservation_id)
    if not found or found["state"] in ("cancelled", "expired"):
        raise Exception(f"reading EC2 Capacity Reservation ({reservation_id}): couldn't find resource")
    return {**{k: found[k] for k in _RESERVATION_READ}, "id": reservation_id, "instancePlatform": "Linux/UNIX",
            "tenancy": "default", "ownerId": ACCOUNT_ID,
            "arn": f"arn:aws:ec2:{REGION}:{ACCOUNT_ID}:capacity-reservation/{reservation_id}"}


def _capacity_block(a: dict) -> dict:
    """aws.ec2.get_capacity_block_reservation: Capacity Blocks only, in every state DescribeCapacityReservations shows."""
    found = RESERVATIONS.get(a.get("id") or "")
    if not found or found["reservationType"] != "capacity-block":
        raise Exception("reading EC2 Capacity Block Reservation: empty result")
    return {**found, "id": a["id"], "capacityBlockId": f"cb-{a['id'][3:]}", "ownerId": ACCOUNT_ID,
            "arn": f"arn:aws:ec2:{REGION}:{ACCOUNT_ID}:capacity-reservation/{a['id']}"}


def _cloudcontrol(a: dict) -> dict:
    """aws.cloudcontrol.get_resource for AWS::EC2::CapacityReservation: its properties as JSON. A read of a
    reservation that has ended answers as the provider's does (not found): Cloud Control's read follows
    CloudFormation's contract, where a deleted resource is NotFound."""
    if a.get("typeName") != "AWS::EC2::CapacityReservation":
        raise Exception(f"no fake AWS answer for Cloud Control type {a.get('typeName')}")
    found = RESERVATIONS.get(a.get("identifier") or "")
    if not found or found["state"] in ("cancelled", "expired"):
        raise Exception(f"reading Cloud Control API (AWS::EC2::CapacityReservation) resource "
                        f"({a.get('identifier')}): ResourceNotFoundException: Resource of type "
                        f"'AWS::EC2::CapacityReservation' with identifier '{a.get('identifier')}' was not found.")
    props = {"Id": a["identifier"], "InstanceType": found["instanceType"], "AvailabilityZone": found["availabilityZone"],
             "InstanceCount": found["instanceCount"], "TotalInstanceCount": found["instanceCount"],
             "InstancePlatform": "Linux/UNIX", "Tenancy": "default", "EndDateType": found["endDateType"],
             "InstanceMatchCriteria": found["instanceMatchCriteria"]}
    return {"id": a["identifier"], "typeName": a["typeName"], "identifier": a["identifier"],
            "properties": json.dumps(props)}


def _service_quota(a: dict) -> dict:
    """aws.servicequotas.get_service_quota by code; AccessDenied when the credentials may not read quotas."""
    code = a.get("quotaCode")
    if a.get("serviceCode") != "ec2" or code not in QUOTA_NAMES:
        raise Exception(f"reading Service Quotas Service Quota ({a.get('serviceCode')}/{code}): NoSuchResourceException")
    value = float(ACCOUNT.quotas.get(code, DEFAULT_QUOTA))
    return {"id": f"{a['serviceCode']}/{code}", "quotaCode": code, "quotaName": QUOTA_NAMES[code],
            "serviceCode": "ec2", "serviceName": "Amazon Elastic Compute Cloud (Amazon EC2)", "value": value,
            "defaultValue": value, "adjustable": True, "globalQuota": False, "region": REGION, "usageMetrics": [],
            "arn": f"arn:aws:servicequotas:{REGION}:{ACCOUNT_ID}:ec2/{code}"}


def _route_tables(a: dict) -> dict:
    filters = {f["name"]: f["values"] for f in a.get("filters") or []}
    if "association.subnet-id" in filters:
        ids = [SUBNET_ROUTE_TABLES[s] for s in filters["association.subnet-id"] if s in SUBNET_ROUTE_TABLES]
    elif filters.get("association.main") == ["true"]:
        ids = [MAIN_ROUTE_TABLES[a["vpcId"]]] if a.get("vpcId") in MAIN_ROUTE_TABLES else []
    else:
        ids = sorted({*SUBNET_ROUTE_TABLES.values(), *MAIN_ROUTE_TABLES.values()})
    return {"id": a.get("vpcId") or "us-east-1", "ids": ids}


def _vpc_endpoint(a: dict) -> dict:
    found = next(((vpc, e) for vpc, e in S3_ENDPOINTS.items() if e[0] == a.get("id")), None)
    if not found:
        raise Exception("no matching EC2 VPC Endpoint found")
    vpc, (endpoint, tables) = found
    return {"id": endpoint, "vpcId": vpc, "serviceName": f"com.amazonaws.{REGION}.s3", "vpcEndpointType": "Gateway",
            "routeTableIds": list(tables), "state": "available"}


ANSWERS = {
    "aws:ec2/getInstanceType:getInstanceType": _instance_type,
    "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings": _offerings,
    "aws:index/getAvailabilityZones:getAvailabilityZones": lambda a: {
        "names": list(ZONES), "zoneIds": [f"use1-az{i}" for i in range(len(ZONES))]},
    "aws:ssm/getParameter:getParameter": _ssm,
    "aws:ec2/getAmi:getAmi": _ami,
    "aws:ec2/getVpc:getVpc": _vpc,
    "aws:ec2/getSubnet:getSubnet": _subnet,
    "aws:ec2/getSubnets:getSubnets": _subnets,
    "aws:ec2/getInstances:getInstances": _instances,
    "aws:ec2/getRouteTables:getRouteTables": _route_tables,
    "aws:ec2/getVpcEndpoint:getVpcEndpoint": _vpc_endpoint,
    "aws:ec2/getCapacityBlockReservation:getCapacityBlockReservation": _capacity_block,
    "aws:cloudcontrol/getResource:getResource": _cloudcontrol,
    "aws:servicequotas/getServiceQuota:getServiceQuota": _service_quota,
    "aws:pricing/getProduct:getProduct": fake_prices.product,
    "aws:ec2/getSpotPrice:getSpotPrice": lambda a: fake_prices.spot_price(a, OFFERED_IN, ZONES),
}


def answer(token: str, args: dict) -> dict:
    """What the data source `token` returns for `args`; raises as the provider does, AccessDenied in IAM's words
    when the account denies an action it calls (components/operator_policy.py's LOOKUPS)."""
    if token not in ANSWERS:
        raise Exception(f"no fake AWS answer for {token}")
    for action in operator_policy.LOOKUPS.get(token, ()):
        service, name = action.split(":")
        ACCOUNT.require(action, f"reading {token.split(':')[-1]}: operation error {service}: {name}, https response "
                                "error StatusCode: 403")
    return ANSWERS[token](args)


def gpus_of(instance_type: str) -> list[tuple[str, int]]:
    """(model, memory MiB) of each NVIDIA GPU an instance of this type has."""
    return [(model, GPU_MEMORY_MIB.get(model, 24576)) for maker, model, count in INSTANCE_TYPES[instance_type][1]
            if maker == "NVIDIA" for _ in range(count)]


def bucket_state(name: str, region: str = REGION) -> tuple[str, dict]:
    """An auto-named bucket, as the provider names it: the resource name and a random suffix."""
    bucket = f"{name}-{hashlib.sha1(name.encode()).hexdigest()[:7]}"
    return bucket, {"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}",
                    "bucketRegionalDomainName": f"{bucket}.s3.{region}.amazonaws.com"}
