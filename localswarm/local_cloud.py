"""The rehearsal's resource handlers: what AWS and the providers do to one resource, on real machines and real SSH.

Pulumi's real CLI decides every step; the rehearsal's provider plugins (localswarm/plugin_cloud.py)
hand each create and update here, one resource at a time, in the shape of Pulumi's Mocks.new_resource:
- an aws.ec2.Instance becomes a machine (localswarm/machines.py) that boots its user data;
- a command.remote.Command runs its script over SSH (localswarm/ssh.py);
- the node software's bundle goes to the S3 stand-in (localswarm/object_store.py);
- a tls.PrivateKey is a real key of its algorithm (localswarm/tls_keys.py), so the machines take the program's key.
Given the resource as the state held it, a handler does what the provider does with the change: an
unchanged command runs nothing, a changed one runs its update (or its create when it has no update);
an in-place change that AWS makes with a stop (a new type, user data) stops the machine, changes it
(a new type has its own GPUs) and starts it. What it cannot tell from one step (a replacement, a
delete) the engine sends as a create and a delete of their own (localswarm/plugin_cloud.py): an
update that the provider's replace rules make a replacement is refused, as the provider's Diff would
have made it a replacement.
"""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pulumi.runtime import mocks as pulumi_mocks, rpc

from components.provider_facts import replaced_by
from localswarm import elastic_cloud, fake_account, fake_aws, fake_imds, machines, network, object_store, ssh, tls_keys
from localswarm.network import BRIDGE_ADDR, SUBNET

INSTANCE = "aws:ec2/instance:Instance"
# A persistent spot node of an earlier release: a state that holds one deletes it (terminating its machine).
SPOT_REQUEST = "aws:ec2/spotInstanceRequest:SpotInstanceRequest"
COMMAND = "command:remote:Command"
EC2_SUBNET = "aws:ec2/subnet:Subnet"
# aws.ec2.Instance inputs that the provider changes with a stop, a modify and a start.
STOPPED_TO_CHANGE = ("instanceType", "cpuOptions", "userData", "userDataBase64")
GROUP = "aws:autoscaling/group:Group"  # an elastic pool's: its machines are its own (localswarm/elastic_cloud.py)


@dataclass
class Action:
    """What the run did to one resource, for the report."""

    name: str
    typ: str
    action: str  # create, replace, update, same, delete
    seconds: float = 0.0
    host: str = ""


@dataclass
class LocalCloud(pulumi_mocks.Mocks):
    previous: dict  # name -> {"type", "id", "inputs", "outputs"} from the last run
    region: str
    say: Callable[[str], None]
    clock: Callable[[], float]
    current: dict = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    machines_by_instance: dict = field(default_factory=dict)  # instance id -> machine record
    next_index: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    options: threading.local = field(default_factory=threading.local)  # the registering request's options

    # ------------------------------------------------------------------ the engine's part

    def call(self, args: pulumi_mocks.MockCallArgs):
        if args.token == "aws:ec2/getInstances:getInstances":
            return self._instances_in_states(args.args)
        if args.token in ("aws:ec2/getSubnets:getSubnets", "aws:ec2/getSubnet:getSubnet"):
            self._subnets_made()
        return fake_aws.answer(args.token, args.args)

    def _existing(self) -> list[dict]:
        """What exists in AWS: what earlier runs made and what this one has made so far."""
        with self.lock:
            return list({**self.previous, **self.current}.values())

    def _subnets_made(self) -> None:
        """AWS answers subnet lookups from what exists: the subnets the last run made are there (a zone
        dropped from availabilityZones keeps its subnet, which running nodes still use)."""
        existing = self._existing()
        with self.lock:
            for r in existing:
                if r["type"] == EC2_SUBNET:
                    made = r["inputs"]
                    fake_aws.ACCOUNT.subnets[r["id"]] = {"vpcId": made.get("vpcId"), "tags": made.get("tags") or {},
                                                         "availabilityZone": made.get("availabilityZone")}

    def _instances_in_states(self, args: dict) -> dict:
        """aws.ec2.get_instances as AWS answers it here: the instances of the last run in the states asked
        (running by default), a machine that runs being running and one whose disk is kept stopped."""
        wanted = {k: v for k, v in (args.get("instanceTags") or {}).items()}
        states = set(args.get("instanceStateNames") or ["running"])
        found = []
        for r in self._existing():
            record = self.machines_by_instance.get(r["id"]) if r["type"] == INSTANCE else None
            tags = r["inputs"].get("tags") or {}
            if not record or not all(tags.get(k) == v for k, v in wanted.items()):
                continue
            m = machines.Machine(record["machine"], record["index"])
            state = "running" if machines.running(m) else "stopped" if m.dir.exists() else "terminated"
            if state in states:
                found.append((r["id"], r["outputs"]))
        return {"id": self.region, "ids": [i for i, _ in found], "privateIps": [o.get("privateIp") for _, o in found],
                "publicIps": [o.get("publicIp") or "" for _, o in found], "ipv6Addresses": []}

    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        urn = getattr(self.options, "urn", "") or args.name
        inputs = _plain(args.inputs)
        before = self.previous.get(urn)
        if before and before["type"] != args.typ:
            before = None
        # ignore_changes is the engine's: the inputs an update brings have the old values of those already.
        handler = {INSTANCE: self._instance, COMMAND: self._command,
                   "aws:s3/bucketObjectv2:BucketObjectv2": self._object, "aws:s3/bucket:Bucket": self._bucket,
                   "aws:ec2/keyPair:KeyPair": self._key_pair, "aws:ec2/eip:Eip": self._eip,
                   "aws:ec2/eipAssociation:EipAssociation": self._eip_association,
                   "tls:index/privateKey:PrivateKey": self._private_key, GROUP: self._elastic,
                   "aws:ec2/launchTemplate:LaunchTemplate": self._elastic, "aws:iam/role:Role": self._elastic,
                   "aws:iam/instanceProfile:InstanceProfile": self._elastic,
                   "aws:iam/rolePolicy:RolePolicy": self._elastic,
                   "aws:ssm/parameter:Parameter": self._elastic}.get(args.typ, self._other)
        self.options.typ = args.typ
        rid, outputs = handler(args.name, inputs, before)
        with self.lock:
            self.current[urn] = {"type": args.typ, "id": rid, "inputs": inputs, "outputs": outputs}
        return rid, outputs

    def _change(self, typ: str, before: dict | None, inputs: dict) -> str:
        """create, same or update, as the engine sent the step. A replacement comes as a create of its own
        and a delete; an update that the replace rules (components/provider_facts.py) make a replacement
        means the plugin's Diff and these handlers disagree, and is refused rather than done in place."""
        if before is None:
            return "create"
        if before["inputs"] == inputs:
            return "same"
        try:
            forced = replaced_by(typ, before["inputs"], inputs)
        except ValueError:
            forced = ["(a type with no recorded replace facts)"]
        if forced:
            raise Exception(f"{typ}: an update of {', '.join(forced)}, which the provider replaces: its Diff "
                            "should have asked the engine for a replacement")
        return "update"

    def _record(self, name: str, typ: str, action: str, seconds: float = 0.0, host: str = "") -> None:
        with self.lock:
            self.actions.append(Action(name, typ, action, seconds, host))

    # ------------------------------------------------------------------ resources

    def _command(self, name: str, inputs: dict, before: dict | None):
        change = self._change(COMMAND, before, inputs)
        if change == "same":
            self._record(name, COMMAND, "same")
            return before["id"], before["outputs"]
        # pulumi-command runs `update` for an update, when the command has one, and `create` otherwise.
        script = inputs["update"] if change == "update" and inputs.get("update") else inputs.get("create")
        if not script:
            # Nothing to run (no `create`, or neither for an update): the provider dials nothing, and
            # keeps an update's previous stdout and stderr. Recorded with no host: no command ran.
            self._record(name, COMMAND, change)
            kept = before["outputs"] if before and change == "update" else {}
            return (before["id"] if before and change == "update" else f"{name}-{uuid.uuid4().hex[:8]}",
                    {**inputs, "stdout": kept.get("stdout", ""), "stderr": kept.get("stderr", "")})
        conn = inputs["connection"]
        secret = inputs.get("logging") == "none"
        self.say(f"{name}: running on {conn['host']}" + (f" (through {conn['proxy']['host']})"
                                                         if conn.get("proxy") else ""))
        try:
            result = ssh.run(conn, script, stdin=inputs.get("stdin"))
        except ssh.CommandFailed as e:
            self._record(name, COMMAND, f"{change}-failed", host=conn["host"])
            raise Exception(f"{name}: {e}") from None
        self._record(name, COMMAND, change, result.seconds, conn["host"])
        shown = "" if secret or not result.stdout else f": {result.stdout.splitlines()[-1][:100]}"
        self.say(f"{name}: done in {result.seconds:.1f} s{shown}")
        return (before["id"] if before and change == "update" else f"{name}-{uuid.uuid4().hex[:8]}",
                {**inputs, "stdout": result.stdout, "stderr": result.stderr})

    def _instance(self, name: str, inputs: dict, before: dict | None, typ: str = INSTANCE):
        change = self._change(typ, before, inputs)
        if change in ("same", "update"):
            if change == "update" and any(before["inputs"].get(k) != inputs.get(k) for k in STOPPED_TO_CHANGE):
                self._stop_change_start(name, before, inputs)
            if change == "update" and before["inputs"].get("iamInstanceProfile") != inputs.get("iamInstanceProfile"):
                self._associate_profile(before, inputs)  # AssociateIamInstanceProfile: in place, no stop
            self._record(name, typ, change)
            return before["id"], {**before["outputs"], **inputs}
        launched = fake_account.as_launched(name, inputs)  # what EC2 refuses, or keeps of the launch's options
        with self.lock:
            index, self.next_index = self.next_index, self.next_index + 1
        instance_id = f"i-{hashlib.sha1(f'{name}/{index}/{time.time()}'.encode()).hexdigest()[:17]}"
        eni = f"eni-{hashlib.sha1(instance_id.encode()).hexdigest()[:17]}"
        hostname = inputs["tags"]["Name"]
        gpus = [{"uuid": f"GPU-{uuid.uuid4()}", "name": f"NVIDIA {model}", "memory_mib": memory}
                for model, memory in fake_aws.gpus_of(inputs["instanceType"])]
        public_key = self._public_key(inputs["keyName"])
        # What IMDS answers the machine, in place before it boots: its first request finds it.
        iam = elastic_cloud.instance_credentials(inputs.get("iamInstanceProfile"), instance_id)
        fake_imds.register(fake_imds.RECORDS, network.node_addr(index), {
            "instance-id": instance_id, "ami-id": inputs["ami"], "user-data": inputs["userData"],
            "local-ipv4": network.node_addr(index), "metadataOptions": launched["metadataOptions"],
            "instance-life-cycle": fake_account.instance_lifecycle(inputs) or "on-demand",
            **({"iam": iam} if iam else {})})
        machine = machines.launch(
            f"{network.NETNS_PREFIX}{index}", index, user_data=inputs["userData"],
            # ami-id as IMDS has it: the image the instance was launched from, which it keeps.
            meta_data={"instance-id": instance_id, "ami-id": inputs["ami"], "local-hostname": hostname,
                       "public-keys": [public_key]},
            gpus=gpus, hosts={host: BRIDGE_ADDR for host in [*self._bucket_hosts(), *elastic_cloud.api_hosts(self.region)]})
        with self.lock:
            record = {"machine": machine.name, "index": index, "hostname": hostname, "eni": eni,
                      "role": inputs["tags"].get("gpu-swarm:role", "worker")}
            self.machines_by_instance[instance_id] = record
        self._record(name, typ, change, host=machine.address)
        self.say(f"{name}: machine {machine.name} ({hostname}, {len(gpus)} GPU) booting at {machine.address}")
        outputs = {**inputs, "privateIp": machine.address, "publicIp": machine.address, "instanceState": "running",
                   "primaryNetworkInterfaceId": eni, "instanceLifecycle": fake_account.instance_lifecycle(inputs) or ""}
        return instance_id, outputs

    def _stop_change_start(self, name: str, before: dict, inputs: dict) -> None:
        """What the provider does for a new type or user data: StopInstances, ModifyInstanceAttribute,
        StartInstances. Another type is other hardware: the machine boots with that type's GPUs."""
        record = self.machines_by_instance.get(before["id"])
        if not record:
            return
        m = machines.Machine(record["machine"], record["index"])
        self.say(f"{name}: stopping {record['hostname']} to change it in place")
        machines.stop(m)
        if before["inputs"].get("instanceType") != inputs.get("instanceType"):
            machines.set_gpus(m, [{"uuid": f"GPU-{uuid.uuid4()}", "name": f"NVIDIA {model}", "memory_mib": memory}
                                  for model, memory in fake_aws.gpus_of(inputs["instanceType"])])
        machines.start(m)
        self.say(f"{name}: {record['hostname']} started again as {inputs.get('instanceType')}")

    def _associate_profile(self, before: dict, inputs: dict) -> None:
        """The instance's IMDS answers its new role's credentials from now on."""
        record = self.machines_by_instance.get(before["id"])
        if not record:
            return
        address = network.node_addr(record["index"])
        try:
            known = json.loads((fake_imds.RECORDS / f"{address}.json").read_text())
        except (OSError, ValueError):
            return
        iam = elastic_cloud.instance_credentials(inputs.get("iamInstanceProfile"), before["id"])
        known.pop("iam", None)
        fake_imds.register(fake_imds.RECORDS, address, {**known, **({"iam": iam} if iam else {})})

    def _elastic(self, name: str, inputs: dict, before: dict | None):
        """An elastic pool's resources: kept where the rehearsal's AWS endpoints read them (elastic_cloud.py)."""
        typ = self.options.typ
        if typ == "aws:iam/role:Role":
            rid, extra = elastic_cloud.role(name, before)
        elif typ == "aws:iam/instanceProfile:InstanceProfile":
            rid, extra = elastic_cloud.instance_profile(name, inputs, before)
        elif typ == "aws:iam/rolePolicy:RolePolicy":
            rid, extra = elastic_cloud.role_policy(name, inputs), {}
        elif typ == "aws:ssm/parameter:Parameter":
            with self.lock:  # the names its account holds, for a create (a replacement's too)
                held = set() if before else {r["inputs"].get("name") for r in self.current.values() if r["type"] == typ}
            rid, extra = (before["id"] if before else f"{name}-{uuid.uuid4().hex[:8]}"), \
                elastic_cloud.parameter(inputs, self.region, held)
        elif typ == "aws:ec2/launchTemplate:LaunchTemplate":
            rid, extra = elastic_cloud.launch_template(name, inputs, before, self._public_key(inputs["keyName"])
                                                       if inputs.get("keyName") else "")
        else:
            rid, extra = elastic_cloud.group(name, inputs, before)
        self._record(name, typ, "same" if before and before["inputs"] == inputs else "update" if before else "create")
        return rid, {**inputs, **extra}

    def _terminate(self, resource: dict) -> None:
        # A spot request's machine is its instance's (deleting the request cancels it, then terminates that).
        with self.lock:  # a parallel step may be writing the machines out (localswarm/plugin_cloud.py)
            record = self.machines_by_instance.pop(resource["outputs"].get("spotInstanceId") or resource["id"], None)
        if record:
            m = machines.Machine(record["machine"], record["index"])
            machines.terminate(m)
            fake_imds.unregister(fake_imds.RECORDS, m.address)
            self.say(f"machine {record['machine']} ({record['hostname']}) terminated")

    def _public_key(self, key_name: str) -> str:
        with self.lock:
            pairs = [r for r in self.current.values() if r["type"] == "aws:ec2/keyPair:KeyPair"]
        for pair in pairs:
            if pair["outputs"].get("keyName") == key_name:
                return pair["outputs"]["publicKey"].strip()
        raise Exception(f"InvalidKeyPair.NotFound: The key pair '{key_name}' does not exist")

    def _bucket_hosts(self) -> list[str]:
        with self.lock:
            return [r["outputs"]["bucketRegionalDomainName"] for r in self.current.values()
                    if r["type"] == "aws:s3/bucket:Bucket"]

    def _bucket(self, name: str, inputs: dict, before: dict | None):
        if before:
            return before["id"], {**before["outputs"], **inputs}
        bucket, extra = fake_aws.bucket_state(name, self.region)
        return bucket, {**inputs, **extra}

    def _object(self, name: str, inputs: dict, before: dict | None):
        bucket = self._bucket_name(inputs["bucket"])
        object_store.put(bucket, inputs["key"], base64.b64decode(inputs["contentBase64"]))
        self._record(name, "aws:s3/bucketObjectv2:BucketObjectv2", "same" if before else "create")
        return f"{bucket}/{inputs['key']}", {**inputs, "bucket": bucket}

    def _bucket_name(self, ref: str) -> str:
        with self.lock:
            for r in self.current.values():
                if r["type"] == "aws:s3/bucket:Bucket" and ref in (r["id"], r["outputs"].get("bucket")):
                    return r["outputs"]["bucket"]
        return ref

    def _private_key(self, name: str, inputs: dict, before: dict | None):
        if before and before["inputs"] == inputs:
            return before["id"], before["outputs"]
        return f"{name}-{uuid.uuid4().hex[:8]}", tls_keys.make(inputs)

    def _key_pair(self, name: str, inputs: dict, before: dict | None):
        if before and before["inputs"] == inputs:
            return before["id"], before["outputs"]
        key_name = f"{name}-{uuid.uuid4().hex[:7]}"  # auto-named, as the provider names it
        return key_name, {**inputs, "keyName": key_name}

    def _eip(self, name: str, inputs: dict, before: dict | None):
        """An Elastic IP: an address of the bridge's subnet, above the machines' own, kept across runs."""
        if before:
            return before["id"], before["outputs"]
        with self.lock:
            taken = {r["outputs"].get("publicIp") for r in (*self.previous.values(), *self.current.values())
                     if r["type"] == "aws:ec2/eip:Eip"}
            address = next(a for a in (str(SUBNET.network_address + 200 + k) for k in range(50)) if a not in taken)
            taken_by = getattr(self.options, "urn", "") or name
            self.current[taken_by] = {"type": "aws:ec2/eip:Eip", "id": "", "inputs": inputs,
                                      "outputs": {"publicIp": address}}  # taken, while this call returns
        allocation = f"eipalloc-{hashlib.sha1(f'{name}/{address}'.encode()).hexdigest()[:17]}"
        return allocation, {**inputs, "publicIp": address, "allocationId": allocation}

    def _eip_association(self, name: str, inputs: dict, before: dict | None):
        """The address added to the machine's interface, as AWS routes an associated Elastic IP to the instance."""
        with self.lock:
            address = next(r["outputs"]["publicIp"] for r in (*self.current.values(), *self.previous.values())
                           if r["type"] == "aws:ec2/eip:Eip" and r["id"] == inputs["allocationId"])
            # Through the instance's primary network interface, as the program associates it (node_pool.py).
            record = next((r for r in self.machines_by_instance.values()
                           if r.get("eni") == inputs.get("networkInterfaceId")), None) \
                or self.machines_by_instance.get(inputs.get("instanceId"))
        old = before and next((r for r in self.machines_by_instance.values()
                               if r.get("eni") == before["inputs"].get("networkInterfaceId")), None)
        if old and old is not record:  # replaced (delete_before_replace): the old association goes first
            subprocess.run(["ip", "-n", machines.Machine(old["machine"], old["index"]).netns, "addr", "del",
                            f"{address}/{SUBNET.prefixlen}", "dev", "eth0"], capture_output=True)
        if record:  # `addr replace`: the same again changes nothing
            run_quiet(["ip", "-n", machines.Machine(record["machine"], record["index"]).netns, "addr", "replace",
                       f"{address}/{SUBNET.prefixlen}", "dev", "eth0"])
        self._record(name, "aws:ec2/eipAssociation:EipAssociation", "same" if before else "create", host=address)
        return (before["id"] if before else f"eipassoc-{uuid.uuid4().hex[:17]}"), {**inputs, "publicIp": address}

    def disassociate(self, outputs: dict) -> None:
        """DisassociateAddress: the association's address leaves its machine's interface. The engine deletes a
        replaced association (delete_before_replace) before it makes the new one: without this the old
        machine would keep answering at the address, and the new node's commands would reach it."""
        with self.lock:
            record = next((r for r in self.machines_by_instance.values()
                           if r.get("eni") == outputs.get("networkInterfaceId")), None) \
                or self.machines_by_instance.get(outputs.get("instanceId"))
        if record and outputs.get("publicIp"):
            subprocess.run(["ip", "-n", machines.Machine(record["machine"], record["index"]).netns, "addr", "del",
                            f"{outputs['publicIp']}/{SUBNET.prefixlen}", "dev", "eth0"], capture_output=True)

    def _other(self, name: str, inputs: dict, before: dict | None):
        return (before["id"] if before else f"{name}-{uuid.uuid4().hex[:8]}"), dict(inputs)


def run_quiet(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _plain(value):
    """Inputs as JSON would keep them (the state file), so that two runs compare equal; secrets
    unwrapped, as a provider receives them."""
    if isinstance(value, dict):
        if value.get(rpc._special_sig_key) == rpc._special_secret_sig:
            return _plain(value.get("value"))
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return json.loads(json.dumps(value, default=str))
