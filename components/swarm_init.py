"""The cluster's one swarm: found on a live manager, or created on the first one; its join tokens.

The first manager never creates a second swarm. Whenever it is new (a replaced instance),
the other managers are asked again whether they manage a swarm (probes), and the first
manager joins theirs; only when none does is a swarm created. The swarm's cluster ID then
flows into every join, so nodes left in a swarm that is gone move to the current one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.formation import init_swarm, live_peers, probe_manager, read_join_tokens


@dataclass
class SwarmInitArgs:
    first: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager, patient
    first_live: pulumi.Input[command.remote.ConnectionArgs]  # the same, for a node known to answer
    first_instance_id: pulumi.Input[str]
    advertise_address: pulumi.Input[str]  # the first manager's private address
    peers: Sequence[tuple[pulumi.Input[command.remote.ConnectionArgs], pulumi.Input[str]]]  # other managers
    address_pool: str  # overlay networks come from here (settings keep it off the VPC)
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # the first manager's software


class SwarmInit(pulumi.ComponentResource):
    init: command.remote.Command  # what every join waits for
    cluster_id: pulumi.Output[str]
    worker_token: pulumi.Output[str]  # secret
    manager_token: pulumi.Output[str]  # secret

    def __init__(self, name: str, args: SwarmInitArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Init", name, None, opts)

        probes = [
            command.remote.Command(
                f"{name}-probe-{i + 1}",
                connection=conn,
                create=as_root(probe_manager()),
                # Asked again whenever the first manager is a new instance: that is when
                # the answer decides between joining a swarm and creating one.
                triggers=[args.first_instance_id],
                # A live manager answers with the swarm's manager join token.
                logging=command.remote.Logging.NONE,
                opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["stdout"]),
            )
            for i, (conn, _) in enumerate(args.peers)
        ]
        peer_lines = pulumi.Output.secret(pulumi.Output.all(*[p.stdout for p in probes]).apply(live_peers))
        create = pulumi.Output.all(args.advertise_address, *[ip for _, ip in args.peers]).apply(
            lambda a: as_root(init_swarm(a[0], peers=list(a[1:]), address_pool=args.address_pool)))
        self.init = command.remote.Command(
            f"{name}-init",
            connection=args.first,
            create=create,
            stdin=peer_lines if probes else None,
            logging=command.remote.Logging.STDOUT_AND_STDERR,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*args.after, *probes]),
        )
        self.cluster_id = self.init.stdout.apply(lambda out: json.loads(out.strip().splitlines()[-1])["cluster_id"])
        tokens = command.remote.Command(
            f"{name}-tokens",
            connection=args.first_live,
            create=self.cluster_id.apply(lambda cid: as_root(read_join_tokens(cid))),
            # The tokens let anyone join the swarm: keep them out of the logs and the
            # plain-text state.
            logging=command.remote.Logging.NONE,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.init], additional_secret_outputs=["stdout"]),
        )
        parsed = pulumi.Output.secret(tokens.stdout).apply(json.loads)
        self.worker_token = pulumi.Output.secret(parsed.apply(lambda t: t["worker"]))
        self.manager_token = pulumi.Output.secret(parsed.apply(lambda t: t["manager"]))
        self.tokens = tokens
        self.register_outputs({"cluster_id": self.cluster_id})
