"""A compose file deployed with `docker stack deploy` from the first manager, checked at preview by settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.stacks import deploy_stack


@dataclass
class GpuStackArgs:
    stack_name: str
    content: str  # the compose file's text
    sha256: str  # of that text
    manager: pulumi.Input[command.remote.ConnectionArgs]
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node joined and admitted


class GpuStack(pulumi.ComponentResource):
    def __init__(self, name: str, args: GpuStackArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:GpuStack", name, None, opts)
        # The compose file travels on stdin, so every run of the deploy has it, whichever
        # manager it reaches. A new hash changes the script, which makes it an update:
        # `docker stack deploy` rolls the services in place. Removal is SwarmReconcile's
        # job, so this command has no delete that could hold up `pulumi destroy`.
        command.remote.Command(
            f"{name}-deploy",
            connection=args.manager,
            create=as_root(deploy_stack(args.stack_name, args.sha256)),
            stdin=args.content,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.register_outputs({"sha256": args.sha256})
