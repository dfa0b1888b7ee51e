"""The stack configuration, read once into frozen dataclasses and validated in one place.

load_settings() checks every `gpu-swarm:*` key, then checks the values against AWS
(instance types, availability zones, AMIs, existing subnets) and the stack files
against the cluster. It collects every problem and raises one SettingsError that
names each key and its fix, before a single resource exists.
"""
from __future__ import annotations

import difflib
import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pulumi
import pulumi.runtime.config as runtime_config

from components import aws_lookups
from swarm.gpu_kind import DEFAULT_KIND, validate_kind
from swarm.stack_files import StackFileError, StackInfo, validate_stack_file

PROJECT = "gpu-swarm"
PROJECT_DIR = Path(__file__).resolve().parent

MANAGER_COUNTS = (1, 3, 5, 7)
IMAGES = ("ubuntu", "deep-learning", "custom")
GPU_ROOT_VOLUME_MIN_GIB = 50  # a CUDA runtime image alone is 3-10 GiB, and images pile up
MANAGER_ROOT_VOLUME_MIN_GIB = 20
SUBNET_SLOTS = 16  # the VPC is cut into 16 equal subnets, one slot per AZ letter (a-p)

# Every key, its default (None: required) and the shape that the Pulumi.yaml config
# block declares; a test keeps the two in step.
DEFAULTS: dict[str, Any] = {
    "allowedSshCidrs": None,
    "allowSshFromAnywhere": False,
    "vpcCidr": "10.42.0.0/16",
    "vpcId": "",
    "subnetIds": [],
    "availabilityZones": [],
    "managerCount": 1,
    "managerInstanceType": "m7i.large",
    "managerRootVolumeGiB": 40,
    "gpuPools": None,
    "image": "ubuntu",
    "amiId": "",
    "gpuKind": DEFAULT_KIND,
    "stacks": [],
    "tags": {},
    "sshUser": "ubuntu",
    "sshPublicKey": "",
    "sshPrivateKey": "",
    "imdsHopLimit": 1,
}
POOL_DEFAULTS: dict[str, Any] = {
    "name": None,
    "instanceType": None,
    "count": None,
    "spot": False,
    "spotMaxPrice": "",
    "rootVolumeGiB": 200,
}
STACK_DEFAULTS: dict[str, Any] = {"name": None, "file": None}

_POOL_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
_STACK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # what swarm/commands.py accepts
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
_AMI_RE = re.compile(r"^ami-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_VPC_RE = re.compile(r"^vpc-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_SUBNET_RE = re.compile(r"^subnet-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_PRICE_RE = re.compile(r"^\d+(\.\d+)?$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_PUBLIC_KEY_RE = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/]+=*( .*)?$")
_ZONE_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+[a-p]$")


class SettingsError(pulumi.RunError, ValueError):
    """Every problem in the stack configuration. As a RunError, `pulumi up` prints it without a traceback."""

    def __init__(self, problems: list[str]):
        self.problems = tuple(problems)
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"the {PROJECT} stack configuration has {len(problems)} problem(s); nothing was created:\n{listed}"
        )


@dataclass(frozen=True)
class GpuPool:
    name: str
    instance_type: str
    count: int
    spot: bool
    spot_max_price: str | None  # None: pay up to the on-demand price
    root_volume_gib: int
    gpus_per_node: int  # from the instance type, the number each node must advertise
    gpu_model: str


@dataclass(frozen=True)
class Managers:
    count: int
    instance_type: str
    root_volume_gib: int


@dataclass(frozen=True)
class Network:
    """Either a VPC to create (vpc_cidr, subnet_cidrs) or an existing one (vpc_id, subnet_ids)."""

    availability_zones: tuple[str, ...]  # one per subnet, in subnet order
    vpc_cidr: str | None = None
    subnet_cidrs: tuple[str, ...] = ()
    vpc_id: str | None = None
    subnet_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackFile:
    name: str
    file: str  # relative to the project directory, so the state does not hold this machine's paths
    sha256: str
    info: StackInfo


@dataclass(frozen=True)
class Settings:
    cluster_name: str
    allowed_ssh_cidrs: tuple[str, ...]
    network: Network
    managers: Managers
    gpu_pools: tuple[GpuPool, ...]
    image: str
    manager_ami_id: str
    gpu_ami_id: str
    ami_from_ssm: bool  # "latest" AMIs change under us; see NodePool's ignore_changes
    gpu_kind: str
    stacks: tuple[StackFile, ...]
    tags: tuple[tuple[str, str], ...]
    ssh_user: str
    ssh_public_key: str | None
    ssh_private_key: pulumi.Output[str] | None  # secret; None: generate a key pair
    imds_hop_limit: int

    @property
    def max_gpus_per_node(self) -> int:
        return max((p.gpus_per_node for p in self.gpu_pools), default=0)

    @property
    def tag_map(self) -> dict[str, str]:
        return dict(self.tags)


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


class _Reader:
    """Reads raw config values and collects problems instead of stopping at the first."""

    def __init__(self):
        self.problems: list[str] = []

    def error(self, name: str, message: str) -> None:
        self.problems.append(f"{key(name)}: {message}")

    def raw(self, name: str) -> str | None:
        value = runtime_config.get_config(key(name))
        # Pulumi.yaml gives optional keys an empty default, which means "not set".
        return None if value is None or value == "" else str(value)

    def project_keys(self) -> set[str]:
        # The language host loads the whole stack config with set_all_config; the
        # environment is the fallback that get_config itself reads.
        names = set(runtime_config.CONFIG.get()) | set(runtime_config.get_config_env())
        return {n.split(":", 1)[1] for n in names if n.startswith(f"{PROJECT}:")}

    def string(self, name: str) -> str:
        value = self.raw(name)
        return DEFAULTS[name] if value is None else value.strip()

    def integer(self, name: str, low: int, high: int) -> int | None:
        return _integer(self.raw(name), DEFAULTS[name], low, high, lambda m: self.error(name, m))

    def boolean(self, name: str) -> bool:
        return _boolean(self.raw(name), DEFAULTS[name], lambda m: self.error(name, m))

    def json(self, name: str, kind: type, example: str) -> Any:
        """A list or object value (the CLI passes them as JSON); None if unset, or reported as bad."""
        value = self.raw(name)
        if value is None:
            return DEFAULTS[name]
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, kind):
            what = "a list" if kind is list else "an object"
            self.error(name, f"expected {what}, found {value!r}; set it with {example}")
            return None
        return parsed


def _integer(value: Any, default: Any, low: int, high: int, error: Callable[[str], None]) -> int | None:
    if value is None or value == "":
        return default
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        error(f"expected a whole number, found {value!r}")
        return None
    if not low <= value <= high:
        error(f"{value} is out of range; use a number from {low} to {high}")
        return None
    return value


def _boolean(value: Any, default: bool, error: Callable[[str], None]) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "false"):
        return str(value).strip().lower() == "true"
    error(f"expected true or false, found {value!r}")
    return default


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(sorted(choices))}"


# ---------------------------------------------------------------- static checks


def _ssh_cidrs(r: _Reader) -> tuple[str, ...]:
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


def _managers(r: _Reader) -> tuple[Managers | None, bool]:
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
class _PoolConfig:
    name: str
    instance_type: str
    count: int
    spot: bool
    spot_max_price: str | None
    root_volume_gib: int
    index: int
    valid: bool  # False: a problem is reported, but the instance type is still checked


def _pools(r: _Reader) -> list[_PoolConfig]:
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
            error(unknown, "is not a pool setting" + _suggest(unknown, POOL_DEFAULTS))
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
        count = _integer(entry.get("count"), None, 0, 1000, lambda m: error("count", m))
        if count is None:
            if "count" not in entry:
                error("count", "required: how many nodes the pool has (0 or more)")
            ok = False
        spot = _boolean(entry.get("spot"), False, lambda m: error("spot", m))
        price = str(entry.get("spotMaxPrice") or "").strip() or None
        if price is not None:
            if not spot:
                error("spotMaxPrice", f"applies to spot nodes only; set {name_key}.spot true or remove it")
                ok = False
            elif not _PRICE_RE.match(price) or float(price) <= 0:
                error("spotMaxPrice", f"{price!r} is not a price; write US dollars per hour, e.g. \"12.50\"")
                ok = False
        volume = _integer(
            entry.get("rootVolumeGiB"),
            POOL_DEFAULTS["rootVolumeGiB"],
            GPU_ROOT_VOLUME_MIN_GIB,
            16384,
            lambda m: error("rootVolumeGiB", m + " (CUDA images need room: 200 is the default)"),
        )
        if volume is None:
            ok = False
        type_ok = bool(instance_type) and _INSTANCE_TYPE_RE.match(instance_type)
        if type_ok:
            pools.append(_PoolConfig(name, instance_type, count, spot, price, volume, i, ok))
        elif ok:
            raise AssertionError("a pool without a valid instance type must have a problem")
    return pools


def _image(r: _Reader) -> tuple[str | None, str | None]:
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


def _network_config(r: _Reader) -> dict:
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
        out.update(vpc_id=vpc_id, subnet_ids=list(dict.fromkeys(str(s) for s in subnet_ids or [])))
        return out
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


def _tags(r: _Reader) -> tuple[tuple[str, str], ...]:
    raw = r.json("tags", dict, "pulumi config set --path 'tags.team' ml-platform")
    tags = []
    for name, value in sorted((raw or {}).items()):
        if name.lower().startswith("aws:"):
            r.error("tags", f"{name!r}: the aws: prefix is reserved by AWS; choose another key")
        elif name == "Name" or name.startswith(f"{PROJECT}:"):
            r.error("tags", f"{name!r} is set by {PROJECT} on every resource; choose another key")
        elif not isinstance(value, (str, int, float)) or isinstance(value, bool):
            r.error("tags", f"{name!r}: tag values must be text, found {value!r}")
        elif len(name) > 128 or len(str(value)) > 256:
            r.error("tags", f"{name!r}: AWS allows keys up to 128 and values up to 256 characters")
        else:
            tags.append((name, str(value)))
    if len(tags) > 40:
        r.error("tags", f"{len(tags)} tags; AWS allows 50 per resource and {PROJECT} uses up to 10")
    return tuple(tags)


def _ssh(r: _Reader) -> tuple[str, str | None, pulumi.Output[str] | None]:
    user = r.string("sshUser")
    if not _USER_RE.match(user):
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
    if not _PUBLIC_KEY_RE.match(public):
        r.error("sshPublicKey", "expected one OpenSSH public key line such as 'ssh-ed25519 AAAA... you@host'")
    if "PRIVATE KEY-----" not in private:
        r.error("sshPrivateKey", "expected an OpenSSH or PEM private key (-----BEGIN ... PRIVATE KEY-----)")
    if not runtime_config.is_config_secret(key("sshPrivateKey")):
        r.error(
            "sshPrivateKey",
            "is stored in plain text; set it as a secret: "
            "pulumi config set --secret sshPrivateKey < ~/.ssh/id_ed25519",
        )
    return user, public, pulumi.Output.secret(private)


def _stack_configs(r: _Reader) -> list[tuple[int, str, str]]:
    example = "pulumi config set --path 'stacks[0].name' smoke and --path 'stacks[0].file' stacks/gpu-smoke.yml"
    raw = r.json("stacks", list, example)
    out, names = [], set()
    for i, entry in enumerate(raw or []):
        if not isinstance(entry, dict):
            r.error(f"stacks[{i}]", f"expected an object with name and file, found {entry!r}")
            continue
        for unknown in sorted(set(entry) - set(STACK_DEFAULTS)):
            r.error(f"stacks[{i}].{unknown}", "is not a stack setting" + _suggest(unknown, STACK_DEFAULTS))
        name, file = str(entry.get("name") or "").strip(), str(entry.get("file") or "").strip()
        if not _STACK_NAME_RE.match(name):
            r.error(f"stacks[{i}].name", f"{name!r} is not a stack name; use lowercase letters, digits, '-' and '_'")
            continue
        if name in names:
            r.error(f"stacks[{i}].name", f"{name!r} is deployed twice; stack names must be unique")
            continue
        names.add(name)
        path = (PROJECT_DIR / file).resolve()
        if not file:
            r.error(f"stacks[{i}].file", "required: the compose file, relative to the project directory")
        elif Path(file).is_absolute() or not path.is_relative_to(PROJECT_DIR):
            r.error(f"stacks[{i}].file", f"{file!r}: give a path inside the project directory, e.g. stacks/gpu-smoke.yml")
        elif not path.is_file():
            r.error(f"stacks[{i}].file", f"{file} does not exist (paths are relative to {PROJECT_DIR})")
        else:
            out.append((i, name, file))
    return out


# ---------------------------------------------------------------- checks against AWS


def _resolve_instance_types(r: _Reader, managers_type: str | None, pools: list[_PoolConfig]) -> dict:
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


def _resolve_network(r: _Reader, cfg: dict, instance_types: list[str]) -> Network | None:
    if not instance_types or ("vpc_cidr" not in cfg and "vpc_id" not in cfg):
        return None
    try:
        offered = aws_lookups.zones_offering(instance_types)
    except LookupError as exc:
        r.error("gpuPools", f"could not list where the instance types are offered ({exc})")
        return None

    def missing_in(zone: str) -> list[str]:
        return [t for t in instance_types if zone not in offered.get(t, ())]

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
            elif missing_in(subnet.availability_zone):
                good = _zones_offering_all(offered, instance_types)
                r.error(
                    "subnetIds",
                    f"{subnet_id} is in {subnet.availability_zone}, which does not offer "
                    f"{', '.join(missing_in(subnet.availability_zone))}; use subnets in "
                    f"{', '.join(good) or 'a zone that offers them'}",
                )
            zones.append(subnet.availability_zone)
        if len(zones) != len(cfg["subnet_ids"]):
            return None
        return Network(availability_zones=tuple(zones), vpc_id=cfg["vpc_id"], subnet_ids=tuple(cfg["subnet_ids"]))

    try:
        region_zones = aws_lookups.available_zones()
    except LookupError as exc:
        r.error("availabilityZones", f"could not list this region's availability zones ({exc})")
        return None
    if cfg["zones"]:
        zones = []
        for zone in cfg["zones"]:
            if zone not in region_zones:
                r.error("availabilityZones",
                        f"{zone} is not an available zone of this region ({', '.join(region_zones)})")
            elif missing_in(zone):
                r.error("availabilityZones", f"{zone} does not offer {', '.join(missing_in(zone))}; "
                                             "remove it or change the instance types")
            else:
                zones.append(zone)
        zones = sorted(set(zones))
        if len(zones) != len(set(cfg["zones"])):
            return None
    else:
        zones = [z for z in region_zones if not missing_in(z)]
        if not zones:
            where = "; ".join(f"{t}: {', '.join(sorted(offered.get(t, ()))) or 'nowhere'}" for t in instance_types)
            r.error(
                "gpuPools",
                f"no availability zone of this region offers all of {', '.join(instance_types)} ({where}); "
                "choose instance types offered in a common zone, or run the pools as separate stacks",
            )
            return None
        pulumi.log.info(
            f"nodes go to {', '.join(zones)}, the zones that offer every instance type; pin them with "
            f"{key('availabilityZones')} so that a new pool's type cannot shrink the list and move nodes"
        )
    net = ipaddress.ip_network(cfg["vpc_cidr"])
    slots = list(net.subnets(prefixlen_diff=4))
    # Each zone keeps the slot of its letter, so adding or dropping a zone never renumbers the others.
    cidrs = tuple(str(slots[ord(z[-1]) - ord("a")]) for z in zones)
    return Network(availability_zones=tuple(zones), vpc_cidr=cfg["vpc_cidr"], subnet_cidrs=cidrs)


def _zones_offering_all(offered: dict[str, frozenset[str]], types: list[str]) -> list[str]:
    zones = set.intersection(*(set(offered.get(t, ())) for t in types)) if types else set()
    return sorted(zones)


def _resolve_amis(r: _Reader, image: str, ami_id: str | None, managers: Managers | None, pools: list[_PoolConfig]):
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
    for p in pools:
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


def _region_problem(r: _Reader) -> bool:
    import pulumi_aws as aws

    if aws.config.region:
        return False
    r.problems.append("aws:region: not set; run pulumi config set aws:region us-east-1 (or your region)")
    return True


# ---------------------------------------------------------------- entry point


def load_settings() -> Settings:
    """Read and check the whole stack configuration; raise SettingsError listing every problem."""
    r = _Reader()
    for unknown in sorted(r.project_keys() - set(DEFAULTS)):
        r.error(unknown, "is not a setting of this program" + _suggest(unknown, DEFAULTS))

    cidrs = _ssh_cidrs(r)
    kind = r.string("gpuKind")
    try:
        kind = validate_kind(kind)
        kind_ok = True
    except ValueError as exc:
        r.error("gpuKind", str(exc))
        kind_ok = False
    managers, manager_type_ok = _managers(r)
    pools = _pools(r)
    image, ami_id = _image(r)
    network_cfg = _network_config(r)
    tags = _tags(r)
    ssh_user, public_key, private_key = _ssh(r)
    hop_limit = r.integer("imdsHopLimit", 1, 64)
    stack_cfgs = _stack_configs(r)

    # Checks against AWS, for the values that passed the checks above.
    resolved_pools: list[GpuPool] = []
    network = manager_ami = gpu_ami = None
    if not _region_problem(r):
        manager_type = r.string("managerInstanceType") if manager_type_ok else None
        facts = _resolve_instance_types(r, manager_type, pools)
        types = list(dict.fromkeys(([manager_type] if manager_type else []) + [p.instance_type for p in pools]))
        if all(facts.get(t) for t in types):
            network = _resolve_network(r, network_cfg, types)
        for p in pools:
            found = facts.get(p.instance_type)
            if p.valid and found and found.nvidia_gpus:
                resolved_pools.append(
                    GpuPool(p.name, p.instance_type, p.count, p.spot, p.spot_max_price, p.root_volume_gib,
                            gpus_per_node=found.nvidia_gpus, gpu_model=found.gpu_model)
                )
        if image:
            manager_ami, gpu_ami = _resolve_amis(r, image, ami_id, managers, pools)

    stacks = []
    if kind_ok and pools and len(resolved_pools) == len(pools):
        max_gpus = max(p.gpus_per_node for p in resolved_pools)
        for i, name, file in stack_cfgs:
            text = (PROJECT_DIR / file).read_text()
            try:
                info = validate_stack_file(text, kind=kind, max_gpus_per_node=max_gpus, source=file)
            except StackFileError as exc:
                for problem in exc.problems:
                    r.error(f"stacks[{i}].file", f"{file}: {problem}")
                continue
            stacks.append(StackFile(name, file, hashlib.sha256(text.encode()).hexdigest(), info))

    if r.problems:
        raise SettingsError(r.problems)
    assert network and managers and manager_ami and gpu_ami, "every missing value has a problem"
    return Settings(
        cluster_name=f"{PROJECT}-{pulumi.get_stack()}",
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
    )
