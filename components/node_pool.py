"""A pool of identical EC2 instances: the managers, or the nodes of one GPU pool."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws

from components.provider_facts import INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES


@dataclass
class NodePoolArgs:
    role: str  # "manager" or "worker"
    pool: str  # the pool's name: a node label, and part of every node's name
    instance_type: pulumi.Input[str]
    count: int  # plain: it decides how many instances exist
    ami_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]  # new nodes go round-robin over them
    security_group_ids: Sequence[pulumi.Input[str]]
    key_name: pulumi.Input[str]
    user_data: pulumi.Input[str]  # the #cloud-config a new node boots with; running nodes keep theirs
    root_volume_gib: pulumi.Input[int]
    node_name_prefix: str
    imds_hop_limit: pulumi.Input[int] = 1
    spot: bool = False
    spot_max_price: pulumi.Input[str] | None = None
    # Managers hold the swarm's Raft quorum: change them one after the other (a resize
    # stops and starts each), never all at once.
    one_at_a_time: bool = False
    # Created after these: the SSH rules, so that an operator whose address changed can reach
    # the nodes within the same `pulumi up` that lets that address in.
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    pool: str
    index: int
    instance: aws.ec2.Instance

    @property
    def private_ip(self) -> pulumi.Output[str]:
        return self.instance.private_ip

    @property
    def public_ip(self) -> pulumi.Output[str]:
        return self.instance.public_ip


class NodePool(pulumi.ComponentResource):
    nodes: list[Node]

    def __init__(self, name: str, args: NodePoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:NodePool", name, None, opts)
        if args.role not in ("manager", "worker"):
            raise ValueError(f"role must be 'manager' or 'worker', got {args.role!r}")

        market = None
        replace_on = []
        if args.spot:
            # One-time requests that terminate on interruption: a node lost to spot is
            # replaced by the next `pulumi up` (which refreshes first, see Pulumi.yaml).
            market = aws.ec2.InstanceInstanceMarketOptionsArgs(
                market_type="spot",
                spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
                    spot_instance_type="one-time",
                    instance_interruption_behavior="terminate",
                    max_price=args.spot_max_price,
                ),
            )
            # A one-time spot instance cannot be stopped, so it cannot be resized in place.
            replace_on = ["instanceType"]

        self.nodes = []
        previous: list[pulumi.Resource] = []
        for i in range(args.count):
            node_name = f"{args.node_name_prefix}-{i}"
            tags = {**args.tags, "Name": node_name, "gpu-swarm:role": args.role, "gpu-swarm:pool": args.pool}
            instance = aws.ec2.Instance(
                f"{name}-{i}",
                ami=args.ami_id,
                instance_type=args.instance_type,
                subnet_id=args.subnet_ids[i % len(args.subnet_ids)],
                vpc_security_group_ids=list(args.security_group_ids),
                key_name=args.key_name,
                # Egress without a NAT gateway; inbound is closed by the security groups.
                associate_public_ip_address=True,
                user_data=args.user_data,
                user_data_replace_on_change=False,
                metadata_options=aws.ec2.InstanceMetadataOptionsArgs(
                    http_endpoint="enabled",
                    http_tokens="required",
                    # 1: a container behind a bridge or overlay is one hop too far for IMDS,
                    # so it cannot take the instance role's credentials.
                    http_put_response_hop_limit=args.imds_hop_limit,
                ),
                root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
                    encrypted=True,
                    volume_type="gp3",
                    volume_size=args.root_volume_gib,
                    delete_on_termination=True,
                    tags=tags,
                ),
                instance_market_options=market,
                tags=tags,
                opts=pulumi.ResourceOptions(
                    parent=self,
                    # Inputs that a running node keeps when they change (a new AMI release,
                    # a rotated key, another zone list, new user data): only new or
                    # replaced nodes take them. See components/provider_facts.py.
                    ignore_changes=list(INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES),
                    replace_on_changes=replace_on,
                    depends_on=[*args.after, *(previous if args.one_at_a_time else [])],
                ),
            )
            if args.one_at_a_time:
                previous = [instance]
            self.nodes.append(Node(node_name, args.role, args.pool, i, instance))

        self.register_outputs(
            {
                "names": [n.name for n in self.nodes],
                "private_ips": [n.private_ip for n in self.nodes],
                "public_ips": [n.public_ip for n in self.nodes],
            }
        )
