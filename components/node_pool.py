"""A pool of identical EC2 instances: the managers, or the nodes of one GPU pool.

Each node is generated an SSH host key here (pulumi-tls, ed25519) and boots with it from its
user data (cloud-init ssh_keys), so every connection of the program can pin it from the
first dial (components/remote.py) instead of trusting whoever answers. What that costs: the
node's private host key is in its user data, which anyone allowed ec2:DescribeInstanceAttribute
on it can read, and which root on the node (and any process that reaches IMDS: containers on
bridge and overlay networks cannot, the hop limit is 1) can read again; and it is in the Pulumi
state, encrypted as a secret. Someone who reads it can pose as that node only to a client on a
path they control. The alternatives were worse: the console output arrives minutes late and
needs the AWS CLI on the operator's machine, and learning the key on first use trusts exactly
the answer a pinned key is meant to check.

Managers (and EFA nodes, which AWS gives no automatic public address) get an Elastic IP:
their address survives a stop and start, a resize and a replacement, so no connection to them
changes, and so no command on them runs again for an address. It is associated with the
instance's primary network interface: EC2 takes an instance id only for an instance with one
interface, and a multi-card EFA node has one per card. Other workers keep the automatic address
they boot with; a stop loses it, and the refresh after reads associatePublicIpAddress false
(terraform-provider-aws#33775), an input that would replace the node: running nodes keep that
input (provider_facts.py), and nothing dials a worker at its public address.

A spot pool with `interruption: stop` has persistent requests, made by RunInstances with the
node's own launch arguments (metadata options, root volume tags, EFA template): the legacy
RequestSpotInstances behind aws.ec2.SpotInstanceRequest drops all three (terraform-provider-aws
#25896, #35883), and its resource leaves the state when AWS ends the request, so the next `up`
launched a second instance beside the first. A persistent request outlives a terminated instance and
launches another; the provider's delete of aws.ec2.Instance cancels the request first
(components/provider_facts.py), and the request's end date is years ahead (components/capacity.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws
import pulumi_tls as tls

from components.cloud_config import HostKey, render_cloud_config
from components.efa import efa_launch_template
from components.provider_facts import INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES
from to_node.software import NodeRelease
from settings.aws_lookups import POOL_TAG, ROLE_TAG


@dataclass
class NodePoolArgs:
    role: str  # "manager" or "worker"
    pool: str  # the pool's name: a node label, and part of every node's name
    instance_type: pulumi.Input[str]
    count: int  # plain: it decides how many instances exist
    ami_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]  # new nodes go round-robin over them
    security_group_ids: Sequence[pulumi.Input[str]]
    key_name: pulumi.Input[str]
    release: pulumi.Input[NodeRelease]  # what a new node boots with (its #cloud-config); running nodes keep theirs
    root_volume_gib: pulumi.Input[int]
    node_name_prefix: str
    imds_hop_limit: pulumi.Input[int] = 1
    # Capacity (components/capacity.py): spot or a Capacity Block, and a reservation to run in.
    market: pulumi.Input[aws.ec2.InstanceInstanceMarketOptionsArgs] | None = None
    capacity: pulumi.Input[aws.ec2.InstanceCapacityReservationSpecificationArgs] | None = None
    spot: bool = False
    placement_group: pulumi.Input[str] | None = None  # a reservation's own cluster placement group
    cluster_placement: bool = False  # a cluster placement group of the pool's own
    efa_interfaces: int = 0  # > 0: a launch template with that many EFA interfaces (components/efa.py)
    stable_address: bool = False  # an Elastic IP per node
    iam_instance_profile: pulumi.Input[str] | None = None  # the managers', with elastic pools: their scaler's role
    error_hook: pulumi.ErrorHook | None = None  # says what to try when AWS has no capacity
    # Managers hold the swarm's Raft quorum: change them one after the other (a resize
    # stops and starts each), never all at once.
    one_at_a_time: bool = False
    # Created after these: the SSH rules, so that an operator whose address changed can reach
    # the nodes within the same `pulumi up` that lets that address in.
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    pool: str
    index: int
    instance: aws.ec2.Instance
    host_key: pulumi.Output[str]  # its public SSH host key, "ssh-ed25519 AAAA..."
    stable_ip: pulumi.Output[str] | None = None  # its Elastic IP, once associated

    @property
    def instance_id(self) -> pulumi.Output[str]:
        return self.instance.id

    @property
    def private_ip(self) -> pulumi.Output[str]:
        return self.instance.private_ip

    @property
    def public_ip(self) -> pulumi.Output[str]:
        return self.stable_ip if self.stable_ip is not None else self.instance.public_ip


class NodePool(pulumi.ComponentResource):
    nodes: list[Node]

    def __init__(self, name: str, args: NodePoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:NodePool", name, None, opts)
        if args.role not in ("manager", "worker"):
            raise ValueError(f"role must be 'manager' or 'worker', got {args.role!r}")
        if args.efa_interfaces and len(args.subnet_ids) != 1:
            raise ValueError("an EFA pool has one subnet: EFA traffic does not leave it")
        child = pulumi.ResourceOptions(parent=self)

        # A GPU node gets a new type by replacement, not by the provider's in-place resize: the
        # engine resizes an instance when it reaches it, before any command of the node's, so every
        # node of the pool would stop at once, undrained. A replacement is created first (with the
        # program's current inputs), joins and is admitted one node per pool at a time like any new
        # node; the reconcile then drains the old nodes one by one, and the engine deletes their
        # instances last. (A one-time spot instance cannot be stopped, so it could not be resized
        # anyway.) Managers keep the in-place resize, one at a time: replacing the first manager
        # would make a new swarm.
        replace_on = ["instanceType"] if args.role == "worker" or args.spot else []
        group = args.placement_group
        if args.cluster_placement:
            group = aws.ec2.PlacementGroup(f"{name}-placement", strategy="cluster",
                                           tags={**args.tags, "Name": f"{name}-placement"}, opts=child).name
        template = None
        if args.efa_interfaces:
            template = efa_launch_template(name, args.efa_interfaces, args.subnet_ids[0], args.security_group_ids,
                                           args.tags, self)
        hooks = pulumi.ResourceHookBinding(on_error=[args.error_hook]) if args.error_hook else None

        self.nodes = []
        previous: list[pulumi.Resource] = []
        for i in range(args.count):
            node_name = f"{args.node_name_prefix}-{i}"
            tags = {**args.tags, "Name": node_name, ROLE_TAG: args.role, POOL_TAG: args.pool}
            key = tls.PrivateKey(f"{name}-{i}-host-key", algorithm="ED25519", opts=child)
            # Secret in the state: it holds the node's private host key.
            user_data = pulumi.Output.secret(pulumi.Output.all(
                args.release, key.private_key_openssh, key.public_key_openssh).apply(
                lambda v: render_cloud_config(v[0], HostKey(v[1], v[2]))))
            # An EFA node's interfaces, subnet and groups are its template's (RunInstances takes them
            # from one place only).
            network = {} if template else dict(
                subnet_id=args.subnet_ids[i % len(args.subnet_ids)],
                vpc_security_group_ids=list(args.security_group_ids),
                # Egress without a NAT gateway; inbound is closed by the security groups.
                associate_public_ip_address=True,
            )
            launch = dict(
                ami=args.ami_id,
                instance_type=args.instance_type,
                key_name=args.key_name,
                user_data=user_data,
                user_data_replace_on_change=False,
                metadata_options=aws.ec2.InstanceMetadataOptionsArgs(
                    http_endpoint="enabled",
                    http_tokens="required",
                    # 1: a container behind a bridge or overlay is one hop too far for IMDS,
                    # so it cannot take the instance role's credentials.
                    http_put_response_hop_limit=args.imds_hop_limit,
                ),
                root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
                    encrypted=True,
                    volume_type="gp3",
                    volume_size=args.root_volume_gib,
                    delete_on_termination=True,
                    tags=tags,
                ),
                capacity_reservation_specification=args.capacity,
                iam_instance_profile=args.iam_instance_profile,
                placement_group=group,
                launch_template=aws.ec2.InstanceLaunchTemplateArgs(
                    id=template.id, version=template.latest_version.apply(str)) if template else None,
                tags=tags,
                **network,
            )
            options = pulumi.ResourceOptions(
                parent=self,
                # Inputs that a running node keeps when they change (a new AMI release, a
                # rotated key, another zone list, new user data, another market, reservation
                # or placement, the address a stop took): only new or replaced nodes take them.
                # components/provider_facts.py.
                ignore_changes=list(INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES),
                replace_on_changes=replace_on,
                depends_on=[*args.after, *(previous if args.one_at_a_time else [])],
                hooks=hooks,
                custom_timeouts=launch_timeouts(args.instance_type),
            )
            instance = aws.ec2.Instance(f"{name}-{i}", instance_market_options=args.market, **launch, opts=options)
            if args.one_at_a_time:
                previous = [instance]
            stable_ip = self._address(f"{name}-{i}", instance, tags, hooks) if args.stable_address else None
            self.nodes.append(Node(node_name, args.role, args.pool, i, instance, key.public_key_openssh, stable_ip))

        self.register_outputs(
            {
                "names": [n.name for n in self.nodes],
                "private_ips": [n.private_ip for n in self.nodes],
                "public_ips": [n.public_ip for n in self.nodes],
            }
        )

    def _address(self, name: str, instance: aws.ec2.Instance,
                 tags: Mapping, hooks: pulumi.ResourceHookBinding | None) -> pulumi.Output[str]:
        """An Elastic IP for the node: the same address across stop/start, resize and replacement."""
        # The pool's error hook: AllocateAddress is where AddressLimitExceeded comes.
        eip = aws.ec2.Eip(f"{name}-ip", domain="vpc", tags=tags, opts=pulumi.ResourceOptions(parent=self, hooks=hooks))
        # A replaced instance gets the same address: the old association goes first.
        # Through the primary interface: EC2 refuses an instance id when the instance has more than one.
        association = aws.ec2.EipAssociation(
            f"{name}-ip-association", allocation_id=eip.allocation_id,
            network_interface_id=instance.primary_network_interface_id,
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True))
        # Through the association, so that whoever connects waits until the address is the node's.
        return pulumi.Output.all(eip.public_ip, association.id).apply(lambda v: v[0])


# How long the provider waits for AWS, per instance family, before it fails the step (its own
# default: 10 minutes to create, 10 to update, 20 to delete). A P instance (p4d, p5, p6) brings
# up 4 to 32 network cards and, on a resize, stops and starts with them: 10 minutes is a tight
# bound there, and a timeout fails `pulumi up` while AWS goes on launching. G gets some room.
LAUNCH_MINUTES = {"p": 45, "g": 20}


def launch_timeouts(instance_type: pulumi.Input[str]) -> pulumi.CustomTimeouts | None:
    family = instance_type.split(".")[0] if isinstance(instance_type, str) else ""
    minutes = LAUNCH_MINUTES.get(family[:1]) if family[:1] in LAUNCH_MINUTES and family[1:2].isdigit() else None
    if minutes is None:
        return None
    return pulumi.CustomTimeouts(create=f"{minutes}m", update=f"{minutes}m", delete=f"{minutes}m")
