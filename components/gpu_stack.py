"""A compose file deployed with `docker stack deploy` from manager-0, checked at preview by settings.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.commands import deploy_stack, remove_stack


@dataclass
class GpuStackArgs:
    stack_name: str
    file: str  # relative to the project directory
    sha256: str  # of the file's content
    manager: pulumi.Input[command.remote.ConnectionArgs]
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node joined and labelled


class GpuStack(pulumi.ComponentResource):
    remote_path: str

    def __init__(self, name: str, args: GpuStackArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:GpuStack", name, None, opts)

        # Named after the content: a changed file lands beside the old one and changes the
        # deploy command below, so the stack is updated in place.
        self.remote_path = f"/tmp/gpu-swarm-stacks/{args.stack_name}-{args.sha256[:16]}.yml"
        copy = command.remote.CopyToRemote(
            f"{name}-copy",
            connection=args.manager,
            source=pulumi.FileAsset(args.file),
            remote_path=self.remote_path,
            triggers=[args.sha256],
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        # The content hash lives in `create` (through the path), not in `triggers`: a trigger
        # change replaces the command, and a replacement created before the old one is
        # deleted would have the old one's `docker stack rm` take down the new deployment.
        # As an update, `docker stack deploy` rolls the services over in place.
        # A replacement still happens when the connection to manager-0 changes; then the
        # old stack must go first, hence delete_before_replace.
        command.remote.Command(
            f"{name}-deploy",
            connection=args.manager,
            create=as_root(deploy_stack(args.stack_name, self.remote_path)),
            delete=as_root(remove_stack(args.stack_name)),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[copy, *args.after], delete_before_replace=True),
        )
        self.register_outputs({"remote_path": self.remote_path, "sha256": args.sha256})
