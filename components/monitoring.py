"""The monitoring stack (monitoring: true): Prometheus and Grafana on the managers, deployed from the first manager."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pulumi
import pulumi_command as command

from components.remote import as_root
from swarm.monitoring import PORTS, bundle, bundle_sha256, deploy_monitoring, render, tunnel_command


@dataclass
class MonitoringArgs:
    manager: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager
    manager_public_ip: pulumi.Input[str]  # where the tunnel goes
    ssh_user: str
    images: dict[str, str] = field(default_factory=dict)  # monitoringImages: service -> image pinned by digest
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # every node joined and admitted
    swarm_id: pulumi.Input[str] = ""  # the swarm's cluster ID: a new swarm deploys the stack again


class Monitoring(pulumi.ComponentResource):
    """Deploys stacks/monitoring.yml with its config files. Each GPU node's exporter is part of the
    node software (install-gpu-metrics) and its port is open to cluster members only
    (SecurityGroups), so this is all `monitoring: true` adds."""

    access: pulumi.Output[dict]

    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Monitoring", name, None, opts)
        files = bundle(render(args.images))
        # The files travel on stdin, as the other stacks' compose files do; their hash is in the
        # script, so a change is an update that deploys again (rolling what changed). Removal is
        # SwarmReconcile's (the stack's marker), so `pulumi destroy` never needs the swarm.
        command.remote.Command(
            f"{name}-deploy",
            connection=args.manager,
            create=pulumi.Output.from_input(args.swarm_id).apply(
                lambda swarm: as_root(deploy_monitoring(bundle_sha256(files), swarm))),
            stdin=files,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        self.access = pulumi.Output.from_input(args.manager_public_ip).apply(lambda ip: {
            "tunnel": tunnel_command(args.ssh_user, ip),
            **{service: f"http://localhost:{port}" for service, port in PORTS.items()},
        })
        self.register_outputs({"access": self.access})
