"""The swarm made to match the program after every change: nodes and stacks it no longer has go."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.reconcile import reconcile


@dataclass
class SwarmReconcileArgs:
    manager: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager
    node_ids: Sequence[pulumi.Input[str]]  # every node the program has, as joined
    stacks: Sequence[str]  # every stack the program deploys
    elastic_pools: Sequence[str] = ()  # their nodes are the scaler's (node/swarm_scaler.py), kept here
    instance_ids: Sequence[pulumi.Input[str]] = ()  # each node's instance, in node_ids' order
    # the instances AWS reported stopped when the program started: their nodes are kept, not waited for
    stopped_instances: frozenset[str] = frozenset()
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node admitted


class SwarmReconcile(pulumi.ComponentResource):
    def __init__(self, name: str, args: SwarmReconcileArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Reconcile", name, None, opts)
        # Its script lists what to keep, so it runs again whenever that changes. It has no
        # delete: `pulumi destroy` never needs to reach the swarm (see swarm/reconcile.py).
        command.remote.Command(
            f"{name}-run",
            connection=args.manager,
            create=pulumi.Output.all(*args.node_ids, *args.instance_ids).apply(lambda v: self._script(args, v)),
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.register_outputs({})

    @staticmethod
    def _script(args: SwarmReconcileArgs, values: list[str]) -> str:
        ids, instances = values[:len(args.node_ids)], values[len(args.node_ids):]
        stopped = [node for node, instance in zip(ids, instances) if instance in args.stopped_instances]
        return as_root(reconcile(nodes=list(ids), stacks=list(args.stacks), elastic_pools=list(args.elastic_pools),
                                 stopped=stopped))
