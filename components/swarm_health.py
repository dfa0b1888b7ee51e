"""Each node's health as the swarm sees it, read on the first manager for the inventory output."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.health import parse_conditions, parse_elastic_nodes, read_conditions, read_elastic_nodes


def read_stamp() -> str:
    """When this `pulumi up` reads the conditions (tests replace it)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class SwarmHealthArgs:
    manager: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager
    node_ids: Sequence[pulumi.Input[str]]  # every node the program has, as joined
    each_up: bool  # settings.health.inventory_each_up
    elastic: bool = False  # the cluster has elastic pools: their nodes, which the program never has, are read too
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # everything that changes the swarm


class SwarmHealth(pulumi.ComponentResource):
    read_at: str | None  # when each_up: the time of this `pulumi up`
    conditions: pulumi.Output[dict]  # swarm node ID -> what swarm/health.py reads
    elastic_nodes: pulumi.Output[list]  # each elastic pool's node, as swarm/health.py reads it

    def __init__(self, name: str, args: SwarmHealthArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Health", name, None, opts)
        # each_up: a new stamp each run makes a new script, which pulumi-command runs again:
        # `pulumi preview` shows this one update every time. Otherwise it reads when the
        # nodes change. It only reads: no delete, and no failure of it changes the swarm.
        self.read_at = read_stamp() if args.each_up else None
        read = command.remote.Command(
            f"{name}-read",
            connection=args.manager,
            create=pulumi.Output.all(*args.node_ids).apply(
                lambda ids: as_root(read_conditions(list(ids), self.read_at))),
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.conditions = read.stdout.apply(parse_conditions)
        self.elastic_nodes = pulumi.Output.from_input([])
        if args.elastic:
            elastic = command.remote.Command(
                f"{name}-elastic", connection=args.manager, create=as_root(read_elastic_nodes(self.read_at)),
                opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)))
            self.elastic_nodes = elastic.stdout.apply(parse_elastic_nodes)
        self.register_outputs({"conditions": self.conditions})
