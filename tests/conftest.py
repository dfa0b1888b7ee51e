"""Pulumi mocks for the program's tests: fake AWS answers and plausible resource state.

No AWS and no Pulumi CLI: `pulumi.runtime.set_mocks` runs the program in-process.
RecordingMonitor also keeps each registration request, because the dependencies,
secret markers and resource options are only visible there.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pulumi
import pytest
import yaml
from google.protobuf import json_format
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc


# One rehearsal per pytest-xdist worker (localswarm/lane.py, scripts/test.sh): worker gw0 is lane 1, gw1
# lane 2, and so on, set before anything of localswarm is imported. A run without workers is lane 0,
# the user's own rehearsal; workers never touch it.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["GPU_SWARM_LANE"] = str(int(os.environ["PYTEST_XDIST_WORKER"][2:]) + 1)

REPO = Path(__file__).resolve().parent.parent
# The node programs import their siblings (gpu_agent imports gpu_detect), as they do on a node.
sys.path.insert(0, str(REPO / "node"))
from components import collector
from localswarm import fake_aws, fake_groups, fake_iam, schema_checks
from settings import image_registry
from localswarm.fake_aws import (  # noqa: F401  (the tests import these from here)
    ACCOUNT, AMIS, ARM_AMI, BLOCK_RESERVATION, CUSTOM_AMI, CUSTOM_AMI_NEXT, DEEP_LEARNING_AMI, INSTANCE_TYPES,
    OFFERED_IN, OTHER_VPC, REGION, RESERVATION, SUBNETS, UBUNTU_AMI, VPC, VPC_CIDRS, ZONES, answer, bucket_state,
)
from localswarm.stack_config import config_text as _config_text, project_defaults, stack_config  # noqa: F401


def urn(stack: str, project: str, parent: str, typ: str, name: str) -> str:
    """The engine's URN: the parent's whole type chain ($-joined), but not the stack's own type. A resource
    whose parent or type changes is another resource to the engine (pulumi/sdk/go/common/resource/urn.go)."""
    if parent:
        parent_type = parent.split("::")[2]
        if parent_type != "pulumi:pulumi:Stack":
            typ = f"{parent_type}${typ}"
    return f"urn:pulumi:{stack}::{project}::{typ}::{name}"


def fake_node_id(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:25]


def fake_gpu_uuid(name: str, index: int) -> str:
    h = hashlib.sha1(f"{name}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# The suite runs the program hundreds of times in this process: each run's graph must be freed
# (components/collector.py).
collector.FREEZE = False


class AwsMocks(pulumi_mocks.Mocks):
    def call(self, args: pulumi_mocks.MockCallArgs):
        return answer(args.token, args.args)

    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        state = dict(args.inputs)
        if args.resource_id:  # a read of something that exists (Resource.get)
            if args.typ == "aws:ec2/capacityReservation:CapacityReservation":
                return args.resource_id, fake_aws.capacity_reservation_state(args.resource_id)
            raise Exception(f"no fake AWS state to read for {args.typ} {args.resource_id}")
        if failures := schema_checks.check(args.typ, state):  # the provider's Check, before any call
            raise Exception(f"{args.typ} {args.name}: " + "; ".join(f"{p}: {why}" for p, why in failures))
        if args.typ in ("aws:ec2/instance:Instance", "aws:ec2/spotInstanceRequest:SpotInstanceRequest"):
            # What the instance will boot, for its boot wait to print (command_stdout).
            booted = re.search(r"GPU_SWARM_RELEASE=([0-9a-f]{64})", str(state.get("userData") or ""))
            BOOTED_RELEASE[args.name] = booted[1] if booted else ""
            launch = fake_aws.launch if args.typ == "aws:ec2/instance:Instance" else fake_aws.request_spot
            return launch(args.name, state)
        if args.typ == "aws:ec2/tag:Tag":
            fake_aws.tag(state)
        if args.typ == "aws:ec2/eip:Eip":
            return fake_aws.allocate_address(args.name, state)
        if args.typ == "aws:ec2/eipAssociation:EipAssociation":
            state["publicIp"] = fake_aws.associate_address(state)
            return f"eipassoc-{hashlib.sha1(args.name.encode()).hexdigest()[:17]}", state
        if args.typ == "aws:ec2/subnet:Subnet":
            subnet_id = f"{args.name}-id"
            ACCOUNT.subnets[subnet_id] = {"vpcId": state.get("vpcId"), "availabilityZone": state["availabilityZone"],
                                          "tags": dict(state.get("tags") or {})}
            return subnet_id, state
        if args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            return fake_aws.launch_template(args.name, state)
        if args.typ == "aws:ec2/placementGroup:PlacementGroup":
            return args.name, {**state, "name": state.get("name") or f"{args.name}-pg"}
        if args.typ == "tls:index/privateKey:PrivateKey":
            if args.name.endswith("-host-key"):  # each node its own: tests check that each pins its own
                state["privateKeyOpenssh"], state["publicKeyOpenssh"] = fake_host_key(args.name)
            else:
                state["privateKeyOpenssh"] = "-----BEGIN OPENSSH PRIVATE KEY-----\nZmFrZQ==\n-----END OPENSSH PRIVATE KEY-----\n"
                state["publicKeyOpenssh"] = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake\n"
        if args.typ == "aws:s3/bucket:Bucket":
            fake_aws.check_tags(state.get("tags"), "s3-bucket", f"creating S3 Bucket ({args.name})")
            bucket, extra = bucket_state(args.name)
            return bucket, {**state, **extra}
        if args.typ == "aws:ssm/parameter:Parameter":
            return f"{args.name}-id", fake_aws.ssm_parameter(args.name, state)
        if args.typ == "aws:autoscaling/group:Group":
            group = fake_groups.create_group(ACCOUNT.groups, state["name"], state)
            return state["name"], {**state, "arn": group["arn"]}
        if args.typ == "aws:iam/role:Role":
            return fake_iam.iam_role(args.name, state)
        if args.typ == "aws:iam/instanceProfile:InstanceProfile":
            return fake_iam.instance_profile(args.name, state)
        if args.typ == "aws:iam/rolePolicy:RolePolicy":
            return fake_iam.role_policy(args.name, state)
        if args.typ == "aws:s3/bucketObjectv2:BucketObjectv2":
            fake_aws.put_object(str(state.get("bucket")), state.get("key", ""), state.get("tags"))
        if args.typ == "aws:ec2/vpcEndpoint:VpcEndpoint":
            return f"vpce-{hashlib.sha1(args.name.encode()).hexdigest()[:17]}", state
        if args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = f"{args.name}-1234567"
        if args.typ == "command:remote:Command":
            state["stdout"] = command_stdout(args.name, state.get("create") or "")
        return f"{args.name}-id", state


FAKE_CLUSTER_ID = "fakeclusterid000000000001"
BOOTED_RELEASE: dict[str, str] = {}  # instance resource name -> the release its user data installs


def fake_host_key(name: str) -> tuple[str, str]:
    """A node's host key pair as pulumi-tls encodes it: the public half is a well-formed ssh-ed25519 key."""
    import base64
    import struct
    point = hashlib.sha256(name.encode()).digest()
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + point
    private = ("-----BEGIN OPENSSH PRIVATE KEY-----\n" + base64.b64encode(b"host:" + point).decode()
               + "\n-----END OPENSSH PRIVATE KEY-----\n")
    return private, f"ssh-ed25519 {base64.b64encode(blob).decode()}\n"


def command_stdout(name: str, create: str) -> str:
    """What a node would print for the builders in swarm/ and to_node/software.py."""
    if "join-token -q worker" in create:
        return '{"worker": "SWMTKN-1-worker-secret", "manager": "SWMTKN-1-manager-secret"}\n'
    if '"manager": true, "cluster_id"' in create:  # a probe: fresh managers are in no swarm
        return '{"state": "absent", "manager": false}\n'
    if "docker swarm init" in create:
        return json.dumps({"cluster_id": FAKE_CLUSTER_ID, "node_id": fake_node_id(name), "created": True}) + "\n"
    if "/swarm/join" in create and "docker swarm init" not in create:  # join_swarm
        return fake_node_id(name) + "\n"
    if "elastic nodes read at" in create:  # swarm/health.py read_elastic_nodes: one node of pool t4 joined
        resources = [{"NamedResourceSpec": {"Kind": "NVIDIA-GPU", "Value": fake_gpu_uuid("elastic", 0)}}]
        return json.dumps({"id": fake_node_id("elastic"), "hostname": "ip-10-42-0-99", "state": "ready",
                           "availability": "active", "condition": "healthy", "reason": "ok", "gpu": "-",
                           "since": "1800000000", "drainedBy": "", "health": "", "healthLast": "", "pool": "t4",
                           "instance": "i-0e1a571c0000000001", "addr": "10.42.0.99", "resources": resources,
                           "software": "", "verified": ""}) + "\n"
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
        timings = '{"install-docker": {"seconds": 41.250, "status": "done"}}\n'
        if name.endswith("-wait"):  # wait_for_boot: the release the node's user data installed, then the timings
            instance = name.replace("-boot-", "-", 1).removesuffix("-wait")
            return f"release {BOOTED_RELEASE[instance]}\n" + timings
        return timings
    if "stack_settle.py" in create:  # deploy_stack: node/stack_settle.py's report, one GPU replica waiting
        stack = re.search(r"--stack (\S+)", create)[1]
        service, why = f"{stack}_gpu", "no suitable node (insufficient resources on 1 node)"
        tasks = [{"slot": 1, "node": "ip-10-42-0-7", "state": "running", "desired_state": "running", "reason": "",
                  "exit_code": None},
                 {"slot": 2, "node": "", "state": "pending", "desired_state": "running", "reason": why,
                  "exit_code": None}]
        report = {"stack": stack, "settled": True, "seconds": 4.2, "problems": [],
                  "services": [{"name": service, "mode": "replicated", "replicas": 2, "tasks": tasks,
                                "outcome": "1 running, 1 waiting for resources"}],
                  "waiting": [{"service": service, "slot": 2, "reason": why}]}
        return f"deploying stack {stack}\n" + json.dumps(report) + "\n"
    return ""


class _InvokeError(grpc.RpcError):
    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self):
        return grpc.StatusCode.UNKNOWN

    def details(self):
        return self._details


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """Keeps every RegisterResource request by resource name, and every registered output."""

    def __init__(self, mocks: pulumi_mocks.Mocks):
        super().__init__(mocks)
        self.requests = {}
        self.ids = {}  # resource name -> the id its provider gave it
        self.urns = {}  # resource name -> its URN, the engine's identity for it
        self.reads = {}
        self.invokes = set()  # every data source token the program asked
        self.duplicate_names = []
        self.outputs = {}

    def make_urn(self, parent: str, type_: str, name: str) -> str:
        # The engine's URN holds every parent's type; the SDK's mock keeps only the nearest one.
        return urn(pulumi.get_stack(), pulumi.get_project(), parent, type_, name)

    def RegisterResource(self, request):
        if request.name in self.requests:
            self.duplicate_names.append(request.name)
        self.requests[request.name] = request
        self.urns[request.name] = self.make_urn(request.parent, request.type, request.name)
        response = super().RegisterResource(request)
        self.ids[request.name] = response.id
        return response

    def Invoke(self, request):
        """A data source that fails reaches the program as the engine hands it over: a gRPC error,
        which the SDK raises to the caller alone (it may catch it), not as an unhandled failure."""
        self.invokes.add(request.tok)
        try:
            return super().Invoke(request)
        except Exception as exc:  # the mock's answer for a lookup AWS refuses
            raise _InvokeError(f"invocation of {request.tok} returned an error: {exc}") from None

    def ReadResource(self, request):  # Resource.get: what the program reads, kept apart (no inputs of its own)
        self.reads[request.name] = request
        return super().ReadResource(request)

    def RegisterResourceOutputs(self, request):
        self.outputs[request.urn] = json_format.MessageToDict(request.outputs)
        return super().RegisterResourceOutputs(request)

    def stack_outputs(self) -> dict:
        return next(v for urn, v in self.outputs.items() if urn.split("::")[2] == "pulumi:pulumi:Stack")


def use_mocks(config: dict[str, str], secret_keys: tuple[str, ...] = (), stack: str = "test",
              keep_account: bool = False) -> RecordingMonitor:
    """Point the Pulumi runtime at the mocks, with this config (fully qualified keys).

    keep_account: AWS still holds what the last run made (a second `pulumi up` of one stack);
    otherwise the account is fresh."""
    if not keep_account:
        fake_aws.reset_account()
    # No test reaches a real registry: each is a closed loopback port that refuses at once, so preview's CUDA
    # check (settings/cuda_checks.py) warns and goes on; a test that reads images points ENDPOINTS at its own.
    image_registry.ENDPOINTS.clear()
    image_registry.ENDPOINTS["*"] = "http://127.0.0.1:9"
    # The SDK makes its futures on the thread's current loop; a test before may have closed or cleared it.
    try:
        loop = asyncio.get_event_loop()
    except RuntimeError:
        loop = None
    if loop is None or loop.is_closed():
        asyncio.set_event_loop(asyncio.new_event_loop())
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


def run_program(config: dict[str, str], secret_keys: tuple[str, ...] = (), stack: str = "test",
                keep_account: bool = False) -> ProgramRun:
    """Run __main__.py under the mocks, as `pulumi up` would, and collect its stack outputs."""
    run = ProgramRun(use_mocks(config, secret_keys, stack, keep_account))

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


# The rehearsal modules whose tests take longest in CI (`pytest --durations`), slowest first: they start
# first, so that no worker is left with a long one at the end while the others idle. The unit tests,
# each its own unit of work, fill in after them.
# test_pulumi_capacity_block goes last: beside the host-engine group (the GPU benches) the MPS bench's stall
# drill missed its 30 s in both CIs of stop 53, and passed alone in 173.8 s (stop 53's closing note).
SLOWEST_FIRST = ("test_pulumi_up", "test_program_day2", "test_elastic_rehearsal", "test_pulumi_pool", "test_benches",
                 "test_gpu_mps_bench", "test_pulumi_spot", "test_metrics_rehearsal",
                 "test_program_stacks", "test_sharing_rehearsal", "test_pulumi_leader_change", "test_pulumi_capacity_block")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist loadgroup), what must run in one worker: a rehearsal module's tests,
    which share its cluster (module fixtures, one lane), unless a test names its own group; and every
    test that starts an engine in the host's own namespace (group "host-engine": two such engines
    would both take the host's swarm ports)."""
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__.rpartition(".")[2]))

    def rank(item) -> int:
        module = item.module.__name__.rpartition(".")[2]
        if not item.get_closest_marker("integration"):
            return len(SLOWEST_FIRST) + 1
        return SLOWEST_FIRST.index(module) if module in SLOWEST_FIRST else len(SLOWEST_FIRST)
    items.sort(key=rank)  # stable: each module keeps its own order
