"""The whole cluster: network, security groups, key, the node software's bundle, node pools, the swarm and its stacks.

The order `pulumi up` follows, per node: the instance boots and installs itself from its
user data; boot waits for that; the node joins the swarm (the first manager makes it);
then, in waves of at most the pool's maxUnavailable nodes (managers one at a time), the node
is drained if its release changes, upgraded in place and admitted. Once every node is in: the
reconcile (stacks the program no longer has go), then the stacks, each deploy waiting until its stack has settled, then the health read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from to_node import software as node_software
from components.access import Access
from components.capacity import pool_capacity_args
from components.cost import ClusterCost, cluster_cost, node_zone, price_list_provider
from components.elastic_cluster import ElasticPools
from components.elastic_pool import join_parameter_name
from components.gpu_stack import GpuStack, GpuStackArgs
from components.monitoring import Monitoring, MonitoringArgs
from components.network import Network, NetworkArgs
from components.node_boot import NodeBoot, NodeBootArgs
from components.node_bundle import NodeBundle, NodeBundleArgs
from components.node_pool import Node, NodePool, NodePoolArgs
from components.node_rollout import NodeRollout, NodeRolloutArgs, RollWaves
from components.remote import BOOT, LIVE, as_root
from components.security_groups import SecurityGroups, SecurityGroupsArgs
from components.ssh_key import SshKey, SshKeyArgs
from components.swarm_health import SwarmHealth, SwarmHealthArgs
from components.swarm_init import SwarmInit, SwarmInitArgs
from components.swarm_membership import Membership, MembershipArgs
from components.swarm_reconcile import SwarmReconcile, SwarmReconcileArgs
from to_node.commands import authorize_keys
from to_node.software import NodeRelease
from settings import GpuPool, Settings
from settings.model import PROJECT
from settings.aws_lookups import CLUSTER_TAG, running_names, stopped_instance_ids
from swarm.gpu_check import GpuCheck
from swarm.rollout import advertised_gpus
from swarm.labels import pool_labels
from swarm.node_contract import CAPACITY_BLOCK_END_ENV, MONITORING_STACK, POOL_LABEL


@dataclass
class ClusterArgs:
    # Plain, validated values: they decide which resources exist and how many.
    settings: Settings


@dataclass(frozen=True)
class _Kind:
    """What every node of one pool (or the managers) boots with and runs."""

    env: dict[str, str]
    steps: tuple[str, ...]
    expected_gpus: int
    release_id: str
    release: pulumi.Output[NodeRelease]


class Cluster(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    availability_zones: list[str]
    manager_public_ips: pulumi.Output[list[str]]
    manager_private_ips: pulumi.Output[list[str]]
    ssh_commands: pulumi.Output[dict[str, str]]
    known_hosts: pulumi.Output[str]  # each node's pinned host key, as ssh's known_hosts file has it
    inventory: pulumi.Output[list[dict]]
    bootstrap_timings: pulumi.Output[dict[str, dict]]
    node_software: pulumi.Output[dict]  # the bundle's sha256 and URL
    monitoring: pulumi.Output[dict]  # how to open Grafana and Prometheus (monitoring: true), else how to turn it on
    stack_tasks: pulumi.Output[dict]  # per stack, what its deploy saw once it settled (components/gpu_stack.py)
    cost: dict  # what its instances cost per hour, as the preview read the prices (components/cost.py)
    private_key: pulumi.Output[str] | None  # secret; only when the key was generated here

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:swarm:Cluster", name, None, opts)
        s = args.settings
        self._name, self._s = name, s
        self._child = pulumi.ResourceOptions(parent=self)
        self._connections: dict[tuple[str, tuple[int, int]], pulumi.Output] = {}
        self._tags = {**s.tag_map, CLUSTER_TAG: s.cluster_name}
        # Prices first: the preview prints them, and each GPU node is told its own.
        self._cost: ClusterCost = cluster_cost(s, aws.config.region, price_list_provider(name, aws.config.region, self))
        pulumi.log.info("\n".join(self._cost.table()))

        vpc_id, subnet_ids, route_tables = self._network()
        groups = SecurityGroups(
            f"{name}-sg",
            SecurityGroupsArgs(vpc_id=vpc_id, allowed_ssh_cidrs=s.allowed_ssh_cidrs, tags=self._tags,
                               efa=any(p.efa_interfaces for p in s.gpu_pools)),
            opts=self._child,
        )
        self._key = SshKey(
            f"{name}-ssh",
            SshKeyArgs(public_key=s.ssh_public_key, private_key=s.ssh_private_key, tags=self._tags),
            opts=self._child,
        )
        self._bundle = NodeBundle(f"{name}-nodes", NodeBundleArgs(
            vpc_id=vpc_id, region=aws.config.region, route_table_ids=route_tables,
            existing_endpoint_id=s.network.s3_endpoint_id, tags=self._tags,
        ), opts=self._child)
        # A node's first boot needs the SSH rules (the operator must reach it in this very
        # `pulumi up`) and its bundle, readable through the endpoint.
        common = dict(key_name=self._key.key_name, imds_hop_limit=s.imds_hop_limit,
                      after=[*groups.ssh_rules, *self._bundle.ready], tags=self._tags)
        # Each pool goes to the cluster's zones that offer its type (settings/pool_placement.py).
        subnets = dict(zip(s.network.availability_zones, subnet_ids))
        # Every node takes the same keys: one script for all of them.
        self._access = pulumi.Output.all(self._key.public_key, *s.ssh_authorized_keys).apply(
            lambda keys: as_root(authorize_keys(s.ssh_user, list(keys))))
        self._kinds: dict[str, _Kind] = {"managers": self._kind(None)}
        # Elastic pools (components/elastic_cluster.py): the managers' scaler needs their role before they launch.
        elastic = ElasticPools(name, s, self._tags, self)
        managers = NodePool(f"{name}-managers", NodePoolArgs(
            role="manager", pool="managers", instance_type=s.managers.instance_type, count=s.managers.count,
            # Managers run no GPU work, so they always run plain Ubuntu, even when the GPU
            # nodes use the Deep Learning AMI (built for GPU instances) or a custom image.
            ami_id=s.manager_ami_id, security_group_ids=[groups.cluster_id, groups.managers_id],
            root_volume_gib=s.managers.root_volume_gib, node_name_prefix=f"{s.cluster_name}-manager",
            release=self._kinds["managers"].release, one_at_a_time=True, stable_address=True,
            subnet_ids=[subnets[z] for z in s.managers.zones or subnets],
            iam_instance_profile=elastic.managers_profile, **common,
        ), opts=self._child)
        pools = []
        for pool in s.gpu_pools:
            self._kinds[pool.name] = self._kind(pool)
            if pool.autoscale:
                continue  # its group's nodes join by themselves, below
            pools.append((pool, NodePool(f"{name}-{pool.name}", NodePoolArgs(
                role="worker", pool=pool.name, instance_type=pool.instance_type, count=pool.count,
                ami_id=self._pool_image(name, pool), root_volume_gib=pool.root_volume_gib,
                security_group_ids=[groups.cluster_id, groups.workers_id,
                                    *([groups.efa_id] if pool.efa_interfaces else [])],
                node_name_prefix=f"{s.cluster_name}-{pool.name}", release=self._kinds[pool.name].release,
                **pool_capacity_args(name, pool, subnets, self), **common,
            ), opts=self._child)))
        nodes: list[tuple[Node, GpuPool | None]] = [(n, None) for n in managers.nodes]
        nodes += [(n, pool) for pool, node_pool in pools for n in node_pool.nodes]

        first = managers.nodes[0]
        # Workers through the first live manager, which also runs the swarm's steps (components/access.py).
        self._reach = Access(managers.nodes, running_names(s.cluster_name, "manager",
                                                           [n.name for n in managers.nodes]),
                             s.ssh_user, self._key.private_key)
        self._first_live = self._reach.to_live_manager()
        boots = {node.name: self._boot(node, pool) for node, pool in nodes}
        swarm = SwarmInit(f"{name}-swarm", SwarmInitArgs(
            first=self._connection(first), first_live=self._connection(first),
            first_instance_id=first.instance_id, advertise_address=first.private_ip,
            peers=[(self._connection(n, BOOT), n.private_ip) for n in managers.nodes[1:]],
            address_pool=s.overlay_address_pool, after=[boots[first.name].booted],
        ), opts=self._child)

        manager_ips = [n.private_ip for n in managers.nodes]
        releases = {p.name: self._kinds[p.name].release_id for p in s.elastic_pools}
        elastic.build(images=lambda pool: self._pool_image(name, pool),
                      releases={p.name: self._kinds[p.name].release for p in s.elastic_pools}, swarm=swarm,
                      manager_ips=manager_ips, subnets_by_zone=subnets, key_name=self._key.key_name,
                      security_group_ids=lambda pool: [groups.cluster_id, groups.workers_id],
                      after=[swarm.tokens, *groups.ssh_rules, *self._bundle.ready])
        for node in managers.nodes:
            elastic.configure(node, self._connection(node), boots[node.name], aws.config.region, releases)
        members, rollouts = {}, {}
        waves = RollWaves(f"{name}-roll", self._child)
        for node, pool in nodes:
            members[node.name] = self._membership(node, swarm, boots[node.name], manager_ips)
            # At most maxUnavailable nodes of a pool out at a time (managers: one), pools side by side.
            after = [members[node.name].joined, *waves.next(node.pool, pool.max_unavailable if pool else 1)]
            rollouts[node.name] = self._rollout(node, pool, members[node.name], boots[node.name], after)
            waves.add(node.pool, rollouts[node.name].admitted)
        # Each pool's last wave: waiting for it is waiting for every admit, at the cost of one dependency.
        admitted = waves.rolled()
        node_ids = [members[n.name].node_id for n, _ in nodes]
        reconcile = SwarmReconcile(f"{name}-reconcile", SwarmReconcileArgs(
            manager=self._first_live, node_ids=node_ids, after=admitted,
            instance_ids=[n.instance_id for n, _ in nodes],
            # read when the program starts, as the live manager is chosen (components/access.py)
            stopped_instances=stopped_instance_ids(s.cluster_name),
            stacks=[st.name for st in s.stacks] + ([MONITORING_STACK] if s.monitoring.enabled else []),
            elastic_pools=[p.name for p in s.elastic_pools],
        ), opts=self._child)
        # Stacks deploy after the reconcile has removed the stacks the program no longer has, so a
        # swap frees their GPUs first; each deploy then waits until its stack has settled.
        gpu_stacks = {stack.name: GpuStack(f"{name}-stack-{stack.name}", GpuStackArgs(
            stack_name=stack.name, content=stack.deployed, sha256=stack.sha256, manager=self._first_live,
            after=[*admitted, reconcile], rewrites=stack.info.rewrites, warnings=stack.info.warnings,
            diff=stack.info.diff, wait_seconds=stack.wait_seconds, swarm_id=swarm.cluster_id,
        ), opts=self._child) for stack in s.stacks}
        deployed: list[pulumi.Resource] = list(gpu_stacks.values())
        if s.monitoring.enabled:
            deployed.append(Monitoring(f"{name}-monitoring", MonitoringArgs(
                manager=self._first_live, manager_public_ip=self._reach.manager_address, ssh_user=s.ssh_user,
                images=dict(s.monitoring.images), after=[*admitted, reconcile], swarm_id=swarm.cluster_id,
            ), opts=self._child))
        health = SwarmHealth(f"{name}-health", SwarmHealthArgs(
            manager=self._first_live, node_ids=node_ids,
            each_up=s.health.inventory_each_up, after=[*admitted, reconcile, *deployed],
            elastic=bool(s.elastic_pools),
        ), opts=self._child)

        self.vpc_id = pulumi.Output.from_input(vpc_id)
        self.availability_zones = list(s.network.availability_zones)
        self.manager_public_ips = pulumi.Output.all(*[n.public_ip for n in managers.nodes])
        self.manager_private_ips = pulumi.Output.all(*manager_ips)
        self.ssh_commands = self._ssh_commands([node for node, _ in nodes])
        self.known_hosts = Access.known_hosts([node for node, _ in nodes])
        # One Output for the whole list, each node's health added in the same step: handing the
        # conditions of every node to each node's entry made the program's cost grow with the
        # square of the nodes, and an Output per node costs the SDK more than the entry does.
        values = [v for node, _ in nodes for v in self._inventory_values(node, members[node.name], rollouts[node.name])]
        width = len(values) // len(nodes)
        self.inventory = pulumi.Output.all(health.conditions, health.elastic_nodes, *values).apply(lambda v: [
            *({**self._inventory_entry(node, pool, v[2 + width * i:2 + width * (i + 1)]),
               "health": _health_entry((v[0] or {}).get(v[2 + width * i + 3]), health.read_at)}
              for i, (node, pool) in enumerate(nodes)),
            *(elastic_entry(e, s, self._kinds, health.read_at) for e in v[1] or [])])
        self.bootstrap_timings = pulumi.Output.all(*[boots[n.name].timings for n, _ in nodes]).apply(
            lambda timings: {node.name: t for (node, _), t in zip(nodes, timings)}
        )
        self.node_software = self._bundle.url.apply(lambda url: {"bundleSha256": self._bundle.sha256, "url": url})
        self.monitoring = deployed[-1].access if s.monitoring.enabled else pulumi.Output.from_input(
            {"enabled": False, "how": "pulumi config set gpu-swarm:monitoring true && pulumi up"})
        self.stack_tasks = pulumi.Output.all(**{n: st.tasks for n, st in gpu_stacks.items()}) if gpu_stacks \
            else pulumi.Output.from_input({})
        self.private_key = self._key.private_key if self._key.generated else None
        self.cost = self._cost.output()
        self.register_outputs({
            "cost": self.cost,
            "stack_tasks": self.stack_tasks,
            "vpc_id": self.vpc_id,
            "manager_public_ips": self.manager_public_ips,
            "manager_private_ips": self.manager_private_ips,
            "ssh_commands": self.ssh_commands,
            "known_hosts": self.known_hosts,
            "inventory": self.inventory,
            "bootstrap_timings": self.bootstrap_timings,
            "node_software": self.node_software,
            "monitoring": self.monitoring,
        })

    def _network(self):
        net = self._s.network
        if net.vpc_id:
            return net.vpc_id, list(net.subnet_ids), list(net.route_table_ids)
        network = Network(
            f"{self._name}-network",
            NetworkArgs(
                cidr_block=net.vpc_cidr,
                subnets=list(zip(net.availability_zones, net.subnet_cidrs)),
                tags=self._tags,
            ),
            opts=self._child,
        )
        return network.vpc_id, network.subnet_ids, network.route_table_ids

    def _kind(self, pool: GpuPool | None) -> _Kind:
        s = self._s
        gpu = pool is not None
        instance_type = pool.instance_type if gpu else s.managers.instance_type
        env = node_software.node_env(gpu=gpu, gpu_kind=s.gpu_kind, instance_type=instance_type,
                                     image=s.image if gpu else "ubuntu", slots_per_gpu=pool.slots_per_gpu if gpu else 0,
                                     shared_kind=s.shared_gpu_kind,
                                     sharing_mode=pool.sharing_mode if gpu else "time-slicing")
        env.update(node_software.efa_env(pool.efa_interfaces if gpu else 0))
        elastic = bool(gpu and pool.autoscale)
        if elastic:  # its nodes join by themselves (node/swarm_join.py)
            env.update(node_software.elastic_env(join_parameter_name(s.cluster_name, pool.name), aws.config.region,
                                                 pool.name))
        steps = tuple(node_software.bootstrap_steps(gpu=gpu, instance_type=instance_type,
                                                    efa=bool(gpu and pool.efa_interfaces), elastic=elastic))
        sha = self._bundle.sha256
        return _Kind(env=env, steps=steps, expected_gpus=pool.gpus_per_node if gpu else 0,
                     release_id=node_software.release(sha, env, list(steps)),
                     release=self._bundle.url.apply(lambda url: NodeRelease(url, sha, env, steps)))

    def _connection(self, node: Node, budget=LIVE):
        """Managers are reached directly; workers only through a live manager (see SecurityGroups).
        One Output per node and budget, which its commands share."""
        made = self._connections.get((node.name, budget))
        if made is None:
            made = self._connections[(node.name, budget)] = self._reach.to(node, budget)
        return made

    def _boot(self, node: Node, pool: GpuPool | None) -> NodeBoot:
        kind = self._kinds[node.pool]
        return NodeBoot(f"{self._name}-boot-{node.pool}-{node.index}", NodeBootArgs(
            node=self._connection(node, BOOT), node_live=self._connection(node), instance_id=node.instance_id,
            env=kind.env,
            expected_gpus=kind.expected_gpus, access_script=self._access, health_env=self._health_env(node),
            price_env=self._price_env(node, pool) if pool else None,
        ), opts=self._child)

    def _price_env(self, node: Node, pool: GpuPool) -> pulumi.Output[dict[str, str]]:
        """A GPU node's price, its zone's for spot, for the metrics exporter to share between its GPUs: on the
        market its instance was launched on, which a running node keeps when its pool's marketType changes."""
        zone = node_zone(pool, self._s.network.availability_zones, node.index)
        envs = {lifecycle: node_software.price_env(price.per_hour, market=market, date=price.date,
                                                   instance_type=pool.instance_type, gpus=pool.gpus_per_node)
                for lifecycle, (market, price) in self._cost.launched_prices(pool, zone).items()}
        pool_market = envs["spot" if pool.spot else ""][node_software.PRICE_MARKET_ENV]

        def env(lifecycle: str | None) -> dict[str, str]:
            chosen = envs.get(lifecycle or "", envs[""])
            if chosen[node_software.PRICE_MARKET_ENV] != pool_market:
                pulumi.log.warn(f"{node.name} runs {chosen[node_software.PRICE_MARKET_ENV]}, as it was launched: "
                                f"pool {pool.name}'s marketType reaches new and replaced nodes only, so its price "
                                f"file says {chosen[node_software.PRICE_MARKET_ENV]} and the cost table, which "
                                f"prices the pool's setting, does not count it so (pulumi up --replace moves it)")
            return chosen
        return node.instance.instance_lifecycle.apply(env)

    def _pool_image(self, name: str, pool: GpuPool) -> pulumi.Input[str]:
        """The image a GPU pool's nodes launch from: the "latest" its first `up` found, kept in an SSM parameter of
        the pool's (it keeps its value when "latest" moves: ignore_changes), so that a node made or replaced a
        month later boots the driver branch of its pool, not the AMI's newest. A custom AMI is the operator's
        own choice, used as it is. To move a pool to the image's newest release, replace the parameter
        (`pulumi up --replace` with its URN): new nodes take it, and a roll by replacement moves the others."""
        s = self._s
        if not s.ami_from_ssm:
            return s.gpu_ami_id
        pinned = aws.ssm.Parameter(
            f"{name}-{pool.name}-image", name=f"/{PROJECT}/{s.cluster_name}/{pool.name}/ami-id", type="String",
            # insecure_value: an AMI id is no secret (value is marked one, and would make every node's inputs secret).
            data_type="aws:ec2:image", insecure_value=s.gpu_ami_id, description=f"the AMI of pool {pool.name}'s nodes",
            tags={**self._tags, "Name": f"{name}-{pool.name}-image"},
            # delete_before_replace: its name is fixed, and the provider's create refuses a name that exists
            # (PutParameter without overwrite: ParameterAlreadyExists), so a replacement made first would fail.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["insecureValue"], delete_before_replace=True))
        return pinned.insecure_value

    def _health_env(self, node: Node) -> dict[str, str]:
        """The health settings, and a capacity-block node's block end: an extended block restarts its watcher
        (components/node_boot.py writes it apart from the release), and drains nothing."""
        pool = next((p for p in self._s.gpu_pools if p.name == node.pool), None)
        end = {CAPACITY_BLOCK_END_ENV: pool.capacity_block_end} if pool and pool.capacity_block_end else {}
        return {**self._s.health.node_env(), **end}

    def _membership(self, node: Node, swarm: SwarmInit, boot: NodeBoot, manager_ips) -> Membership:
        manager = node.role == "manager"
        return Membership(f"{self._name}-member-{node.pool}-{node.index}", MembershipArgs(
            role=node.role,
            node=self._connection(node),
            manager_addresses=manager_ips,
            advertise_address=node.private_ip,
            instance_id=node.instance_id,
            cluster_id=swarm.cluster_id,
            join_token=swarm.manager_token if manager else swarm.worker_token,
            after=[boot.booted, swarm.tokens],
        ), opts=self._child)

    def _rollout(self, node: Node, pool: GpuPool | None, member: Membership, boot: NodeBoot, after) -> NodeRollout:
        kind = self._kinds[node.pool]
        return NodeRollout(f"{self._name}-rollout-{node.pool}-{node.index}", NodeRolloutArgs(
            pool=node.pool, release=kind.release, release_id=kind.release_id, node=self._connection(node),
            manager=self._first_live, node_id=member.node_id, ran_release=boot.ran_release,
            # gpu-swarm.spot as the instance runs (instanceLifecycle), which a pool's move does not change.
            labels={POOL_LABEL: "managers"} if pool is None else node.instance.instance_lifecycle.apply(
                lambda lifecycle, p=pool: pool_labels(p, spot=lifecycle == "spot")),
            expected_gpus=kind.expected_gpus, kind=self._s.gpu_kind,
            slots_per_gpu=pool.slots_per_gpu if pool else 0, shared_kind=self._s.shared_gpu_kind,
            check=GpuCheck() if pool else None, after=after,
        ), opts=self._child)

    def _ssh_commands(self, nodes: list[Node]) -> pulumi.Output[dict[str, str]]:
        # Workers take SSH only from the managers: hop through the live manager.
        return self._reach.ssh_commands(nodes)

    @staticmethod
    def _inventory_values(node: Node, member: Membership, rollout: NodeRollout) -> tuple:
        """What a node's entry needs from its resources; the swarm node id fourth (its health's key)."""
        return (node.instance.instance_type, node.private_ip, node.public_ip, member.node_id,
                rollout.advertised_gpus, rollout.gpus_verified)

    def _inventory_entry(self, node: Node, pool: GpuPool | None, v: list) -> dict:
        """The node's entry, all but its health (see __init__), from its _inventory_values."""
        return {
            "name": node.name,
            "role": node.role,
            "pool": node.pool,
            "instanceType": v[0],
            "privateIp": v[1],
            "publicIp": v[2],
            "swarmNodeId": v[3],
            "gpusExpected": pool.gpus_per_node if pool else 0,
            "gpusAdvertised": v[4],
            # The post-join check: a task reserving them saw exactly these GPUs, one reserving
            # none saw none. Its evidence is in the result when it failed.
            "gpusVerified": (v[5] or {}).get("verified") if pool else None,
            "slotsPerGpu": pool.slots_per_gpu if pool else 0,
            "release": self._kinds[node.pool].release_id[:12],
        }


def elastic_entry(seen: dict, s: Settings, kinds: dict, read_at: str | None) -> dict:
    """An elastic pool's node, as the swarm said at this `pulumi up` (the scaler adds and removes them)."""
    pool = next((p for p in s.elastic_pools if p.name == seen.get("pool")), None)
    shown = s.shared_gpu_kind if pool and pool.slots_per_gpu else s.gpu_kind
    release = kinds[pool.name].release_id if pool else ""
    return {"name": seen.get("hostname"), "role": "worker", "pool": seen.get("pool"), "elastic": True,
            "instanceId": seen.get("instance"), "instanceType": pool.instance_type if pool else None,
            "privateIp": seen.get("addr"), "publicIp": None, "swarmNodeId": seen.get("id"),
            "gpusExpected": pool.gpus_per_node if pool else 0,
            "gpusAdvertised": advertised_gpus(json.dumps(seen.get("resources") or []), shown),
            # Its admit's GPU check proved this release's GPUs (swarm/gpu_check.py labels the node so).
            "gpusVerified": bool(release) and seen.get("verified") == release,
            "slotsPerGpu": pool.slots_per_gpu if pool else 0, "release": (seen.get("software") or "")[:12],
            "health": _health_entry(seen, read_at)}


def _health_entry(seen: dict | None, read_at: str | None) -> dict:
    """As the swarm saw it at this `pulumi up` (health.inventoryEachUp) or when the nodes last
    changed: the watcher's condition, and what the reconciler did."""
    seen = seen or {}
    return {"condition": seen.get("condition"), "reason": seen.get("reason"), "gpu": seen.get("gpu"),
            "availability": seen.get("availability"), "state": seen.get("state"),
            "drainedBy": seen.get("drainedBy"), "lastAction": seen.get("healthLast"), "readAt": read_at}

