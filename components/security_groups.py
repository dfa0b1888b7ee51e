"""The cluster's security groups: swarm ports (and the GPU metrics port) between members only, SSH only to the managers."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws

from swarm.node_contract import METRICS_PORT

# (rule name, protocol, port, why). Protocol "50" is ESP, which carries encrypted overlays.
MEMBER_PORTS = (
    ("gossip-tcp", "tcp", 7946, "swarm node gossip (tcp)"),
    ("gossip-udp", "udp", 7946, "swarm node gossip (udp)"),
    ("overlay", "udp", 4789, "swarm overlay network data (VXLAN)"),
    ("esp", "50", None, "encrypted overlay networks (IPsec ESP)"),
    # Not swarm's but ours: each GPU node's metrics exporter (node/gpu_metrics.py), which
    # Prometheus on a manager scrapes (monitoring: true). Open even when monitoring is off,
    # so that turning it on changes no security group.
    ("gpu-metrics", "tcp", METRICS_PORT, "GPU metrics exporter, scraped by Prometheus"),
)
SWARM_API_PORT = 2377


@dataclass
class SecurityGroupsArgs:
    vpc_id: pulumi.Input[str]
    # Plain strings: each CIDR is a rule of its own, named after it.
    allowed_ssh_cidrs: Sequence[str]
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    efa: bool = False  # a pool uses EFA: an `efa` group for its nodes (see below)


class SecurityGroups(pulumi.ComponentResource):
    """Three groups: `cluster` on every node, `managers` and `workers` by role.

    Swarm ports (2377, 7946, 4789, ESP) name a group as their source, never a CIDR, so no
    address outside the cluster can reach them. Workers accept SSH only from managers,
    which is how Pulumi (and you, with ssh -J) reach them.
    """

    cluster_id: pulumi.Output[str]
    managers_id: pulumi.Output[str]
    workers_id: pulumi.Output[str]
    ssh_rules: list[aws.vpc.SecurityGroupIngressRule]  # what `pulumi up` needs before it can reach a node
    efa_id: pulumi.Output[str] | None  # the EFA nodes' group, when a pool uses EFA

    def __init__(self, name: str, args: SecurityGroupsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:SecurityGroups", name, None, opts)
        self._name = name
        self._child = pulumi.ResourceOptions(parent=self)
        self._tags = args.tags
        self.ssh_rules = []

        # The description is the group's creation text: AWS cannot change it, so a new one would
        # replace the group. The GPU metrics rule came later and is not in it.
        cluster = self._group("cluster", args.vpc_id, "Every swarm node: gossip, overlay and ESP between members")
        managers = self._group("managers", args.vpc_id,
                               "Swarm managers: the swarm API from members, SSH from allowed networks")
        workers = self._group("workers", args.vpc_id, "Swarm workers: SSH from the managers only")

        for rule, protocol, port, why in MEMBER_PORTS:
            self._ingress(f"cluster-{rule}", cluster, protocol, port, why, source_group=cluster)
        self._ingress("managers-swarm-api", managers, "tcp", SWARM_API_PORT,
                      "swarm API and Raft, from members", source_group=cluster)
        for cidr in args.allowed_ssh_cidrs:
            self.ssh_rules.append(
                self._ingress(f"managers-ssh-{_slug(cidr)}", managers, "tcp", 22, f"SSH from {cidr}", cidr=cidr))
        self.ssh_rules.append(
            self._ingress("workers-ssh", workers, "tcp", 22, "SSH from the managers (jump host)", source_group=managers))

        # Egress stays open: nodes pull packages, drivers and images from the internet.
        aws.vpc.SecurityGroupEgressRule(f"{name}-cluster-egress-ipv4", security_group_id=cluster.id,
                                        ip_protocol="-1", cidr_ipv4="0.0.0.0/0", description="all outbound IPv4",
                                        tags=args.tags, opts=self._child)
        aws.vpc.SecurityGroupEgressRule(f"{name}-cluster-egress-ipv6", security_group_id=cluster.id,
                                        ip_protocol="-1", cidr_ipv6="::/0", description="all outbound IPv6",
                                        tags=args.tags, opts=self._child)

        self.efa_id = self._efa(args.vpc_id) if args.efa else None
        self.cluster_id, self.managers_id, self.workers_id = cluster.id, managers.id, workers.id
        self.register_outputs(
            {"cluster_id": self.cluster_id, "managers_id": self.managers_id, "workers_id": self.workers_id}
        )

    def _efa(self, vpc_id: pulumi.Input[str]) -> pulumi.Output[str]:
        """EFA needs every protocol, in and out, between the interfaces that talk (its SRD traffic is not IP):
        a group of the EFA nodes only, that admits itself; the swarm ports stay narrow for every other node."""
        efa = self._group("efa", vpc_id, "EFA nodes: all traffic to and from each other, as EFA requires")
        self._ingress("efa-all-in", efa, "-1", None, "all traffic between EFA nodes", source_group=efa)
        aws.vpc.SecurityGroupEgressRule(f"{self._name}-efa-all-out", security_group_id=efa.id, ip_protocol="-1",
                                        referenced_security_group_id=efa.id,
                                        description="all traffic between EFA nodes", tags=self._tags, opts=self._child)
        return efa.id

    def _group(self, role: str, vpc_id: pulumi.Input[str], description: str) -> aws.ec2.SecurityGroup:
        # No inline rules: mixed with the rule resources below, they would fight over the group.
        return aws.ec2.SecurityGroup(
            f"{self._name}-{role}",
            vpc_id=vpc_id,
            description=description,
            tags={**self._tags, "Name": f"{self._name}-{role}"},
            opts=self._child,
        )

    def _ingress(self, rule: str, group: aws.ec2.SecurityGroup, protocol: str, port: int | None,
                 description: str, *, source_group: aws.ec2.SecurityGroup | None = None,
                 cidr: str | None = None) -> aws.vpc.SecurityGroupIngressRule:
        version = ipaddress.ip_network(cidr).version if cidr else None
        return aws.vpc.SecurityGroupIngressRule(
            f"{self._name}-{rule}",
            security_group_id=group.id,
            ip_protocol=protocol,
            from_port=port,
            to_port=port,
            referenced_security_group_id=source_group.id if source_group else None,
            cidr_ipv4=cidr if version == 4 else None,
            cidr_ipv6=cidr if version == 6 else None,
            description=description,
            tags=self._tags,
            opts=self._child,
        )


def _slug(cidr: str) -> str:
    return re.sub(r"[^0-9a-f]+", "-", cidr.lower()).strip("-")
