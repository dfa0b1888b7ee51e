"""One node's place in the swarm: join, label from a manager, and read back what it advertises."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.commands import advertised_gpus, join_swarm, label_node, read_bootstrap_timings, remove_node


@dataclass
class MembershipArgs:
    role: str  # "manager" or "worker"
    labels: Mapping[str, str]  # node labels, set from manager-0
    expected_gpus: int  # how many GPUs of `kind` the node must advertise
    kind: str
    node: pulumi.Input[command.remote.ConnectionArgs]  # SSH to the node itself
    manager: pulumi.Input[command.remote.ConnectionArgs]  # SSH to manager-0
    manager_address: pulumi.Input[str]  # manager-0's private address, the join target
    advertise_address: pulumi.Input[str]  # the node's private address
    instance_id: pulumi.Input[str]
    join_token: pulumi.Input[str]  # secret; reaches the node on stdin only
    # manager-0 leads the swarm: it cannot drain and remove itself when deleted.
    removable: bool = True
    after: Sequence[pulumi.Resource] = field(default_factory=list)


class Membership(pulumi.ComponentResource):
    node_id: pulumi.Output[str]
    advertised_gpus: pulumi.Output[list[str]]  # GPU UUIDs the swarm sees on the node
    bootstrap_timings: pulumi.Output[dict]  # the node's bootstrap steps and their durations
    labelled: command.remote.Command  # done once the node is in and labelled

    def __init__(self, name: str, args: MembershipArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Membership", name, None, opts)
        kind, gpus = args.kind, args.expected_gpus

        join_script = pulumi.Output.all(args.manager_address, args.advertise_address).apply(
            lambda a: as_root(
                join_swarm(role=args.role, manager_addr=a[0], advertise_addr=a[1], expected_gpus=gpus, kind=kind)
            )
        )
        join = command.remote.Command(
            f"{name}-join",
            connection=args.node,
            create=join_script,
            stdin=pulumi.Output.secret(args.join_token),
            # A new instance is a new node, even if it got the old one's address.
            triggers=[args.instance_id],
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.node_id = join.stdout.apply(str.strip)

        # Replaced whenever the node ID changes, so the old node's delete runs: it drains
        # the old node (its tasks move while it still runs) and removes it from the swarm.
        # Scaling a pool down takes the same path.
        self.labelled = command.remote.Command(
            f"{name}-label",
            connection=args.manager,
            create=self.node_id.apply(
                lambda node: as_root(label_node(node, dict(args.labels), expected_gpus=gpus, kind=kind))
            ),
            delete=self.node_id.apply(lambda node: as_root(remove_node(node))) if args.removable else None,
            triggers=[self.node_id],
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.advertised_gpus = self.labelled.stdout.apply(lambda out: advertised_gpus(out, kind))

        timings = command.remote.Command(
            f"{name}-timings",
            connection=args.node,
            create=as_root(read_bootstrap_timings()),
            triggers=[args.instance_id],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[join]),
        )
        self.bootstrap_timings = timings.stdout.apply(_parse_timings)

        self.register_outputs(
            {"node_id": self.node_id, "advertised_gpus": self.advertised_gpus,
             "bootstrap_timings": self.bootstrap_timings}
        )


def _parse_timings(text: str) -> dict:
    try:
        parsed = json.loads(text or "{}")
    except ValueError:
        return {"unreadable": text.strip()[:200]}
    return parsed if isinstance(parsed, dict) else {"unreadable": text.strip()[:200]}
