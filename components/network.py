"""A VPC with one public subnet per availability zone, routed to an internet gateway."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws


@dataclass
class NetworkArgs:
    cidr_block: pulumi.Input[str]
    # One subnet per (availability zone, CIDR); plain values, since they decide how many
    # subnets exist. settings/aws_checks.py keeps each zone's CIDR fixed as zones come and go.
    subnets: Sequence[tuple[str, str]]
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]  # in the order of args.subnets
    route_table_ids: list[pulumi.Output[str]]  # the subnets' routes: the S3 endpoint joins them

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.cidr_block,
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags={**args.tags, "Name": name},
            opts=child,
        )
        gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=vpc.id, tags={**args.tags, "Name": name}, opts=child
        )
        # Every node gets a public address for egress (image pulls of many GiB) instead of a
        # NAT gateway, which would bill per GiB. Inbound stays closed: the security groups
        # admit only SSH to the managers from allowedSshCidrs, and swarm ports from members.
        routes = aws.ec2.RouteTable(
            f"{name}-public",
            vpc_id=vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", gateway_id=gateway.id)],
            tags={**args.tags, "Name": f"{name}-public"},
            opts=child,
        )
        self.subnet_ids = []
        for zone, cidr in args.subnets:
            subnet = aws.ec2.Subnet(
                f"{name}-{zone}",
                vpc_id=vpc.id,
                availability_zone=zone,
                cidr_block=cidr,
                # Public addresses are asked for per instance, so nothing else launched
                # here gets one by surprise.
                map_public_ip_on_launch=False,
                tags={**args.tags, "Name": f"{name}-{zone}"},
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-{zone}-public", subnet_id=subnet.id, route_table_id=routes.id, opts=child
            )
            self.subnet_ids.append(subnet.id)

        self.vpc_id = vpc.id
        self.route_table_ids = [routes.id]
        self.register_outputs({"vpc_id": self.vpc_id, "subnet_ids": self.subnet_ids})
