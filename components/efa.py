"""A pool's EFA interfaces: a launch template with one EFA interface per network card, as the type has them.

Why a launch template, not aws.ec2.NetworkInterface resources: EC2 creates the interfaces at
launch and deletes them with the instance (32 per p5.48xlarge), so a replaced node needs no
detach and re-attach, and the state holds one template per pool rather than 32 resources per
node. aws.ec2.Instance's network_interfaces is deprecated in pulumi-aws 7 and attaches only
interfaces that already exist.

Card 0 carries the primary interface (device 0): the node's address, its security groups and
its EFA. Every other card carries one EFA interface at device 1, which AWS's own guidance for
p4d/p5 does. An instance launched with more than one interface gets no automatic public IPv4
address, so EFA pools take an Elastic IP (components/node_pool.py) for their egress.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws


def efa_interfaces(count: int, subnet_id: pulumi.Input[str], security_group_ids: Sequence[pulumi.Input[str]]
                   ) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgs]:
    """One EFA interface per network card, card 0 first; count from DescribeInstanceTypes (settings)."""
    if count < 1:
        raise ValueError(f"an EFA launch template needs at least one interface, got {count}")
    return [aws.ec2.LaunchTemplateNetworkInterfaceArgs(
        network_card_index=card,
        device_index=0 if card == 0 else 1,
        interface_type="efa",
        subnet_id=subnet_id,
        security_groups=list(security_group_ids),
        delete_on_termination="true",
        description=f"EFA on network card {card}",
    ) for card in range(count)]


def efa_launch_template(name: str, count: int, subnet_id: pulumi.Input[str],
                        security_group_ids: Sequence[pulumi.Input[str]], tags: Mapping[str, pulumi.Input[str]],
                        parent: pulumi.Resource) -> aws.ec2.LaunchTemplate:
    # Only the interfaces: the image, type, key, user data and disks stay on the instance,
    # where a running node keeps them (components/provider_facts.py).
    return aws.ec2.LaunchTemplate(
        f"{name}-efa",
        description="EFA interfaces of one gpu-swarm pool",
        network_interfaces=efa_interfaces(count, subnet_id, security_group_ids),
        tags={**tags, "Name": f"{name}-efa"},
        opts=pulumi.ResourceOptions(parent=parent),
    )
