"""One node's place in the swarm: join the cluster's swarm, then be admitted from a manager."""
from __future__ import annotations

import json

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.formation import join_swarm
from swarm.gpu_check import GpuCheck
from swarm.rollout import admit_node, admitted, advertised_gpus


@dataclass
class MembershipArgs:
    role: str  # "manager" or "worker"
    labels: Mapping[str, str]  # node labels, set from the first manager
    expected_gpus: int  # how many GPUs the node has (each advertised once, or as slots)
    kind: str
    slots_per_gpu: int  # 0: whole GPUs
    shared_kind: str
    software: str  # the node software the node now runs
    node: pulumi.Input[command.remote.ConnectionArgs]  # SSH to the node itself
    manager: pulumi.Input[command.remote.ConnectionArgs]  # SSH to the first manager
    manager_addresses: Sequence[pulumi.Input[str]]  # every manager's private address, first manager first
    advertise_address: pulumi.Input[str]  # the node's private address
    instance_id: pulumi.Input[str]
    cluster_id: pulumi.Input[str]
    join_token: pulumi.Input[str]  # secret; reaches the node on stdin only
    check: GpuCheck | None = None  # prove the node's GPUs once it is in (GPU nodes)
    after: Sequence[pulumi.Resource] = field(default_factory=list)


class Membership(pulumi.ComponentResource):
    node_id: pulumi.Output[str]
    advertised_gpus: pulumi.Output[list[str]]  # GPU UUIDs (or slots) the swarm sees on the node
    gpus_verified: pulumi.Output[dict | None]  # the post-join GPU check's result; None: no GPUs to check
    admitted: command.remote.Command  # done once the node is in, labelled and schedulable

    def __init__(self, name: str, args: MembershipArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Membership", name, None, opts)
        kind, gpus = args.kind, args.expected_gpus

        join = command.remote.Command(
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
        self.node_id = join.stdout.apply(lambda out: out.strip().splitlines()[-1] if out.strip() else "")
        self.admitted = command.remote.Command(
            f"{name}-admit",
            connection=args.manager,
            create=self.node_id.apply(lambda node: as_root(admit_node(
                node, dict(args.labels), expected_gpus=gpus, kind=kind, software=args.software,
                slots_per_gpu=args.slots_per_gpu, shared_kind=args.shared_kind, check=args.check))),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[join]),
        )
        shown = args.shared_kind if args.slots_per_gpu else kind
        result = self.admitted.stdout.apply(admitted)
        self.advertised_gpus = result.apply(lambda r: advertised_gpus(json.dumps(r[0]), shown))
        self.gpus_verified = result.apply(lambda r: r[1])
        self.register_outputs({"node_id": self.node_id})
