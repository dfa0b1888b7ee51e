"""Checks of each `gpu-swarm:*` value on its own, before anything is asked of AWS."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Callable

import pulumi
import pulumi.runtime.config as runtime_config

from settings import reader
from settings.model import PROJECT, Managers
from settings.pool_autoscale import Autoscale, read_autoscale
from settings.pool_options import PoolOptions, read_pool_options
from settings.pool_rollout import read_rollout
from settings.pool_sharing import NOT_SHARED, read_sharing
from settings.reader import (DEFAULTS, POOL_DEFAULTS, ROLLOUT_DEFAULTS, Reader, boolean, integer, key,
                             suggest)

MANAGER_COUNTS = (1, 3, 5, 7)
IMAGES = ("ubuntu", "deep-learning", "custom")
GPU_ROOT_VOLUME_MIN_GIB = 50  # a CUDA runtime image alone is 3-10 GiB, and images pile up
MANAGER_ROOT_VOLUME_MIN_GIB = 20
SUBNET_SLOTS = 16  # the VPC is cut into 16 equal subnets, one slot per AZ letter (a-p)


_POOL_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
_AMI_RE = re.compile(r"^ami-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_ENDPOINT_RE = re.compile(r"vpce-([0-9a-f]{8}|[0-9a-f]{17})")
_VPC_RE = re.compile(r"^vpc-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_SUBNET_RE = re.compile(r"^subnet-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_PRICE_RE = re.compile(r"^\d+(\.\d+)?$")
LINUX_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # also checked on the node (authorize_keys)
_PUBLIC_KEY_RE = re.compile(r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/]+=*( [^\n]*)?")
PUBLIC_KEY_EXAMPLE = "expected one OpenSSH public key line such as 'ssh-ed25519 AAAA... you@host'"


def public_key_problem(text: str) -> str | None:
    """The one rule for a public key, at preview and on the node (node_commands.authorize_keys):
    None when `text` is one OpenSSH public key line; a comment may hold any character but a newline."""
    return None if isinstance(text, str) and _PUBLIC_KEY_RE.fullmatch(text.strip()) else PUBLIC_KEY_EXAMPLE
_ZONE_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+[a-p]$")



def read_ssh_cidrs(r: Reader) -> tuple[str, ...]:
    example = "pulumi config set --path 'allowedSshCidrs[0]' 203.0.113.7/32"
    raw = r.json("allowedSshCidrs", list, example)
    if not raw:
        if raw is None and r.raw("allowedSshCidrs") is not None:
            return ()  # reported as malformed
        r.error(
            "allowedSshCidrs",
            "required: list the networks that may SSH to the managers (Pulumi connects from "
            f"one of them); set it with {example}",
        )
        return ()
    anywhere = r.boolean("allowSshFromAnywhere")
    cidrs: list[str] = []
    for item in raw:
        text = str(item).strip()
        try:
            net = ipaddress.ip_network(text, strict=True)  # an address alone is its /32 (or /128)
        except ValueError:
            fixed = _network_or_none(text)
            if fixed:
                r.error("allowedSshCidrs", f"{text} has host bits set; write {fixed}, or the address alone")
            else:
                r.error("allowedSshCidrs", f"{text!r} is not a CIDR such as 203.0.113.7/32 or 2001:db8::/48")
            continue
        if net.prefixlen == 0 and not anywhere:
            r.error(
                "allowedSshCidrs",
                f"{net} opens SSH to the internet; set {key('allowSshFromAnywhere')} true to accept that",
            )
            continue
        if 0 < net.prefixlen < (8 if net.version == 4 else 16) and not anywhere:
            r.error(
                "allowedSshCidrs",
                f"{net} opens SSH to a large part of the internet; narrow it, or set "
                f"{key('allowSshFromAnywhere')} true to accept that",
            )
            continue
        if str(net) not in cidrs:
            cidrs.append(str(net))
    return tuple(cidrs)


def _network_or_none(text: str) -> str | None:
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        return None


def read_managers(r: Reader) -> tuple[Managers | None, bool]:
    count = r.integer("managerCount", 0, 99)
    if count is not None and count not in MANAGER_COUNTS:
        if count % 2 == 0 and 0 < count < 8:
            why = f"{count} managers survive no more manager failures than {count - 1} (Raft needs a majority)"
        else:
            why = f"{count} is not a supported number of managers"
        r.error("managerCount", f"{why}; use 1, 3, 5 or 7 (3 managers survive the loss of one)")
        count = None
    instance_type = r.string("managerInstanceType")
    type_ok = _check_instance_type_name(instance_type, lambda m: r.error("managerInstanceType", m))
    volume = r.integer("managerRootVolumeGiB", MANAGER_ROOT_VOLUME_MIN_GIB, 16384)
    if count is None or volume is None:
        return None, type_ok
    return Managers(count, instance_type, volume), type_ok


def _check_instance_type_name(value: str, error: Callable[[str], None]) -> bool:
    if not _INSTANCE_TYPE_RE.match(value):
        error(f"{value!r} is not an EC2 instance type; write it like g6e.12xlarge")
        return False
    return True


@dataclass(frozen=True)
class PoolConfig:
    name: str
    instance_type: str
    count: int
    spot: bool
    spot_max_price: str | None
    root_volume_gib: int
    index: int
    valid: bool  # False: a problem is reported, but the instance type is still checked
    slots_per_gpu: int = 0
    options: PoolOptions = PoolOptions()  # market, reservation, placement, EFA, zone
    sharing_mode: str = "time-slicing"  # with slots_per_gpu: time-slicing or mps (settings/pool_sharing.py)
    max_unavailable: int | str = ROLLOUT_DEFAULTS["maxUnavailable"]  # nodes or "P%" (settings/pool_rollout.py)
    autoscale: Autoscale | None = None  # an elastic pool (settings/pool_autoscale.py); count is then 0

    @property
    def most_nodes(self) -> int:
        return self.autoscale.max if self.autoscale else self.count


def read_pools(r: Reader) -> list[PoolConfig]:
    example = (
        "pulumi config set --path 'gpuPools[0].name' gpu, "
        "--path 'gpuPools[0].instanceType' g6.xlarge and --path 'gpuPools[0].count' 1"
    )
    raw = r.json("gpuPools", list, example)
    if not raw:
        if raw is None and r.raw("gpuPools") is not None:
            return []  # reported as malformed
        r.error("gpuPools", f"required: add at least one GPU pool; set it with {example}")
        return []
    pools, names = [], set()
    for i, entry in enumerate(raw):
        name_key = f"gpuPools[{i}]"

        def error(field: str, message: str, _i=i) -> None:
            r.error(f"gpuPools[{_i}].{field}" if field else f"gpuPools[{_i}]", message)

        if not isinstance(entry, dict):
            error("", f"expected an object with name, instanceType and count, found {entry!r}")
            continue
        for unknown in sorted(set(entry) - set(POOL_DEFAULTS)):
            error(unknown, "is not a pool setting" + suggest(unknown, POOL_DEFAULTS))
        ok = True
        name = str(entry.get("name") or "").strip()
        if not _POOL_NAME_RE.match(name):
            error(
                "name",
                f"{name!r} is not a valid pool name; use 1-20 lowercase letters, digits and '-', "
                "starting with a letter (it becomes a node label and part of resource names)",
            )
            ok = False
        elif name == "managers":
            error("name", "'managers' is the managers' own pool label; choose another name")
            ok = False
        elif name in names:
            error("name", f"{name!r} is used by two pools; pool names must be unique")
            ok = False
        names.add(name)
        instance_type = str(entry.get("instanceType") or "").strip()
        if not instance_type:
            error("instanceType", "required: the EC2 instance type of the pool's nodes, e.g. g6.xlarge")
            ok = False
        elif not _check_instance_type_name(instance_type, lambda m: error("instanceType", m)):
            ok = False
        autoscale = read_autoscale(entry.get("autoscale"), entry, error)  # settings/pool_autoscale.py
        if "autoscale" in entry:
            count, ok = 0, ok and autoscale is not None
        else:
            count = integer(entry.get("count"), None, 0, 1000, lambda m: error("count", m))
            if count is None:
                if "count" not in entry:
                    error("count", "required: how many nodes the pool has (0 or more), or autoscale: {max: N} for "
                                   "a pool that grows when GPU tasks wait and shrinks when idle")
                ok = False
        options = read_pool_options(entry, entry.get("spot"), error)  # settings/pool_options.py
        ok, spot = ok and options is not None, bool(options and options.spot)
        price = str(entry.get("spotMaxPrice") or "").strip() or None
        if price is not None:
            if not spot:
                error("spotMaxPrice", f"applies to spot nodes only; set {name_key}.spot true or remove it")
                ok = False
            elif not _PRICE_RE.match(price) or float(price) <= 0:
                error("spotMaxPrice", f"{price!r} is not a price; write US dollars per hour, e.g. \"12.50\"")
                ok = False
        volume = integer(
            entry.get("rootVolumeGiB"),
            POOL_DEFAULTS["rootVolumeGiB"],
            GPU_ROOT_VOLUME_MIN_GIB,
            16384,
            lambda m: error("rootVolumeGiB", m + " (CUDA images need room: 200 is the default)"),
        )
        if volume is None:
            ok = False
        sharing = read_sharing(entry.get("sharing"), error)
        if sharing is None:
            ok, sharing = False, NOT_SHARED
        slots, sharing_mode = sharing
        max_unavailable = read_rollout(entry.get("rollout"), error)
        if max_unavailable is None:
            ok, max_unavailable = False, ROLLOUT_DEFAULTS["maxUnavailable"]
        type_ok = bool(instance_type) and _INSTANCE_TYPE_RE.match(instance_type)
        if type_ok:
            pools.append(PoolConfig(name, instance_type, count, spot, price, volume, i, ok, slots,
                                    options or PoolOptions(), sharing_mode=sharing_mode,
                                    max_unavailable=max_unavailable, autoscale=autoscale))
        elif ok:
            raise AssertionError("a pool without a valid instance type must have a problem")
    return pools


def read_image(r: Reader) -> tuple[str | None, str | None]:
    image = r.string("image")
    ami_id = r.raw("amiId")
    if image not in IMAGES:
        r.error(
            "image",
            f"{image!r} is not an image choice; use ubuntu (Ubuntu 24.04, everything installed at boot), "
            "deep-learning (AWS Deep Learning Base GPU AMI, faster boot) or custom (with amiId)",
        )
        return None, None
    if image == "custom":
        if ami_id is None:
            r.error("amiId", f"required when {key('image')} is custom; set it to your AMI's id, e.g. ami-0123456789abcdef0")
            return None, None
        if not _AMI_RE.match(ami_id.strip()):
            r.error("amiId", f"{ami_id!r} is not an AMI id; expected ami- and 8 or 17 hex digits")
            return None, None
        return image, ami_id.strip()
    if ami_id is not None:
        r.error("amiId", f"is only used when {key('image')} is custom (it is {image}); remove amiId or set image custom")
        return None, None
    return image, None


def read_network(r: Reader) -> dict:
    vpc_id = r.raw("vpcId")
    subnet_ids = r.json("subnetIds", list, "pulumi config set --path 'subnetIds[0]' subnet-0123456789abcdef0")
    zones = r.json("availabilityZones", list, "pulumi config set --path 'availabilityZones[0]' us-east-1a")
    cidr_text = r.string("vpcCidr")
    out: dict[str, Any] = {"zones": [str(z) for z in zones or []]}
    for zone in out["zones"]:
        if not _ZONE_RE.match(zone):
            r.error("availabilityZones", f"{zone!r} is not an availability zone name such as us-east-1a")
    if vpc_id is not None:
        if not _VPC_RE.match(vpc_id):
            r.error("vpcId", f"{vpc_id!r} is not a VPC id; expected vpc- and 8 or 17 hex digits")
        if not subnet_ids:
            r.error("subnetIds", f"required with {key('vpcId')}: list public subnets of that VPC "
                                 "(routed to an internet gateway)")
        for subnet in subnet_ids or []:
            if not _SUBNET_RE.match(str(subnet)):
                r.error("subnetIds", f"{subnet!r} is not a subnet id; expected subnet- and 8 or 17 hex digits")
        if cidr_text != DEFAULTS["vpcCidr"]:
            r.error("vpcCidr", f"applies only to a VPC this program creates; remove it or remove {key('vpcId')}")
        if out["zones"]:
            r.error("availabilityZones",
                    f"applies only to a VPC this program creates; with {key('vpcId')} the subnets decide")
        endpoint = r.raw("s3GatewayEndpointId")
        if endpoint is not None and not _ENDPOINT_RE.fullmatch(endpoint):
            r.error("s3GatewayEndpointId", f"{endpoint!r} is not a VPC endpoint id; expected vpce- and 8 or 17 hex digits")
        out.update(vpc_id=vpc_id, subnet_ids=list(dict.fromkeys(str(s) for s in subnet_ids or [])),
                   s3_endpoint_id=endpoint)
        return out
    if r.raw("s3GatewayEndpointId") is not None:
        r.error("s3GatewayEndpointId", f"applies only with {key('vpcId')}: the VPC this program creates gets its own")
    if subnet_ids:
        r.error("subnetIds", f"needs {key('vpcId')}, the VPC the subnets belong to; "
                             "set it, or remove subnetIds to create a VPC")
    try:
        net = ipaddress.ip_network(cidr_text, strict=True)
    except ValueError:
        r.error("vpcCidr", f"{cidr_text!r} is not a network such as 10.42.0.0/16 (host bits must be zero)")
        return out
    if net.version != 4 or not 16 <= net.prefixlen <= 22 or not net.is_private:
        r.error(
            "vpcCidr",
            f"{net} does not fit: use a private IPv4 range from /16 to /22 (it is cut into "
            f"{SUBNET_SLOTS} subnets, one per availability zone), e.g. 10.42.0.0/16",
        )
        return out
    out["vpc_cidr"] = str(net)
    return out


def read_ssh(r: Reader) -> tuple[str, str | None, pulumi.Output[str] | None]:
    user = r.string("sshUser")
    if not LINUX_USER_RE.fullmatch(user):
        r.error("sshUser", f"{user!r} is not a Linux user name; the images' default is ubuntu")
    public = r.raw("sshPublicKey")
    private = r.raw("sshPrivateKey")
    if (public is None) != (private is None):
        missing = "sshPrivateKey" if private is None else "sshPublicKey"
        r.error(
            missing,
            "sshPublicKey and sshPrivateKey come as a pair; set both, or neither to let "
            f"{PROJECT} generate a key (exported as the secret output privateKey)",
        )
        return user, None, None
    if public is None:
        return user, None, None
    public = public.strip()
    if public_key_problem(public):
        r.error("sshPublicKey", public_key_problem(public))
    if "PRIVATE KEY-----" not in private:
        r.error("sshPrivateKey", "expected an OpenSSH or PEM private key (-----BEGIN ... PRIVATE KEY-----)")
    if not runtime_config.is_config_secret(key("sshPrivateKey")):
        r.error(
            "sshPrivateKey",
            "is stored in plain text; set it as a secret: "
            "pulumi config set --secret sshPrivateKey < ~/.ssh/id_ed25519",
        )
    return user, public, pulumi.Output.secret(private)


def read_authorized_keys(r: Reader) -> tuple[str, ...]:
    raw = r.json("sshAuthorizedKeys", list, "pulumi config set --path 'sshAuthorizedKeys[0]' \"$(cat key.pub)\"")
    keys = []
    for i, item in enumerate(raw or []):
        text = str(item).strip()
        if public_key_problem(text):
            r.error(f"sshAuthorizedKeys[{i}]", public_key_problem(text))
        elif text not in keys:
            keys.append(text)
    return tuple(keys)
