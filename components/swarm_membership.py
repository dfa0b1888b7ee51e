"""One node's place in the swarm: it joins the cluster's swarm once its first boot is done."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.formation import join_swarm


@dataclass
class MembershipArgs:
    role: str  # "manager" or "worker"
    node: pulumi.Input[command.remote.ConnectionArgs]  # SSH to the node itself
    manager_addresses: Sequence[pulumi.Input[str]]  # every manager's private address, first manager first
    advertise_address: pulumi.Input[str]  # the node's private address
    instance_id: pulumi.Input[str]
    cluster_id: pulumi.Input[str]
    join_token: pulumi.Input[str]  # secret; reaches the node on stdin only
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # its boot, and the tokens


class Membership(pulumi.ComponentResource):
    node_id: pulumi.Output[str]
    joined: command.remote.Command

    def __init__(self, name: str, args: MembershipArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Membership", name, None, opts)
        self.joined = command.remote.Command(
            f"{name}-join",
            connection=args.node,
            create=pulumi.Output.all(args.advertise_address, args.cluster_id, *args.manager_addresses).apply(
                lambda a: as_root(join_swarm(role=args.role, managers=list(a[2:]), advertise_addr=a[0],
                                             expected_cluster=a[1]))),
            stdin=pulumi.Output.secret(args.join_token),
            # A new instance is a new node, even if it got the old one's address.
            triggers=[args.instance_id],
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.node_id = self.joined.stdout.apply(lambda out: out.strip().splitlines()[-1] if out.strip() else "")
        self.register_outputs({"node_id": self.node_id})
