"""One node's first boot, seen from `pulumi up`: wait for it, then who may log in, the health settings and the price.

The node installs itself from its user data (components/cloud_config.py). Nothing here
installs anything: the boot command only waits until cloud-init and the install it ran have
ended (bounded), reports each step's time, and fails with the ends of the node's logs when
the install failed; the next `pulumi up` installs again. A replaced instance is a new node,
so every command here is keyed to the instance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_command as command

from to_node import commands as node_commands
from components.remote import as_root


@dataclass
class NodeBootArgs:
    node: pulumi.Input[command.remote.ConnectionArgs]  # to the node, patient: it may still be booting
    node_live: pulumi.Input[command.remote.ConnectionArgs]  # the same, once it answered
    instance_id: pulumi.Input[str]
    env: dict[str, str]  # the node's node.env, to know what it advertises
    expected_gpus: int
    access_script: pulumi.Input[str]  # node_commands.authorize_keys() for the cluster's keys, as root
    health_env: dict[str, str]  # health.env: Health.node_env(), apart so that a change drains nothing
    # cost.env on a GPU node (to_node/software.py price_env), beside health.env: a new price drains nothing either
    price_env: pulumi.Input[dict[str, str]] | None = None


class NodeBoot(pulumi.ComponentResource):
    booted: command.remote.Command  # done once the node's first boot has installed it
    timings: pulumi.Output[dict]  # the boot's steps and their durations
    ran_release: pulumi.Output[str | None]  # the release id the node ran when the boot wait last ran

    def __init__(self, name: str, args: NodeBootArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:node:Boot", name, None, opts)
        fresh = [args.instance_id]
        self.booted = command.remote.Command(
            f"{name}-wait",
            connection=args.node,
            create=as_root(node_commands.wait_for_boot(env=args.env, expected_gpus=args.expected_gpus)),
            # A node boots once: a new connection (another live manager to go through) or new settings
            # change nothing here, and pulumi-command would run `create` again for them without this.
            update=as_root(node_commands.boot_recorded()),
            triggers=fresh,
            opts=pulumi.ResourceOptions(parent=self),
        )
        after_boot = pulumi.ResourceOptions(parent=self, depends_on=[self.booted])
        command.remote.Command(f"{name}-access", connection=args.node_live, create=args.access_script, triggers=fresh,
                               opts=after_boot)
        # The health services read it when they start; a later change restarts them and nothing else. A GPU
        # node's price goes with it (one command, one connection): the exporter reads it again when it changes.
        command.remote.Command(f"{name}-health", connection=args.node_live,
                               create=pulumi.Output.from_input(args.price_env).apply(
                                   lambda price: as_root(node_commands.health_settings(args.health_env, price=price))),
                               triggers=fresh, opts=after_boot)
        self.timings = self.booted.stdout.apply(parse_timings)
        self.ran_release = self.booted.stdout.apply(node_commands.ran_release)
        self.register_outputs({"timings": self.timings})


def parse_timings(text: str) -> dict:
    """The last line a boot or upgrade printed: {step: {seconds, status}}."""
    lines = (text or "").strip().splitlines()
    try:
        parsed = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {"unreadable": (text or "").strip()[:200]}
    return parsed if isinstance(parsed, dict) else {"unreadable": (text or "").strip()[:200]}
