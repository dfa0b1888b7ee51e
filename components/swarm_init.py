"""The swarm's birth on manager-0: `docker swarm init`, then the join tokens, read as secrets."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.commands import init_swarm, read_join_tokens, wait_for_node


@dataclass
class SwarmInitArgs:
    connection: pulumi.Input[command.remote.ConnectionArgs]  # to manager-0
    advertise_address: pulumi.Input[str]  # manager-0's private address
    kind: str  # the GPU resource kind; manager-0 must advertise none of it


class SwarmInit(pulumi.ComponentResource):
    init: command.remote.Command  # what every join waits for
    worker_token: pulumi.Output[str]  # secret
    manager_token: pulumi.Output[str]  # secret

    def __init__(self, name: str, args: SwarmInitArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Init", name, None, opts)

        # SSH answers before cloud-init has installed Docker, so wait for the bootstrap first.
        create = pulumi.Output.from_input(args.advertise_address).apply(
            lambda addr: as_root(wait_for_node(expected_gpus=0, kind=args.kind) + init_swarm(addr))
        )
        self.init = command.remote.Command(
            f"{name}-init",
            connection=args.connection,
            create=create,
            opts=pulumi.ResourceOptions(parent=self),
        )
        tokens = command.remote.Command(
            f"{name}-tokens",
            connection=args.connection,
            create=as_root(read_join_tokens()),
            # The tokens let anyone join the swarm: keep them out of the logs and the
            # plain-text state.
            logging=command.remote.Logging.NONE,
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=[self.init], additional_secret_outputs=["stdout"]
            ),
        )
        parsed = pulumi.Output.secret(tokens.stdout).apply(json.loads)
        self.worker_token = pulumi.Output.secret(parsed.apply(lambda t: t["worker"]))
        self.manager_token = pulumi.Output.secret(parsed.apply(lambda t: t["manager"]))
        self.register_outputs({})  # the tokens stay inside: nothing here is for display
