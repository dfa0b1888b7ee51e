"""The stack configuration, read once into frozen dataclasses and validated in one place.

load_settings() checks every `gpu-swarm:*` key (config_checks), then the values against AWS
(aws_checks, through aws_lookups) and the stack files against the cluster. It collects every
problem and raises one SettingsError that names each key and its fix, before a single
resource exists.
"""
from __future__ import annotations

import dataclasses

import pulumi

from settings import aws_lookups, reader
from settings.aws_checks import (check_overlay_pool, region_problem, resolve_amis, resolve_instance_types,
                                 resolve_network)
from settings.config_checks import (read_authorized_keys, read_image, read_managers, read_network, read_pools, read_ssh,
                                    read_ssh_cidrs)
from settings.cuda_checks import check_cuda, read_registry_credentials
from settings.model import PROJECT, GpuPool, Health, Managers, Monitoring, Network, Settings, SettingsError, StackFile
from settings.monitoring_checks import read_monitoring
from settings.model import cluster_name
from settings.pool_placement import place
from settings.pool_rollout import wave_size
from settings.quota_checks import check_quotas
from settings.reader import DEFAULTS, Reader, suggest
from settings.reservation_checks import check_reservations
from settings.stack_checks import check_stacks, read_stacks
from settings.swarm_checks import read_health, read_overlay_pool, read_shared_kind
from settings.tag_checks import read_tags
from swarm.gpu_kind import validate_kind

__all__ = ["DEFAULTS", "GpuPool", "Health", "Managers", "Monitoring", "Network", "Settings", "SettingsError", "StackFile",
           "load_settings"]


def load_settings() -> Settings:
    """Read and check the whole stack configuration; raise SettingsError listing every problem."""
    r = Reader()
    for unknown in sorted(r.project_keys() - set(DEFAULTS)):
        r.error(unknown, "is not a setting of this program" + suggest(unknown, DEFAULTS))

    cidrs = read_ssh_cidrs(r)
    kind = r.string("gpuKind")
    try:
        kind = validate_kind(kind)
        kind_ok = True
    except ValueError as exc:
        r.error("gpuKind", str(exc))
        kind_ok = False
    managers, manager_type_ok = read_managers(r)
    pools = read_pools(r)
    image, ami_id = read_image(r)
    network_cfg = read_network(r)
    tags = read_tags(r)
    ssh_user, public_key, private_key = read_ssh(r)
    hop_limit = r.integer("imdsHopLimit", 1, 64)
    stack_cfgs = read_stacks(r)
    overlay_pool = read_overlay_pool(r)
    shared_kind = read_shared_kind(r, kind if kind_ok else None)
    extra_keys = read_authorized_keys(r)
    health = read_health(r)
    monitoring = read_monitoring(r, [stack.name for stack in stack_cfgs])
    registry_credentials = read_registry_credentials(r)

    # Checks against AWS, for the values that passed the checks above.
    resolved_pools: list[GpuPool] = []
    network = manager_ami = gpu_ami = None
    if not region_problem(r):
        try:
            resolved_pools, managers, network, manager_ami, gpu_ami = _check_against_aws(
                r, managers, manager_type_ok, pools, network_cfg, overlay_pool, image, ami_id)
        except aws_lookups.PermissionMissing as exc:  # the checks against AWS stop here, and say why
            r.problems.append(str(exc))
            resolved_pools = []

    stacks = []
    if kind_ok and shared_kind and pools and len(resolved_pools) == len(pools):
        stacks = check_stacks(r, stack_cfgs, resolved_pools, kind, shared_kind)
        check_cuda(r, stacks, {s.name: s.index for s in stack_cfgs}, resolved_pools, image, registry_credentials)

    if r.problems:
        raise SettingsError(r.problems)
    assert network and managers and manager_ami and gpu_ami and shared_kind and health, \
        "every missing value has a problem"
    return Settings(
        cluster_name=cluster_name(),
        allowed_ssh_cidrs=cidrs,
        network=network,
        managers=managers,
        gpu_pools=tuple(resolved_pools),
        image=image,
        manager_ami_id=manager_ami,
        gpu_ami_id=gpu_ami,
        ami_from_ssm=image != "custom",
        gpu_kind=kind,
        stacks=tuple(stacks),
        tags=tags,
        ssh_user=ssh_user,
        ssh_public_key=public_key,
        ssh_private_key=private_key,
        imds_hop_limit=hop_limit,
        overlay_address_pool=overlay_pool,
        ssh_authorized_keys=extra_keys,
        shared_gpu_kind=shared_kind,
        health=health,
        monitoring=monitoring,
    )


def _check_against_aws(r: Reader, managers, manager_type_ok: bool, pools, network_cfg: dict, overlay_pool,
                       image, ami_id):
    """The values that passed the checks above, checked against AWS: (pools, managers, network, AMIs)."""
    resolved_pools: list[GpuPool] = []
    network = manager_ami = gpu_ami = None
    manager_type = r.string("managerInstanceType") if manager_type_ok else None
    facts = resolve_instance_types(r, manager_type, pools)
    types = list(dict.fromkeys(([manager_type] if manager_type else []) + [p.instance_type for p in pools]))
    if all(facts.get(t) for t in types):
        network = resolve_network(r, network_cfg, types)
    placed = {}  # pool index -> its zones and EFA interfaces (settings/pool_placement.py)
    if network:
        manager_zones, placed = place(r, network, manager_type, pools, facts, pinned=bool(network_cfg["zones"]))
        managers = managers and dataclasses.replace(managers, zones=manager_zones)
    if overlay_pool:
        check_overlay_pool(r, overlay_pool, network_cfg)
    for p in pools:
        found = facts.get(p.instance_type)
        if p.valid and found and found.nvidia_gpus and p.index in placed:
            resolved_pools.append(
                GpuPool(p.name, p.instance_type, p.count, p.spot, p.spot_max_price, p.root_volume_gib,
                        gpus_per_node=found.nvidia_gpus, gpu_model=found.gpu_model, slots_per_gpu=p.slots_per_gpu,
                        sharing_mode=p.sharing_mode,
                        options=p.options, zones=placed[p.index].zones,
                        efa_interfaces=placed[p.index].efa_interfaces, offered_in=placed[p.index].offered_in,
                        max_unavailable=wave_size(p.max_unavailable, p.most_nodes), autoscale=p.autoscale)
            )
    if image:
        manager_ami, gpu_ami = resolve_amis(r, image, ami_id, managers, pools)
    # What the account can hold: reservations' states and service quotas (settings/*_checks.py).
    import pulumi_aws as aws
    resolved_pools = check_reservations(r, resolved_pools, aws.config.region)
    check_quotas(r, managers, resolved_pools, {t: f.vcpus for t, f in facts.items() if f}, aws.config.region)
    return resolved_pools, managers, network, manager_ami, gpu_ami
