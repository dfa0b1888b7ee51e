"""An elastic GPU pool: an EC2 Auto Scaling group whose nodes boot the pool's user data and join by themselves.

Why an Auto Scaling group, not EC2 Fleet: the group keeps a desired capacity by itself (it replaces a
reclaimed spot node or a failed instance without any `pulumi up`), terminates one chosen instance with
its desired capacity decremented in one call (TerminateInstanceInAutoScalingGroup, which the scaler needs
to remove exactly the idle node), and protects its instances from every other scale-in; an `instant`
fleet keeps nothing, and a `maintain` fleet has no call that removes one chosen instance and lowers its
target at once.

What the group is given, and why:
- its launch template carries the pool's release, rendered by the same function a fixed node's user data
  is (components/cloud_config.py), plus the pool's join settings in node.env and the join-swarm step last;
- no SSH host key in it: one template serves every node of the pool, so a key there would be every node's
  key, readable by anyone who may describe the template. Each node makes its own at first boot, and the
  program never connects to an elastic node: the leader admits it through the swarm (node/swarm_scaler.py);
- desired capacity `min` at creation and ignored afterwards (ignore_changes): the scaler owns it;
- scale-in protection on every instance, and the AZRebalance process suspended: the group then terminates
  only what the scaler names. A decrement can leave the zones unbalanced, and rebalancing would terminate
  a node in another zone, one that may run a GPU task (API reference, TerminateInstanceInAutoScalingGroup);
  protection does not stop the scaler's own call (User Guide, "Use instance scale-in protection");
- no instance refresh: it terminates instances without draining their swarm tasks, and waits on protected
  ones. A node of an older release is replaced by the scaler once it is idle, maxUnavailable at a time;
- the join: the swarm's worker token and the managers' addresses in an SSM SecureString parameter that the
  pool's instance role, and no other role of the cluster, may read. It is encrypted with the account's
  aws/ssm key, which any principal of the account may use to decrypt (Systems Manager User Guide,
  "Restricting decryption of SecureString parameter values"): what keeps it is ssm:GetParameter on its
  ARN. Only root on a node reaches IMDS, where the role's credentials are (node/imds-root-only.sh). A new
  token (rotation) is a new value, which nodes that boot afterwards read.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws

from components.cloud_config import render_cloud_config
from settings import GpuPool
from settings.aws_checks import ELASTIC_ROOT_DEVICE
from settings.aws_lookups import POOL_TAG, ROLE_TAG
from swarm.node_contract import JOIN_DOCUMENT_KEYS
from to_node.software import NodeRelease

EC2_TRUST = json.dumps({"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]})
# What the scaler on the managers may do to its pools' groups, and the one call that takes no resource.
SCALER_GROUP_ACTIONS = ("autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup")
SCALER_DESCRIBE = ("autoscaling:DescribeAutoScalingGroups",)  # Describe* take no resource-level condition


def group_name(cluster: str, pool: str) -> str:
    """The group's name: the managers' policy and their scaler's settings name it."""
    return f"{cluster}-{pool}"


def join_parameter_name(cluster: str, pool: str) -> str:
    return f"/gpu-swarm/{cluster}/{pool}/join"


def join_document(token: str, managers: list[str], cluster_id: str) -> str:
    """The join parameter's value (node/swarm_join.py reads it)."""
    return json.dumps(dict(zip(JOIN_DOCUMENT_KEYS, (token, list(managers), cluster_id))))


def instance_role(name: str, tags: Mapping, parent: pulumi.Resource) -> tuple[aws.iam.Role, aws.iam.InstanceProfile]:
    child = pulumi.ResourceOptions(parent=parent)
    role = aws.iam.Role(f"{name}-role", assume_role_policy=EC2_TRUST, tags={**tags, "Name": f"{name}-role"},
                        opts=child)
    profile = aws.iam.InstanceProfile(f"{name}-profile", role=role.name, tags={**tags, "Name": f"{name}-profile"},
                                      opts=child)
    return role, profile


def scaler_policy(group_arns: list[str]) -> str:
    """The managers' role: describe every group (that call takes no resource), change only their pools'."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "DescribeGroups", "Effect": "Allow", "Action": list(SCALER_DESCRIBE), "Resource": "*"},
        {"Sid": "ScaleOwnPools", "Effect": "Allow", "Action": list(SCALER_GROUP_ACTIONS),
         "Resource": sorted(group_arns)}]})


def join_policy(parameter_arn: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "ReadOwnJoin", "Effect": "Allow", "Action": ["ssm:GetParameter"], "Resource": parameter_arn}]})


@dataclass
class ElasticPoolArgs:
    pool: GpuPool
    cluster_name: str
    release: pulumi.Input[NodeRelease]  # what its nodes boot: node.env with the join settings, join-swarm last
    ami_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]
    security_group_ids: Sequence[pulumi.Input[str]]
    key_name: pulumi.Input[str]
    join: pulumi.Input[str]  # secret: join_document()
    imds_hop_limit: int = 1
    market: pulumi.Input[aws.ec2.LaunchTemplateInstanceMarketOptionsArgs] | None = None
    capacity: pulumi.Input[aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs] | None = None
    placement_group: pulumi.Input[str] | None = None
    after: Sequence[pulumi.Resource] = field(default_factory=list)  # the swarm: nodes join it at once
    tags: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)


class ElasticPool(pulumi.ComponentResource):
    group: aws.autoscaling.Group
    group_name: str
    group_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ElasticPoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:aws:ElasticPool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        pool, scale = args.pool, args.pool.autoscale
        self.group_name = group_name(args.cluster_name, pool.name)
        node_tags = {**args.tags, "Name": self.group_name, ROLE_TAG: "worker", POOL_TAG: pool.name}

        parameter = aws.ssm.Parameter(
            f"{name}-join", name=join_parameter_name(args.cluster_name, pool.name), type="SecureString",
            value=pulumi.Output.secret(args.join), description=f"how pool {pool.name}'s nodes join the swarm",
            tags={**args.tags, "Name": f"{name}-join"}, opts=child)
        role, profile = instance_role(f"{name}-node", args.tags, self)
        aws.iam.RolePolicy(f"{name}-node-join", role=role.id, policy=parameter.arn.apply(join_policy), opts=child)

        template = aws.ec2.LaunchTemplate(
            f"{name}-template",
            description=f"gpu-swarm elastic pool {pool.name}",
            image_id=args.ami_id,
            instance_type=pool.instance_type,
            key_name=args.key_name,
            # No secret in it: no host key, and the join is fetched from SSM with the node's role.
            user_data=pulumi.Output.from_input(args.release).apply(
                lambda release: base64.b64encode(render_cloud_config(release).encode()).decode()),
            iam_instance_profile=aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=profile.arn),
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=args.imds_hop_limit),
            block_device_mappings=[aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name=ELASTIC_ROOT_DEVICE, ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    encrypted="true", volume_type="gp3", volume_size=pool.root_volume_gib,
                    delete_on_termination="true"))],
            # Egress without a NAT gateway, as a fixed worker's; the group picks each node's subnet.
            network_interfaces=[aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                device_index=0, associate_public_ip_address="true", delete_on_termination="true",
                security_groups=list(args.security_group_ids))],
            instance_market_options=args.market,
            capacity_reservation_specification=args.capacity,
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=node_tags)
                                for kind in ("instance", "volume")],
            tags={**args.tags, "Name": f"{name}-template"},
            opts=child)

        self.group = aws.autoscaling.Group(
            f"{name}-group",
            name=self.group_name,
            min_size=scale.min,
            max_size=scale.max,
            desired_capacity=scale.min,
            launch_template=aws.autoscaling.GroupLaunchTemplateArgs(
                id=template.id, version=template.latest_version.apply(str)),
            vpc_zone_identifiers=list(args.subnet_ids),
            placement_group=args.placement_group,
            protect_from_scale_in=True,
            suspended_processes=["AZRebalance"],
            health_check_type="EC2",
            # `pulumi destroy` (or removing the pool) terminates its nodes with it.
            force_delete=True,
            # The group's nodes boot and join in their own time: `up` does not wait for them.
            wait_for_capacity_timeout="0",
            tags=[aws.autoscaling.GroupTagArgs(key=k, value=v, propagate_at_launch=False)
                  for k, v in {**args.tags, "Name": self.group_name}.items()],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[parameter, *args.after],
                                        ignore_changes=["desiredCapacity"]))
        self.group_arn = self.group.arn
        self.register_outputs({"group": self.group_name, "group_arn": self.group_arn})


def template_market(pool: GpuPool) -> aws.ec2.LaunchTemplateInstanceMarketOptionsArgs | None:
    """Spot, one-time and terminated on interruption, as a group's instances must be; on-demand: None."""
    if not pool.spot:
        return None
    return aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
        market_type="spot", spot_options=aws.ec2.LaunchTemplateInstanceMarketOptionsSpotOptionsArgs(
            spot_instance_type="one-time", instance_interruption_behavior="terminate",
            max_price=pool.spot_max_price))


def template_capacity(pool: GpuPool, reservation_id: pulumi.Input[str] | None
                      ) -> aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs | None:
    """The pool's reservation (an id, checked and placed by components/capacity.py, or a group) or preference."""
    o = pool.options
    target = aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs
    if reservation_id is not None:
        return aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_target=target(capacity_reservation_id=reservation_id))
    if o.capacity_reservation:
        return aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_target=target(capacity_reservation_resource_group_arn=o.capacity_reservation))
    if o.capacity_preference:
        return aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_preference=o.capacity_preference)
    return None
