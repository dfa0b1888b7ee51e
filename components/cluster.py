"""The whole cluster: network, security groups, key, node pools, the swarm and its stacks."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pulumi

from node_software import render_user_data
from components.gpu_stack import GpuStack, GpuStackArgs
from components.network import Network, NetworkArgs
from components.node_pool import Node, NodePool, NodePoolArgs
from components.remote import connection
from components.security_groups import SecurityGroups, SecurityGroupsArgs
from components.ssh_key import SshKey, SshKeyArgs
from components.swarm_init import SwarmInit, SwarmInitArgs
from components.swarm_membership import Membership, MembershipArgs
from settings import GpuPool, Settings


@dataclass
class ClusterArgs:
    # Plain, validated values: they decide which resources exist and how many.
    settings: Settings


class Cluster(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    availability_zones: list[str]
    manager_public_ips: pulumi.Output[list[str]]
    manager_private_ips: pulumi.Output[list[str]]
    ssh_commands: pulumi.Output[dict[str, str]]
    inventory: pulumi.Output[list[dict]]
    bootstrap_timings: pulumi.Output[dict[str, dict]]
    private_key: pulumi.Output[str] | None  # secret; only when the key was generated here

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Cluster", name, None, opts)
        s = args.settings
        self._name, self._s = name, s
        self._child = pulumi.ResourceOptions(parent=self)
        self._tags = {**s.tag_map, "gpu-swarm:cluster": s.cluster_name}

        vpc_id, subnet_ids = self._network()
        groups = SecurityGroups(
            f"{name}-sg",
            SecurityGroupsArgs(vpc_id=vpc_id, allowed_ssh_cidrs=s.allowed_ssh_cidrs, tags=self._tags),
            opts=self._child,
        )
        key = SshKey(
            f"{name}-ssh",
            SshKeyArgs(public_key=s.ssh_public_key, private_key=s.ssh_private_key, tags=self._tags),
            opts=self._child,
        )
        self._key = key

        managers = NodePool(f"{name}-managers", NodePoolArgs(
            role="manager",
            pool="managers",
            instance_type=s.managers.instance_type,
            count=s.managers.count,
            # Managers run no GPU work, so they always run plain Ubuntu, even when the GPU
            # nodes use the Deep Learning AMI (built for GPU instances) or a custom image.
            ami_id=s.manager_ami_id,
            subnet_ids=subnet_ids,
            security_group_ids=[groups.cluster_id, groups.managers_id],
            key_name=key.key_name,
            user_data_base64=_user_data(False, s.gpu_kind, s.managers.instance_type, "ubuntu"),
            root_volume_gib=s.managers.root_volume_gib,
            node_name_prefix=f"{s.cluster_name}-manager",
            imds_hop_limit=s.imds_hop_limit,
            tags=self._tags,
        ), opts=self._child)
        pools = [
            (pool, NodePool(f"{name}-{pool.name}", NodePoolArgs(
                role="worker",
                pool=pool.name,
                instance_type=pool.instance_type,
                count=pool.count,
                ami_id=s.gpu_ami_id,
                subnet_ids=subnet_ids,
                security_group_ids=[groups.cluster_id, groups.workers_id],
                key_name=key.key_name,
                user_data_base64=_user_data(True, s.gpu_kind, pool.instance_type, s.image),
                root_volume_gib=pool.root_volume_gib,
                node_name_prefix=f"{s.cluster_name}-{pool.name}",
                imds_hop_limit=s.imds_hop_limit,
                spot=pool.spot,
                spot_max_price=pool.spot_max_price,
                keep_ami_of_running_nodes=s.ami_from_ssm,
                tags=self._tags,
            ), opts=self._child))
            for pool in s.gpu_pools
        ]

        first = managers.nodes[0]
        self._jump_host = first.public_ip
        self._manager_0_address = first.private_ip
        manager_0 = self._connection(first)
        swarm = SwarmInit(
            f"{name}-swarm",
            SwarmInitArgs(connection=manager_0, advertise_address=first.private_ip, kind=s.gpu_kind),
            opts=self._child,
        )

        members: list[tuple[Node, int, Membership]] = []
        for i, node in enumerate(managers.nodes):
            members.append((node, 0, self._membership(
                node, i, swarm, manager_0, token=swarm.manager_token, expected_gpus=0,
                labels={"gpu-swarm.pool": "managers"}, removable=i > 0,
            )))
        for pool, node_pool in pools:
            for i, node in enumerate(node_pool.nodes):
                members.append((node, pool.gpus_per_node, self._membership(
                    node, i, swarm, manager_0, token=swarm.worker_token,
                    expected_gpus=pool.gpus_per_node, labels=_pool_labels(pool),
                )))

        ready = [m.labelled for _, _, m in members]
        for stack in s.stacks:
            GpuStack(f"{name}-stack-{stack.name}", GpuStackArgs(
                stack_name=stack.name, file=stack.file, sha256=stack.sha256, manager=manager_0, after=ready,
            ), opts=self._child)

        self.vpc_id = pulumi.Output.from_input(vpc_id)
        self.availability_zones = list(s.network.availability_zones)
        self.manager_public_ips = pulumi.Output.all(*[n.public_ip for n in managers.nodes])
        self.manager_private_ips = pulumi.Output.all(*[n.private_ip for n in managers.nodes])
        self.ssh_commands = self._ssh_commands([node for node, _, _ in members])
        self.inventory = pulumi.Output.all(*[self._inventory_entry(*m) for m in members])
        self.bootstrap_timings = pulumi.Output.all(*[m.bootstrap_timings for _, _, m in members]).apply(
            lambda timings: {node.name: t for (node, _, _), t in zip(members, timings)}
        )
        self.private_key = key.private_key if key.generated else None
        self.register_outputs({
            "vpc_id": self.vpc_id,
            "manager_public_ips": self.manager_public_ips,
            "manager_private_ips": self.manager_private_ips,
            "ssh_commands": self.ssh_commands,
            "inventory": self.inventory,
            "bootstrap_timings": self.bootstrap_timings,
        })

    def _network(self):
        net = self._s.network
        if net.vpc_id:
            return net.vpc_id, list(net.subnet_ids)
        network = Network(
            f"{self._name}-network",
            NetworkArgs(
                cidr_block=net.vpc_cidr,
                subnets=list(zip(net.availability_zones, net.subnet_cidrs)),
                tags=self._tags,
            ),
            opts=self._child,
        )
        return network.vpc_id, network.subnet_ids

    def _connection(self, node: Node):
        """Managers are reached directly; workers only through manager-0 (see SecurityGroups)."""
        user, key = self._s.ssh_user, self._key.private_key
        if node.role == "manager":
            return connection(host=node.public_ip, user=user, private_key=key)
        return connection(host=node.private_ip, user=user, private_key=key, jump_host=self._jump_host)

    def _membership(self, node: Node, index: int, swarm: SwarmInit, manager_0, *, token, expected_gpus: int,
                    labels: dict[str, str], removable: bool = True) -> Membership:
        return Membership(f"{self._name}-member-{node.pool}-{index}", MembershipArgs(
            role=node.role,
            labels=labels,
            expected_gpus=expected_gpus,
            kind=self._s.gpu_kind,
            node=self._connection(node),
            manager=manager_0,
            manager_address=self._manager_0_address,
            advertise_address=node.private_ip,
            instance_id=node.instance.id,
            join_token=token,
            removable=removable,
            after=[swarm.init],
        ), opts=self._child)

    def _ssh_commands(self, nodes: list[Node]) -> pulumi.Output[dict[str, str]]:
        user = self._s.ssh_user

        def command_for(node: Node) -> pulumi.Output[str]:
            if node.role == "manager":
                return pulumi.Output.concat("ssh ", user, "@", node.public_ip)
            # Workers take SSH only from the managers: hop through manager-0.
            return pulumi.Output.concat("ssh -J ", user, "@", self._jump_host, " ", user, "@", node.private_ip)

        return pulumi.Output.all(*[command_for(n) for n in nodes]).apply(
            lambda commands: {n.name: c for n, c in zip(nodes, commands)}
        )

    def _inventory_entry(self, node: Node, expected_gpus: int, member: Membership) -> pulumi.Output[dict]:
        return pulumi.Output.all(
            node.instance.instance_type, node.private_ip, node.public_ip, member.node_id, member.advertised_gpus
        ).apply(lambda v: {
            "name": node.name,
            "role": node.role,
            "pool": node.pool,
            "instanceType": v[0],
            "privateIp": v[1],
            "publicIp": v[2],
            "swarmNodeId": v[3],
            "gpusExpected": expected_gpus,
            "gpusAdvertised": v[4],
        })


def _pool_labels(pool: GpuPool) -> dict[str, str]:
    # Named after what they describe, so placement constraints read naturally:
    # node.labels.gpu-swarm.pool == training, node.labels.gpu-swarm.gpu-model == H100.
    return {
        "gpu-swarm.pool": pool.name,
        "gpu-swarm.instance-type": pool.instance_type,
        "gpu-swarm.gpu-model": pool.gpu_model,
        "gpu-swarm.gpu-count": str(pool.gpus_per_node),
        "gpu-swarm.spot": "true" if pool.spot else "false",
    }


@functools.cache
def _user_data(gpu: bool, kind: str, instance_type: str, image: str) -> str:
    # One rendering per distinct node kind: 500 nodes of a pool share one string.
    return render_user_data(gpu=gpu, gpu_kind=kind, instance_type=instance_type, image=image)
