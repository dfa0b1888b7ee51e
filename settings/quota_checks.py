"""Service quotas at preview: the vCPUs the cluster needs per EC2 quota, and its Elastic IPs, against the account's.

EC2 counts running instances in vCPUs, per quota: on-demand and spot apart, and by family
(Standard, G and VT, P; spot P5 apart from the other P). New accounts often have 0 for G/VT
and P, and 5 Elastic IPs per region. Unchecked, the first `pulumi up` builds the VPC, the
bucket and the managers, then fails with VcpuLimitExceeded. Here a quota smaller than what
the cluster needs fails the preview, naming the code, the need, the quota and how to ask for
more. The need is the whole cluster's, running nodes included (they hold quota too); other
instances of the account also do, which only its usage metrics show, so passing here is no
promise. Capacity Block pools are left out (whether EC2 counts a Capacity Block's instances
against the on-demand quota was not verified here, and a check that blocks wrongly is worse).
Credentials that may not read quotas (servicequotas:GetServiceQuota) get a warning, not a block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pulumi

from settings import aws_lookups
from settings.model import GpuPool, Managers
from settings.reader import Reader


@dataclass(frozen=True)
class Quota:
    code: str  # Service Quotas' code, service ec2
    name: str  # as the Service Quotas console shows it
    unit: str = "vCPUs"


STANDARD_ON_DEMAND = Quota("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances")
STANDARD_SPOT = Quota("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests")
G_VT_ON_DEMAND = Quota("L-DB2E81BA", "Running On-Demand G and VT instances")
G_VT_SPOT = Quota("L-3819A6DF", "All G and VT Spot Instance Requests")
P_ON_DEMAND = Quota("L-417A185B", "Running On-Demand P instances")
P_SPOT = Quota("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests")
P5_SPOT = Quota("L-C4BD4855", "All P5 Spot Instance Requests")
ELASTIC_IPS = Quota("L-0263D0A3", "EC2-VPC Elastic IPs", "Elastic IPs")
STANDARD_FAMILIES = frozenset("acdhimrtz")


def vcpu_quota(instance_type: str, spot: bool) -> Quota | None:
    """The quota that counts an instance of this type; None for families this program does not check (X, Inf...)."""
    letters = re.match(r"[a-z]*", instance_type.split(".")[0])[0]
    if letters in ("g", "vt"):
        return G_VT_SPOT if spot else G_VT_ON_DEMAND
    if letters == "p":
        if not spot:
            return P_ON_DEMAND
        return P5_SPOT if instance_type.startswith("p5") else P_SPOT
    if letters in STANDARD_FAMILIES:
        return STANDARD_SPOT if spot else STANDARD_ON_DEMAND
    return None


def how_to_raise(quota: Quota, needed: int | None, region: str) -> str:
    """How to ask for more: the console, or the CLI line (needed None: the value is the operator's to choose)."""
    value = needed if needed is not None else f"<{quota.unit} wanted>"
    at_least = f" to at least {needed}" if needed is not None else ""
    return (f"Request an increase{at_least} in the Service Quotas console (Amazon EC2, '{quota.name}'), or: "
            f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {quota.code} "
            f"--desired-value {value} --region {region}")


def needs(managers: Managers | None, manager_vcpus: int, pools: list[GpuPool], vcpus: dict[str, int]
          ) -> dict[Quota, list[tuple[str, int]]]:
    """Quota -> (who, how many) for the cluster: managers and pools in vCPUs, and the Elastic IPs."""
    out: dict[Quota, list[tuple[str, int]]] = {}

    def add(quota: Quota | None, who: str, amount: int) -> None:
        if quota and amount:
            out.setdefault(quota, []).append((who, amount))

    if managers:
        add(vcpu_quota(managers.instance_type, False), f"managers ({managers.count} x {managers.instance_type})",
            managers.count * manager_vcpus)
        add(ELASTIC_IPS, "managers", managers.count)  # each keeps its address (components/node_pool.py)
    for p in pools:
        # An elastic pool holds quota at its most: autoscale.max.
        size = f"up to {p.most_nodes}" if p.autoscale else str(p.count)
        if p.options.market_type != "capacity-block":
            add(vcpu_quota(p.instance_type, p.spot), f"pool {p.name} ({size} x {p.instance_type})",
                p.most_nodes * vcpus.get(p.instance_type, 0))
        if p.efa_interfaces:  # AWS gives a multi-interface node no public address: an Elastic IP each
            add(ELASTIC_IPS, f"pool {p.name} (EFA)", p.most_nodes)
    return out


def check_quotas(r: Reader, managers: Managers | None, pools: list[GpuPool], vcpus: dict[str, int],
                 region: str) -> None:
    """Fail the preview for each quota smaller than the cluster's need; warn once if quotas cannot be read."""
    manager_vcpus = vcpus.get(managers.instance_type, 0) if managers else 0
    for quota, parts in sorted(needs(managers, manager_vcpus, pools, vcpus).items(), key=lambda q: q[0].code):
        needed = sum(n for _, n in parts)
        try:
            value = aws_lookups.service_quota("ec2", quota.code)
        except (LookupError, aws_lookups.PermissionMissing) as exc:
            pulumi.log.warn(
                f"could not read the EC2 service quotas ({exc}), so the vCPU and Elastic IP quotas were not checked. "
                "Allow servicequotas:GetServiceQuota to check them at preview; a quota too small fails `pulumi up` "
                "with VcpuLimitExceeded or AddressLimitExceeded once the first resources exist")
            return
        if needed > value:
            who = ", ".join(f"{w}: {n}" for w, n in parts)
            key = "gpuPools" if any(w.startswith("pool ") for w, _ in parts) else "managerCount"
            r.error(key, f"the cluster needs {needed} {quota.unit} of the EC2 quota {quota.code} ('{quota.name}') "
                         f"({who}), and this account's quota in {region} is {value:g}. "
                         f"{how_to_raise(quota, needed, region)}. Or make the pools smaller (count, or autoscale.max)")
