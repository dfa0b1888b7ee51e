"""A compose file deployed with `docker stack deploy` from the first manager, checked at preview by settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.stacks import DEFAULT_WAIT_SECONDS, deploy_stack, settle_report


@dataclass
class GpuStackArgs:
    stack_name: str
    content: pulumi.Input[str]  # the compose file as deployed (swarm/stack_files.py); a secret when it holds secrets
    sha256: str  # of that text, its secrets masked
    manager: pulumi.Input[command.remote.ConnectionArgs]
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node joined and admitted
    rewrites: Sequence[str] = ()  # what the rewrite changed in the user's file, naming each key
    warnings: Sequence[str] = ()  # keys that gpu-swarm ignores, left out of content, and why
    diff: str = ""  # unified diff from the user's file to content; "" when content is the file itself
    wait_seconds: int = DEFAULT_WAIT_SECONDS  # how long the deploy waits for the stack to settle (waitSeconds)
    swarm_id: pulumi.Input[str] = ""  # the swarm's cluster ID: a new swarm deploys the stack again


def stack_tasks(stdout: str | None) -> dict:
    """The deploy's report as the stackTasks output shows it: each service's tasks in a line, the
    tasks that wait for GPUs with the scheduler's reason, and how long the stack took to settle.
    Empty until the command has run (a preview)."""
    found = settle_report(stdout)
    if not found:
        return {}
    return {"services": {s["name"]: s["outcome"] for s in found.get("services", [])},
            "waitingForGpus": [{"service": w["service"], "task": w["slot"], "reason": w["reason"]}
                               for w in found.get("waiting", [])],
            # Tasks whose last run failed on a GPU the node's health watcher marked faulty (node/stack_tasks.py);
            # the key only when there are some.
            **({"hardwareFailures": [{"service": h["service"], "task": h["slot"], "node": h["node"], "gpu": h["gpu"],
                                      "xid": h["xid"]} for h in found["hardware_failures"]]}
               if found.get("hardware_failures") else {}),
            "settledInSeconds": found.get("seconds")}


class GpuStack(pulumi.ComponentResource):
    tasks: pulumi.Output[dict]  # stack_tasks() of the last deploy

    def __init__(self, name: str, args: GpuStackArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:GpuStack", name, None, opts)
        # `pulumi preview` shows these beside the stack's resource, so the user sees what will
        # run before it does; the user's file on disk is never changed.
        if args.diff:
            pulumi.log.info(f"stack {args.stack_name}: rewritten for swarm:\n"
                            + "\n".join(f"  {r}" for r in args.rewrites) + "\n" + args.diff, resource=self)
        for warning in args.warnings:
            pulumi.log.warn(f"stack {args.stack_name}: {warning}", resource=self)
        # The compose file travels on stdin, so every run of the deploy has it, whichever
        # manager it reaches. A new hash changes the script, which makes it an update:
        # `docker stack deploy` rolls the services in place. Removal is SwarmReconcile's
        # job, so this command has no delete that could hold up `pulumi destroy`. The command
        # returns once the stack has settled, or fails `pulumi up` with swarm's reason. The swarm's
        # ID is in the script: a new swarm (the only manager replaced) gets the stack deployed again.
        deploy = command.remote.Command(
            f"{name}-deploy",
            connection=args.manager,
            create=pulumi.Output.from_input(args.swarm_id).apply(
                lambda swarm: as_root(deploy_stack(args.stack_name, args.sha256, args.wait_seconds, swarm))),
            stdin=args.content,  # a str, or an Output (a secret, when the file takes secret variables)
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.tasks = deploy.stdout.apply(stack_tasks)
        self.register_outputs({"sha256": args.sha256, "rewrites": list(args.rewrites),
                               "warnings": list(args.warnings), "tasks": self.tasks})
