"""The cluster's elastic pools as a whole: their groups, the managers' role for the scaler, the scaler's settings.

Cluster (components/cluster.py) builds the pieces in its own order: the managers' instance profile
before the managers exist, each pool's group once the swarm has its tokens (its nodes join at once),
the role's policy once the groups have ARNs, and the scaler's settings on each manager once it has
booted. Without an elastic pool none of it exists, and the managers have no instance role at all.
"""
from __future__ import annotations

import json
from typing import Callable

import pulumi
import pulumi_aws as aws
import pulumi_command as command

from components.capacity import pool_subnets
from components.elastic_pool import (ElasticPool, ElasticPoolArgs, group_name, instance_role, join_document,
                                     scaler_policy, template_capacity, template_market)
from components.remote import as_root
from settings import GpuPool, Settings
from swarm.gpu_check import GpuCheck
from swarm.labels import pool_labels
from swarm.node_contract import AUTOSCALE_ADMIT_SUFFIX, AUTOSCALE_POOLS_PATH
from swarm.rollout import admit_node
from swarm.script import NODE_ARGUMENT
from to_node.commands import autoscale_settings


def advertised(pool: GpuPool, kind: str, shared_kind: str) -> tuple[str, int]:
    """(the kind a node of the pool advertises, how many of it)."""
    return (shared_kind, pool.gpus_per_node * pool.slots_per_gpu) if pool.slots_per_gpu else (kind, pool.gpus_per_node)


def scaler_files(s: Settings, region: str, releases: dict[str, str]) -> dict[str, str]:
    """What the scaler reads on each manager (node/scale_plan.py Pool.from_json): pools.json and each pool's
    admit, the same admit_node and GPU check a fixed node gets, for the node its first argument names."""
    pools, files = [], {}
    for pool in s.elastic_pools:
        kind, units = advertised(pool, s.gpu_kind, s.shared_gpu_kind)
        pools.append({"name": pool.name, "group": group_name(s.cluster_name, pool.name), "min": pool.autoscale.min,
                      "max": pool.autoscale.max, "idleSeconds": 60 * pool.autoscale.idle_minutes, "kind": kind,
                      "units": units, "labels": pool_labels(pool), "release": releases[pool.name],
                      "maxUnavailable": pool.max_unavailable, "gpuKinds": [s.gpu_kind, s.shared_gpu_kind]})
        files[f"{pool.name}{AUTOSCALE_ADMIT_SUFFIX}"] = admit_node(
            NODE_ARGUMENT, pool_labels(pool), expected_gpus=pool.gpus_per_node, kind=s.gpu_kind,
            software=releases[pool.name], slots_per_gpu=pool.slots_per_gpu, shared_kind=s.shared_gpu_kind,
            check=GpuCheck())
    files[AUTOSCALE_POOLS_PATH.rsplit("/", 1)[1]] = json.dumps({"region": region, "pools": pools}, indent=1) + "\n"
    return files


class ElasticPools:
    def __init__(self, name: str, s: Settings, tags: dict, parent: pulumi.Resource):
        self._name, self._s, self._tags, self._parent = name, s, tags, parent
        self.groups: list[ElasticPool] = []
        self.role = self.profile = None
        if s.elastic_pools:
            self.role, self.profile = instance_role(f"{name}-scaler", tags, parent)

    @property
    def managers_profile(self) -> pulumi.Input[str] | None:
        return self.profile.name if self.profile else None

    def build(self, *, images: Callable[[GpuPool], pulumi.Input[str]], releases: dict[str, pulumi.Output],
              swarm, manager_ips: list, subnets_by_zone: dict, security_group_ids, key_name, after) -> None:
        """Each pool's group, once the swarm can be joined; then the scaler's policy over them."""
        s = self._s
        join = pulumi.Output.all(swarm.worker_token, swarm.cluster_id, *manager_ips).apply(
            lambda v: join_document(v[0], list(v[2:]), v[1]))
        for pool in s.elastic_pools:
            name = f"{self._name}-{pool.name}"
            subnets, reservation, placement_group = pool_subnets(self._name, pool, subnets_by_zone, self._parent)
            if pool.options.placement == "cluster" and placement_group is None:
                placement_group = aws.ec2.PlacementGroup(
                    f"{name}-placement", strategy="cluster", tags={**self._tags, "Name": f"{name}-placement"},
                    opts=pulumi.ResourceOptions(parent=self._parent)).name
            self.groups.append(ElasticPool(name, ElasticPoolArgs(
                pool=pool, cluster_name=s.cluster_name, release=releases[pool.name], ami_id=images(pool),
                subnet_ids=subnets, security_group_ids=security_group_ids(pool), key_name=key_name,
                join=join, imds_hop_limit=s.imds_hop_limit, market=template_market(pool),
                capacity=template_capacity(pool, reservation), placement_group=placement_group,
                after=after, tags=self._tags), opts=pulumi.ResourceOptions(parent=self._parent)))
        if self.role is not None:
            aws.iam.RolePolicy(f"{self._name}-scaler", role=self.role.id,
                               policy=pulumi.Output.all(*[g.group_arn for g in self.groups]).apply(
                                   lambda arns: scaler_policy(list(arns))),
                               opts=pulumi.ResourceOptions(parent=self._parent))

    def configure(self, manager, connection, boot, region: str, releases: dict[str, str]) -> None:
        """The scaler's settings on one manager, once it has booted; its next round reads them."""
        if not self._s.elastic_pools:
            return
        command.remote.Command(
            f"{self._name}-autoscale-{manager.index}", connection=connection,
            create=as_root(autoscale_settings(scaler_files(self._s, region, releases))),
            triggers=[manager.instance_id],
            opts=pulumi.ResourceOptions(parent=self._parent, depends_on=[boot.booted]))
