"""Checks of the configuration against AWS: instance types, zones, subnets and images.

They run synchronous invokes (settings/aws_lookups.py), so a bad value stops `pulumi preview`
before the first resource is registered.
"""
from __future__ import annotations

import dataclasses
import ipaddress

import pulumi

from settings import aws_lookups
from to_node import software as node_software
from settings.config_checks import PoolConfig
from settings.model import Managers, Network, cluster_name
from settings.reader import Reader, key

def resolve_instance_types(r: Reader, managers_type: str | None, pools: list[PoolConfig]) -> dict:
    facts = {}
    wanted = ([("managerInstanceType", managers_type)] if managers_type else []) + [
        (f"gpuPools[{p.index}].instanceType", p.instance_type) for p in pools
    ]
    for name, instance_type in wanted:
        if instance_type not in facts:
            try:
                facts[instance_type] = aws_lookups.describe_instance_type(instance_type)
            except LookupError as exc:
                facts[instance_type] = None
                r.error(name, f"AWS does not describe {instance_type!r} in this region ({exc}); "
                              "check the name and the region")
                continue
        found = facts[instance_type]
        if found is None:
            continue
        if "x86_64" not in found.architectures:
            arch = "/".join(found.architectures) or "not x86_64"
            r.error(name, f"{instance_type} is {arch}; the node images are x86_64, so choose an x86_64 type")
    for p in pools:
        found = facts.get(p.instance_type)
        if found is not None and found.nvidia_gpus == 0:
            has = f"has {found.other_gpus}, not an NVIDIA GPU" if found.other_gpus else "has no NVIDIA GPU"
            r.error(
                f"gpuPools[{p.index}].instanceType",
                f"{p.instance_type} {has}; choose an NVIDIA GPU type such as g6.xlarge, g6e.12xlarge or p5.48xlarge",
            )
    return facts


def resolve_network(r: Reader, cfg: dict, instance_types: list[str]) -> Network | None:
    """The cluster's subnets: an existing VPC's, or zones for the VPC the program makes.

    Zones are chosen once and kept: the subnets this cluster already has stay (a subnet with
    instances in it cannot be deleted), whatever the zone list or the instance types become.
    New nodes go to the active zones: availabilityZones when set, else the kept ones, else (a
    new cluster) every zone that offers all the instance types. Each pool then takes those of
    them that offer its type (settings/pool_placement.py).
    """
    if not instance_types or ("vpc_cidr" not in cfg and "vpc_id" not in cfg):
        return None
    if "vpc_id" in cfg:
        zones = []
        for subnet_id in cfg["subnet_ids"]:
            try:
                subnet = aws_lookups.describe_subnet(subnet_id)
            except LookupError as exc:
                r.error("subnetIds", f"{subnet_id}: AWS does not describe it ({exc}); check the id and the region")
                continue
            if subnet.vpc_id != cfg["vpc_id"]:
                r.error("subnetIds", f"{subnet_id} is in {subnet.vpc_id}, not in {key('vpcId')} {cfg['vpc_id']}")
            zones.append(subnet.availability_zone)
        if len(zones) != len(cfg["subnet_ids"]):
            return None
        return _existing_vpc_routes(r, Network(availability_zones=tuple(zones), vpc_id=cfg["vpc_id"],
                                               subnet_ids=tuple(cfg["subnet_ids"])), cfg.get("s3_endpoint_id"))
    try:
        region_zones = aws_lookups.available_zones()
        kept = aws_lookups.cluster_subnet_zones(cluster_name())
    except LookupError as exc:
        r.error("availabilityZones", f"could not list this region's zones or the cluster's subnets ({exc})")
        return None
    if cfg["zones"]:
        active = []
        for zone in cfg["zones"]:
            if zone not in region_zones:
                r.error("availabilityZones",
                        f"{zone} is not an available zone of this region ({', '.join(region_zones)})")
            else:
                active.append(zone)
        active = sorted(set(active))
        if len(active) != len(set(cfg["zones"])):
            return None
    elif kept:
        active = sorted(kept)
    else:
        try:
            offered = aws_lookups.zones_offering(instance_types)
        except LookupError as exc:
            r.error("gpuPools", f"could not list where the instance types are offered ({exc})")
            return None
        active = [z for z in region_zones if all(z in offered.get(t, ()) for t in instance_types)]
        if not active:
            where = "; ".join(f"{t}: {', '.join(sorted(offered.get(t, ()))) or 'nowhere'}" for t in instance_types)
            r.error(
                "gpuPools",
                f"no availability zone of this region offers all of {', '.join(instance_types)} ({where}); "
                f"choose instance types offered in a common zone, or name zones in {key('availabilityZones')}: each "
                "pool then uses those of them that offer its type",
            )
            return None
        pulumi.log.info(
            f"nodes go to {', '.join(active)}, the zones that offer every instance type; the cluster keeps them "
            f"(a new pool whose type is offered in fewer zones uses those of them that offer it)"
        )
    left = sorted(set(kept) - set(active))
    if left:
        pulumi.log.info(f"the subnets in {', '.join(left)} stay (nodes may run there); new nodes go to "
                        f"{', '.join(active)}")
    zones = sorted(set(active) | set(kept))
    net = ipaddress.ip_network(cfg["vpc_cidr"])
    slots = list(net.subnets(prefixlen_diff=4))
    # Each zone keeps the slot of its letter, so adding or dropping a zone never renumbers the others.
    cidrs = tuple(str(slots[ord(z[-1]) - ord("a")]) for z in zones)
    return Network(availability_zones=tuple(zones), vpc_cidr=cfg["vpc_cidr"], subnet_cidrs=cidrs,
                   active_zones=tuple(active))


def _existing_vpc_routes(r: Reader, network: Network, endpoint_id: str | None) -> Network | None:
    """The route tables of an existing VPC's subnets, and the S3 gateway endpoint that serves them.

    Nodes download the node software from S3 through a gateway endpoint (the bucket admits
    nothing else). A route table takes one gateway endpoint per service: with the VPC's own
    (s3GatewayEndpointId), it must serve every subnet's table; without, the program makes one.
    """
    import pulumi_aws as aws

    tables = []
    for subnet_id in network.subnet_ids:
        try:
            tables.append(aws_lookups.route_table_of(subnet_id, network.vpc_id))
        except LookupError as exc:
            r.error("subnetIds", f"{subnet_id}: no route table found for it ({exc}); subnets must be routed")
    tables = list(dict.fromkeys(tables))
    if not tables:
        return None
    if endpoint_id:
        try:
            vpc, service, kind, served = aws_lookups.vpc_endpoint(endpoint_id)
        except LookupError as exc:
            r.error("s3GatewayEndpointId", f"{endpoint_id}: AWS does not describe it ({exc}); check the id and the region")
            return None
        wanted = f"com.amazonaws.{aws.config.region}.s3"
        if (vpc, service, kind) != (network.vpc_id, wanted, "Gateway"):
            r.error("s3GatewayEndpointId", f"{endpoint_id} is a {kind} endpoint for {service} in {vpc}; expected the "
                                           f"Gateway endpoint for {wanted} in {network.vpc_id}")
            return None
        missing = [t for t in tables if t not in served]
        if missing:
            r.error("s3GatewayEndpointId", f"{endpoint_id} does not serve the route table(s) {', '.join(missing)} of "
                                           f"{key('subnetIds')}, so nodes there could not download the node software. "
                                           f"Add them: aws ec2 modify-vpc-endpoint --vpc-endpoint-id {endpoint_id} "
                                           f"--add-route-table-ids {' '.join(missing)}")
            return None
    return dataclasses.replace(network, route_table_ids=tuple(tables), s3_endpoint_id=endpoint_id or None)


def resolve_amis(r: Reader, image: str, ami_id: str | None, managers: Managers | None, pools: list[PoolConfig]):
    """The managers' and the GPU nodes' AMI ids, checked against the root volume sizes."""
    try:
        manager_ami = aws_lookups.ssm_parameter(aws_lookups.UBUNTU_AMI_PARAMETER)
        if image == "custom":
            gpu_ami = ami_id
        elif image == "deep-learning":
            gpu_ami = aws_lookups.ssm_parameter(aws_lookups.DEEP_LEARNING_AMI_PARAMETER)
        else:
            gpu_ami = manager_ami
    except LookupError as exc:
        r.error("image", f"could not resolve the {image} AMI from its public SSM parameter ({exc})")
        return None, None
    try:
        gpu_facts = aws_lookups.describe_ami(gpu_ami)
        manager_facts = gpu_facts if gpu_ami == manager_ami else aws_lookups.describe_ami(manager_ami)
    except LookupError as exc:
        name = "amiId" if image == "custom" else "image"
        r.error(name, f"AWS does not describe {gpu_ami} in this region ({exc}); check the id and the region")
        return None, None
    if gpu_facts.architecture != "x86_64":
        r.error("amiId", f"{gpu_ami} is {gpu_facts.architecture}; the GPU nodes need an x86_64 image")
    if image == "deep-learning":
        for p in pools:
            if p.valid and node_software.kernel_modules(p.instance_type) == "proprietary":
                # The Base OSS AMI ships NVIDIA's open kernel module only (driver 595 in late 2026), which drives
                # Turing and newer; R580 is the last branch for Maxwell, Pascal and Volta (NVIDIA's release notes).
                r.error(f"gpuPools[{p.index}].instanceType",
                        f"{p.instance_type}'s GPUs need NVIDIA's proprietary kernel module, and the Deep Learning "
                        "Base OSS AMI has only the open one, whose driver no longer drives them; set image ubuntu "
                        "(driver branch 580, with the proprietary module), or choose a Turing or newer type "
                        "(g4dn and later)")
    for p in pools:
        if p.valid and p.autoscale and gpu_facts.root_device != ELASTIC_ROOT_DEVICE:
            # A launch template sizes and encrypts the root volume by its device name (an instance's
            # root_block_device needs none); Ubuntu's and the Deep Learning AMI's is this one.
            r.error("amiId" if image == "custom" else "image",
                    f"{gpu_ami}'s root device is {gpu_facts.root_device or 'unknown'}, and an elastic pool's launch "
                    f"template sets up {ELASTIC_ROOT_DEVICE} (as Ubuntu images have it); use such an image, or "
                    f"give gpuPools[{p.index}] a count instead of autoscale")
        if p.valid and p.root_volume_gib < gpu_facts.root_snapshot_gib:
            r.error(
                f"gpuPools[{p.index}].rootVolumeGiB",
                f"{p.root_volume_gib} GiB is smaller than the {image} image's {gpu_facts.root_snapshot_gib} GiB "
                f"snapshot; use at least {gpu_facts.root_snapshot_gib}",
            )
    if managers and managers.root_volume_gib < manager_facts.root_snapshot_gib:
        r.error(
            "managerRootVolumeGiB",
            f"{managers.root_volume_gib} GiB is smaller than the Ubuntu image's "
            f"{manager_facts.root_snapshot_gib} GiB snapshot; use at least {manager_facts.root_snapshot_gib}",
        )
    return manager_ami, gpu_ami


ELASTIC_ROOT_DEVICE = "/dev/sda1"


def region_problem(r: Reader) -> bool:
    import pulumi_aws as aws

    if aws.config.region:
        return False
    r.problems.append("aws:region: not set; run pulumi config set aws:region us-east-1 (or your region)")
    return True




def check_overlay_pool(r: Reader, pool: str, cfg: dict) -> None:
    """Overlay networks must not overlap the VPC: traffic to those addresses would stay in the overlay."""
    if "vpc_id" in cfg:
        try:
            vpc_ranges = aws_lookups.vpc_cidrs(cfg["vpc_id"])
        except LookupError as exc:
            r.error("vpcId", f"{cfg['vpc_id']}: AWS does not describe it ({exc}); check the id and the region")
            return
        where = f"the VPC {cfg['vpc_id']}"
    elif "vpc_cidr" in cfg:
        vpc_ranges, where = (cfg["vpc_cidr"],), f"{key('vpcCidr')}"
    else:
        return
    nets = [ipaddress.ip_network(c) for c in vpc_ranges]
    clash = [str(n) for n in nets if n.overlaps(ipaddress.ip_network(pool))]
    if clash:
        free = next((c for x in range(200, 0, -1)
                     if not any((c := ipaddress.ip_network(f"10.{x}.0.0/16")).overlaps(n) for n in nets)), None)
        hint = f", e.g. {free}" if free else ""
        r.error("overlayAddressPool", f"{pool} overlaps {', '.join(clash)} of {where}: containers could not reach "
                                      f"those VPC addresses. Choose a range outside the VPC{hint}")
