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
    content: str  # the compose file as deployed: its Compose GPU requests rewritten (swarm/compose_gpus.py)
    sha256: str  # of that text
    manager: pulumi.Input[command.remote.ConnectionArgs]
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node joined and admitted
    rewrites: Sequence[str] = ()  # what the rewrite changed in the user's file, naming each key
    warnings: Sequence[str] = ()  # keys that gpu-swarm ignores, left out of content, and why
    diff: str = ""  # unified diff from the user's file to content; "" when content is the file itself


class GpuStack(pulumi.ComponentResource):
    def __init__(self, name: str, args: GpuStackArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:GpuStack", name, None, opts)
        # `pulumi preview` shows these beside the stack's resource, so the user sees what will
        # run before it does; the user's file on disk is never changed.
        if args.diff:
            pulumi.log.info(f"stack {args.stack_name}: Compose GPU requests rewritten for swarm:\n"
                            + "\n".join(f"  {r}" for r in args.rewrites) + "\n" + args.diff, resource=self)
        for warning in args.warnings:
            pulumi.log.warn(f"stack {args.stack_name}: {warning}", resource=self)
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
        self.register_outputs({"sha256": args.sha256, "rewrites": list(args.rewrites),
                               "warnings": list(args.warnings)})
