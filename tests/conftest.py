"""Pulumi mocks for the program's tests: fake AWS answers and plausible resource state.

No AWS and no Pulumi CLI: `pulumi.runtime.set_mocks` runs the program in-process.
RecordingMonitor also keeps each registration request, because the dependencies,
secret markers and resource options are only visible there.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pytest
import yaml
from google.protobuf import json_format
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc

from settings import aws_lookups

REPO = Path(__file__).resolve().parent.parent
# The node programs import their siblings (gpu_agent imports gpu_detect), as they do on a node.
sys.path.insert(0, str(REPO / "node"))
REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f")

# instance type -> (architecture, [(manufacturer, model, count)])
INSTANCE_TYPES = {
    "t3.medium": ("x86_64", []),
    "t3.large": ("x86_64", []),
    "m7i.large": ("x86_64", []),
    "m7i.xlarge": ("x86_64", []),
    "m7g.large": ("arm64", []),
    "g4dn.xlarge": ("x86_64", [("NVIDIA", "T4", 1)]),
    "g4dn.12xlarge": ("x86_64", [("NVIDIA", "T4", 4)]),
    "g5.xlarge": ("x86_64", [("NVIDIA", "A10G", 1)]),
    "g6.xlarge": ("x86_64", [("NVIDIA", "L4", 1)]),
    "g6e.12xlarge": ("x86_64", [("NVIDIA", "L40S", 4)]),
    "p4d.24xlarge": ("x86_64", [("NVIDIA", "A100", 8)]),
    "p5.48xlarge": ("x86_64", [("NVIDIA", "H100", 8)]),
    "g5g.xlarge": ("arm64", [("NVIDIA", "T4g", 1)]),
    "g4ad.xlarge": ("x86_64", [("AMD", "Radeon Pro V520", 1)]),
}
# Where a type is offered, when not in every zone.
OFFERED_IN = {"p5.48xlarge": {"us-east-1a", "us-east-1c"}, "p4d.24xlarge": {"us-east-1b"}}
UBUNTU_AMI = "ami-0a1b2c3d4e5f60718"
DEEP_LEARNING_AMI = "ami-0d1e2a3b4c5d6e7f8"
CUSTOM_AMI = "ami-0123456789abcdef0"
CUSTOM_AMI_NEXT = "ami-0123456789abcdef1"
ARM_AMI = "ami-0fedcba9876543210"
AMIS = {UBUNTU_AMI: ("x86_64", 8), DEEP_LEARNING_AMI: ("x86_64", 75), CUSTOM_AMI: ("x86_64", 30), CUSTOM_AMI_NEXT: ("x86_64", 30), ARM_AMI: ("arm64", 8)}
VPC = "vpc-0abc1234def567890"
VPC_CIDRS = {VPC: ("10.0.0.0/16", "10.1.0.0/16"), "vpc-0fff0000fff000011": ("10.200.0.0/16",)}
SUBNETS = {
    "subnet-0aaaaaaaaaaaaaaaa": (VPC, "us-east-1a"),
    "subnet-0cccccccccccccccc": (VPC, "us-east-1c"),
    "subnet-0bbbbbbbbbbbbbbbb": (VPC, "us-east-1b"),
    "subnet-0eeeeeeeeeeeeeeee": ("vpc-0fff0000fff000011", "us-east-1e"),
}


def fake_node_id(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:25]


def fake_gpu_uuid(name: str, index: int) -> str:
    h = hashlib.sha1(f"{name}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class AwsMocks(pulumi_mocks.Mocks):
    def call(self, args: pulumi_mocks.MockCallArgs):
        token, a = args.token, args.args
        if token == "aws:ec2/getInstanceType:getInstanceType":
            if a["instanceType"] not in INSTANCE_TYPES:
                raise Exception("InvalidInstanceType: The following supplied instance types do not exist")
            arch, gpus = INSTANCE_TYPES[a["instanceType"]]
            return {
                "instanceType": a["instanceType"],
                "supportedArchitectures": [arch],
                "gpuses": [
                    {"manufacturer": m, "name": n, "count": c, "memorySize": 24576} for m, n, c in gpus
                ],
            }
        if token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            wanted = a["filters"][0]["values"]
            pairs = [(t, z) for t in wanted if t in INSTANCE_TYPES for z in sorted(OFFERED_IN.get(t, ZONES))]
            return {
                "instanceTypes": [t for t, _ in pairs],
                "locations": [z for _, z in pairs],
                "locationTypes": ["availability-zone"] * len(pairs),
            }
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return {"names": list(ZONES), "zoneIds": [f"use1-az{i}" for i in range(len(ZONES))]}
        if token == "aws:ssm/getParameter:getParameter":
            ami = {
                aws_lookups.UBUNTU_AMI_PARAMETER: UBUNTU_AMI,
                aws_lookups.DEEP_LEARNING_AMI_PARAMETER: DEEP_LEARNING_AMI,
            }[a["name"]]
            return {"name": a["name"], "type": "String", "value": ami, "insecureValue": ami}
        if token == "aws:ec2/getAmi:getAmi":
            ami = a["filters"][0]["values"][0]
            if ami not in AMIS:
                raise Exception("Your query returned no results")
            arch, size = AMIS[ami]
            return {
                "id": ami,
                "architecture": arch,
                "rootDeviceName": "/dev/sda1",
                "blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"volume_size": str(size)}}],
            }
        if token == "aws:ec2/getVpc:getVpc":
            if a["id"] not in VPC_CIDRS:
                raise Exception(f"no matching EC2 VPC found: {a['id']}")
            primary, *more = VPC_CIDRS[a["id"]]
            return {"id": a["id"], "cidrBlock": primary,
                    "cidrBlockAssociations": [{"cidrBlock": c, "associationId": f"a-{i}", "state": "associated"}
                                              for i, c in enumerate(VPC_CIDRS[a["id"]])]}
        if token == "aws:ec2/getSubnet:getSubnet":
            if a["id"] not in SUBNETS:
                raise Exception(f"no matching EC2 Subnet found: {a['id']}")
            vpc, zone = SUBNETS[a["id"]]
            return {"id": a["id"], "vpcId": vpc, "availabilityZone": zone}
        raise Exception(f"no mock for {token}")

    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        state = dict(args.inputs)
        if args.typ == "aws:ec2/instance:Instance":
            # Addresses follow the name, so two runs of the program (the plan tests) agree.
            n = int(hashlib.sha1(args.name.encode()).hexdigest()[:8], 16)
            state["privateIp"] = f"10.42.{n // 250 % 250}.{n % 250 + 4}"
            if state.get("associatePublicIpAddress"):
                state["publicIp"] = f"54.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
            return f"i-{hashlib.sha1(args.name.encode()).hexdigest()[:17]}", state
        if args.typ == "tls:index/privateKey:PrivateKey":
            state["privateKeyOpenssh"] = "-----BEGIN OPENSSH PRIVATE KEY-----\nZmFrZQ==\n-----END OPENSSH PRIVATE KEY-----\n"
            state["publicKeyOpenssh"] = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake\n"
        if args.typ == "aws:s3/bucket:Bucket":
            # Auto-named, as the provider names it: the resource name and a random suffix.
            state["bucket"] = f"{args.name}-{hashlib.sha1(args.name.encode()).hexdigest()[:7]}"
            state["arn"] = f"arn:aws:s3:::{state['bucket']}"
            state["bucketRegionalDomainName"] = f"{state['bucket']}.s3.{REGION}.amazonaws.com"
            return state["bucket"], state
        if args.typ == "aws:ec2/vpcEndpoint:VpcEndpoint":
            return f"vpce-{hashlib.sha1(args.name.encode()).hexdigest()[:17]}", state
        if args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = f"{args.name}-1234567"
        if args.typ == "command:remote:Command":
            state["stdout"] = command_stdout(args.name, state.get("create") or "")
        return f"{args.name}-id", state


FAKE_CLUSTER_ID = "fakeclusterid000000000001"


def command_stdout(name: str, create: str) -> str:
    """What a node would print for the builders in swarm/ and node_software.py."""
    if "join-token -q worker" in create:
        return '{"worker": "SWMTKN-1-worker-secret", "manager": "SWMTKN-1-manager-secret"}\n'
    if '"manager": true, "cluster_id"' in create:  # a probe: fresh managers are in no swarm
        return '{"state": "absent", "manager": false}\n'
    if "docker swarm init" in create:
        return json.dumps({"cluster_id": FAKE_CLUSTER_ID, "node_id": fake_node_id(name), "created": True}) + "\n"
    if "docker swarm join" in create:
        return fake_node_id(name) + "\n"
    if "GenericResources" in create:  # admit_node: the swarm sees what the node advertises
        expected = int(re.search(r"\"\$n\" -eq (\d+) \]", create)[1])
        kind = re.search(r'"Kind":"([^"]+)"', create)[1]
        slots = "SHARED" in kind
        entries = [{"NamedResourceSpec": {"Kind": kind, "Value": fake_gpu_uuid(name, i // 4 if slots else i)
                                          + (f"-s{i % 4}" if slots else "")}} for i in range(expected)]
        check = {"verified": True, "expected": sorted({e["NamedResourceSpec"]["Value"] for e in entries})}
        return json.dumps({"resources": entries or None, "check": check if expected else None}) + "\n"
    if "conditions read at" in create or '"healthLast"' in create:  # swarm/health.py: every node is well
        ids = re.search(r"docker node inspect --format '.*' ([a-z0-9 ]+)$", create, re.M)[1].split()
        return "".join(json.dumps({"id": i, "hostname": f"ip-{i[:6]}", "state": "ready", "availability": "active",
                                   "condition": "healthy", "reason": "ok", "gpu": "-", "since": "1800000000",
                                   "drainedBy": "", "health": "", "healthLast": ""}) + "\n" for i in ids)
    if "bootstrap-timings.json" in create:
        return '{"install-docker": {"seconds": 41.250, "status": "done"}}\n'
    return ""


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """Keeps every RegisterResource request by resource name, and every registered output."""

    def __init__(self, mocks: pulumi_mocks.Mocks):
        super().__init__(mocks)
        self.requests = {}
        self.duplicate_names = []
        self.outputs = {}

    def RegisterResource(self, request):
        if request.name in self.requests:
            self.duplicate_names.append(request.name)
        self.requests[request.name] = request
        return super().RegisterResource(request)

    def RegisterResourceOutputs(self, request):
        self.outputs[request.urn] = json_format.MessageToDict(request.outputs)
        return super().RegisterResourceOutputs(request)

    def stack_outputs(self) -> dict:
        return next(v for urn, v in self.outputs.items() if urn.split("::")[2] == "pulumi:pulumi:Stack")


def use_mocks(config: dict[str, str], secret_keys: tuple[str, ...] = (), stack: str = "test") -> RecordingMonitor:
    """Point the Pulumi runtime at the mocks, with this config (fully qualified keys)."""
    mocks = AwsMocks()
    monitor = RecordingMonitor(mocks)
    # A fresh root stack per run, or exports of earlier runs would linger in its outputs.
    pulumi.runtime.settings.ROOT.set(None)
    pulumi_mocks.set_mocks(mocks, project="gpu-swarm", stack=stack, preview=False, monitor=monitor)
    pulumi.runtime.set_all_config(dict(config), list(secret_keys))
    return monitor


@dataclass
class ProgramRun:
    monitor: RecordingMonitor
    exports: dict = field(default_factory=dict)  # stack outputs, resolved
    secret_exports: set = field(default_factory=set)


def run_program(config: dict[str, str], secret_keys: tuple[str, ...] = (), stack: str = "test") -> ProgramRun:
    """Run __main__.py under the mocks, as `pulumi up` would, and collect its stack outputs."""
    run = ProgramRun(use_mocks(config, secret_keys, stack))

    async def collect(outputs: dict) -> None:
        for name, value in outputs.items():
            out = pulumi.Output.from_input(value)
            run.exports[name] = await out.future()
            if await out.is_secret():
                run.secret_exports.add(name)

    @pulumi.runtime.test
    def program():
        runpy.run_path(str(REPO / "__main__.py"), run_name="__main__")
        outputs = pulumi.runtime.settings.get_root_resource().outputs
        return pulumi.Output.from_input(asyncio.ensure_future(collect(outputs)))

    program()
    return run


def _config_text(value) -> str:
    """A YAML config value as the CLI hands it to the program: text, or JSON for lists and objects."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def project_defaults() -> dict[str, str]:
    """The defaults that Pulumi.yaml declares, qualified, as the CLI merges them into every stack."""
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    out = {}
    for name, decl in (project.get("config") or {}).items():
        full = name if ":" in name else f"{project['name']}:{name}"
        if isinstance(decl, dict) and "default" in decl:
            out[full] = _config_text(decl["default"])
    return out


def stack_config(stack: str, **overrides) -> dict[str, str]:
    """Pulumi.<stack>.yaml's config over the project defaults; overrides use unqualified keys."""
    config = project_defaults()
    text = yaml.safe_load((REPO / f"Pulumi.{stack}.yaml").read_text())
    config.update({k: _config_text(v) for k, v in text["config"].items()})
    for name, value in overrides.items():
        full = f"gpu-swarm:{name}"
        if value is None:
            config.pop(full, None)
        else:
            config[full] = value if isinstance(value, str) else _config_text(value)
    return config


def request_inputs(request) -> dict:
    """A registration's inputs with secrets still wrapped, as plain JSON-like data."""
    return json_format.MessageToDict(request.object)


def is_secret(value) -> bool:
    return isinstance(value, dict) and value.get(rpc._special_sig_key) == rpc._special_secret_sig


def unwrap(value):
    """Drop secret wrappers, recursively."""
    if is_secret(value):
        return unwrap(value["value"])
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


@pytest.fixture(scope="module")
def engine():
    """The rehearsal's engine; the integration tests fail without it in CI (see require_engine)."""
    from tests.rehearsal_tools import require_engine
    return require_engine()
