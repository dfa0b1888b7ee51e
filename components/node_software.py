"""One node's software: who may log in, the copy of node/, and applying it, rolled one node per pool at a time.

First boot and every later change take the same path. The node is drained first (on a
manager, holding its pool's maintenance lease) if it already serves the swarm, then the
copy of node/ is checked and installed and the bootstrap runs; Membership admits the node
afterwards and ends its maintenance. A node that already runs this software skips all of it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

import node_software
from components.remote import as_root
from swarm.rollout import cordon_node


@dataclass
class NodeSoftwareArgs:
    pool: str
    gpu: bool
    expected_gpus: int
    instance_type: str
    env: dict[str, str]  # node.env: the node's settings (kind, image, ...)
    health_env: dict[str, str]  # health.env: Health.node_env(), apart so that a change drains nothing
    software: str  # node_software.software_hash()
    node: pulumi.Input[command.remote.ConnectionArgs]  # to the node, patient: it may be booting
    manager: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager
    private_ip: pulumi.Input[str]
    instance_id: pulumi.Input[str]
    access_script: pulumi.Input[str]  # node_software.authorize_keys() for the cluster's keys, as root
    # What the drain waits for: the swarm must exist (none for the first manager, which
    # cordons itself and makes the swarm afterwards).
    cordon_after: Sequence[pulumi.Resource] = field(default_factory=list)


class NodeSoftware(pulumi.ComponentResource):
    applied: command.remote.Command  # done once the node runs this software
    release: str  # node_software.release(): what the node runs once applied
    bootstrap_timings: pulumi.Output[dict]  # the bootstrap steps and their durations

    def __init__(self, name: str, args: NodeSoftwareArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:node:Software", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # A replaced instance is a new node: its commands start afresh.
        fresh = [args.instance_id]
        steps = node_software.bootstrap_steps(gpu=args.gpu, instance_type=args.instance_type)
        self.release = node_software.release(args.software, args.env, steps)

        command.remote.Command(
            f"{name}-access",
            connection=args.node,
            create=args.access_script,
            triggers=fresh,
            opts=child,
        )
        copy = command.remote.CopyToRemote(
            f"{name}-copy",
            connection=args.node,
            # Relative: the state keeps no path of the operator's machine. Pulumi runs the
            # program in the project directory.
            source=pulumi.FileArchive(node_software.SOURCE_DIR.name),
            remote_path=node_software.staging_dir(args.software),
            triggers=[*fresh, args.software],
            opts=child,
        )
        cordon = command.remote.Command(
            f"{name}-cordon",
            connection=args.manager,
            create=pulumi.Output.from_input(args.private_ip).apply(
                lambda ip: as_root(cordon_node(ip, pool=args.pool, software=self.release))),
            triggers=fresh,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.cordon_after)),
        )
        # Before the software, so that its services start with these settings; a later
        # change restarts them and nothing else.
        health = command.remote.Command(
            f"{name}-health",
            connection=args.node,
            create=as_root(node_software.health_settings(args.health_env)),
            triggers=fresh,
            opts=child,
        )
        self.applied = command.remote.Command(
            f"{name}-apply",
            connection=args.node,
            create=as_root(node_software.apply_software(
                software=args.software, steps=steps, env=args.env, expected_gpus=args.expected_gpus)),
            triggers=fresh,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[copy, cordon, health]),
        )
        self.bootstrap_timings = self.applied.stdout.apply(_parse_timings)
        self.register_outputs({"bootstrap_timings": self.bootstrap_timings})


def _parse_timings(text: str) -> dict:
    try:
        parsed = json.loads((text or "{}").strip().splitlines()[-1] if (text or "").strip() else "{}")
    except ValueError:
        return {"unreadable": (text or "").strip()[:200]}
    return parsed if isinstance(parsed, dict) else {"unreadable": (text or "").strip()[:200]}
