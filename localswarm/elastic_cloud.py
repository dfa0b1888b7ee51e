"""Elastic pools in the rehearsal: what `localswarm pulumi up` makes of their AWS resources, and the machines their groups run.

LocalCloud (localswarm/local_cloud.py) hands the program's IAM roles, instance profiles and policies, its SSM
parameters, launch templates and Auto Scaling groups to the functions here, which keep them in the shared
state of the rehearsal's AWS endpoints (localswarm/fake_aws_api.py Store, STORE below). A group's instances are
rehearsal machines: launch_instance boots one from the group's launch template, its user data through real
cloud-init, with IMDS answering its instance id, address and its role's credentials (which the endpoints then
accept). The object store's server process (localswarm/object_store.py) answers the machines' API calls and
runs each group's converge; `localswarm pulumi up` converges a group it has just made or changed, and terminates a
group's machines with it.
"""
from __future__ import annotations

import base64
import hashlib
import re
import secrets
import uuid

from localswarm import fake_account, fake_aws, fake_groups, fake_imds, machines, network
from localswarm.fake_account import ACCOUNT_ID, DEFAULT_METADATA, AwsError
from localswarm.fake_aws_api import Store

STORE = Store(machines.STATE / "aws-api" / "state.json")
GROUP_INDEXES = range(244, 150, -1)  # group machines take addresses from the top; `localswarm pulumi up`'s from the bottom


def api_hosts(region: str) -> list[str]:
    """The endpoints the node software calls, which the machines' /etc/hosts send to the bridge."""
    return [f"autoscaling.{region}.amazonaws.com", f"ssm.{region}.amazonaws.com"]


def _digest(text: str, n: int = 7) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def role(name: str, before: dict | None) -> tuple[str, dict]:
    role_name = before["id"] if before else f"{name}-{_digest(name + uuid.uuid4().hex)}"
    with STORE.changing() as state:
        state["roles"].setdefault(role_name, {"policies": {}})
    return role_name, {"name": role_name, "arn": f"arn:aws:iam::{ACCOUNT_ID}:role/{role_name}"}


def instance_profile(name: str, inputs: dict, before: dict | None) -> tuple[str, dict]:
    profile = before["id"] if before else f"{name}-{_digest(name + uuid.uuid4().hex)}"
    with STORE.changing() as state:
        state["profiles"][profile] = inputs.get("role")
    return profile, {"name": profile, "arn": f"arn:aws:iam::{ACCOUNT_ID}:instance-profile/{profile}"}


def role_policy(name: str, inputs: dict) -> str:
    import json
    with STORE.changing() as state:
        state["roles"].setdefault(inputs["role"], {"policies": {}})["policies"][name] = json.loads(inputs["policy"])
    return f"{inputs['role']}:{name}"


def parameter(inputs: dict, region: str, held: set[str]) -> dict:
    """An SSM parameter: a SecureString (a pool's join) is what the endpoint answers GetParameter with.

    held: the names the account has. The provider creates with PutParameter, Overwrite false unless
    `overwrite` is set (terraform-provider-aws internal/service/ssm/parameter.go, shouldUpdateParameter:
    false for a new resource), and SSM refuses a name that exists (SSM API Reference, PutParameter:
    ParameterAlreadyExists). So a replacement made before its original goes (Pulumi's default) fails."""
    if inputs["name"] in held and not inputs.get("overwrite"):
        raise AwsError(f"creating SSM Parameter ({inputs['name']}): operation error SSM: PutParameter, https response "
                       "error StatusCode: 400, ParameterAlreadyExists: The parameter already exists. To overwrite "
                       "this value, set the overwrite option in the request to true.")
    if inputs.get("type") == "SecureString":
        with STORE.changing() as state:
            state["parameters"][inputs["name"]] = {"type": "SecureString", "value": inputs.get("value")}
    return {"arn": f"arn:aws:ssm:{region}:{ACCOUNT_ID}:parameter{inputs['name']}"}


def launch_template(name: str, inputs: dict, before: dict | None, public_key: str) -> tuple[str, dict]:
    """A template, a new version whenever its inputs change (the provider's update of aws.ec2.LaunchTemplate)."""
    template_id = before["id"] if before else f"lt-{_digest(name, 17)}"
    version = (before["outputs"].get("latestVersion", 1) + (before["inputs"] != inputs)) if before else 1
    profile = ((inputs.get("iamInstanceProfile") or {}).get("arn") or "").rsplit("/", 1)[-1]
    with STORE.changing() as state:
        state["templates"][template_id] = {
            "version": version, "userData": inputs.get("userData", ""), "imageId": inputs.get("imageId"),
            "instanceType": inputs.get("instanceType"), "publicKey": public_key, "profile": profile,
            "metadataOptions": inputs.get("metadataOptions") or {},
            "lifecycle": fake_account.instance_lifecycle(inputs) or "on-demand",  # its instanceMarketOptions
            "tags": next((t["tags"] for t in inputs.get("tagSpecifications") or [] if t.get("resourceType") == "instance"),
                         {})}
    return template_id, {"latestVersion": version}


def group(name: str, inputs: dict, before: dict | None) -> tuple[str, dict]:
    """CreateAutoScalingGroup, or UpdateAutoScalingGroup of its bounds and template (its desired capacity is
    ignored by the program); then it converges, launching what it lacks."""
    group_name = inputs["name"]
    with STORE.changing() as state:
        if group_name in state["groups"]:
            fake_groups.update_group(state["groups"], group_name, inputs)
        else:
            fake_groups.create_group(state["groups"], group_name, inputs)
        converge(state, group_name)
    return group_name, {"arn": fake_groups.group_arn(group_name)}


def delete_group(group_name: str) -> None:
    """DeleteAutoScalingGroup with ForceDelete: its machines go with it."""
    with STORE.changing() as state:
        fake_groups.delete_group(state["groups"], group_name, lambda instance: terminate_instance(state, instance))


def converge(state: dict, group_name: str) -> list:
    return fake_groups.converge(state["groups"], group_name, lambda g, i: launch_instance(state, g, i),
                                lambda i: terminate_instance(state, i))


def converge_all() -> None:
    with STORE.changing() as state:
        for name in list(state["groups"]):
            converge(state, name)


def credentials(state: dict, role_name: str, instance_id: str) -> dict:
    """Temporary credentials for an instance of `role_name`, as IMDS hands them and the endpoints accept them."""
    key = f"ASIA{secrets.token_hex(8).upper()}"
    record = {"role": role_name, "AccessKeyId": key, "SecretAccessKey": secrets.token_urlsafe(30),
              "Token": secrets.token_urlsafe(48), "Expiration": "2099-01-01T00:00:00Z"}
    state["credentials"][key] = {"secret": record["SecretAccessKey"], "token": record["Token"], "role": role_name,
                                 "instance": instance_id}
    return record


def launch_instance(state: dict, grp: dict, instance_id: str) -> None:
    """RunInstances from the group's launch template: a machine booting the template's user data."""
    template = state["templates"][grp["template"]["id"]]
    taken = {m.index for m in machines.machines()} | {r["index"] for r in state["machines"].values()}
    index = next(i for i in GROUP_INDEXES if i not in taken)
    address = network.node_addr(index)
    user_data = base64.b64decode(template["userData"]).decode()
    bucket = re.search(r"GPU_SWARM_BUNDLE_URL=https://([^/\s]+)/", user_data)
    region = grp["arn"].split(":")[3]
    hosts = {host: network.BRIDGE_ADDR for host in [*([bucket[1]] if bucket else []), *api_hosts(region)]}
    hostname = f"ip-{address.replace('.', '-')}"
    record = {"instance-id": instance_id, "ami-id": template["imageId"], "user-data": user_data,
              "local-ipv4": address, "metadataOptions": {**DEFAULT_METADATA, **template["metadataOptions"]},
              "instance-life-cycle": template.get("lifecycle", "on-demand")}
    role_name = state["profiles"].get(template["profile"])
    if role_name:
        record["iam"] = credentials(state, role_name, instance_id)
    fake_imds.register(fake_imds.RECORDS, address, record)
    gpus = [{"uuid": f"GPU-{uuid.uuid4()}", "name": f"NVIDIA {model}", "memory_mib": memory}
            for model, memory in fake_aws.gpus_of(template["instanceType"])]
    m = machines.launch(f"{network.NETNS_PREFIX}{index}", index, user_data=user_data, gpus=gpus, hosts=hosts,
                        meta_data={"instance-id": instance_id, "ami-id": template["imageId"],
                                   "local-hostname": hostname, "public-keys": [template["publicKey"]]})
    state["machines"][instance_id] = {"machine": m.name, "index": index, "hostname": hostname, "role": "worker",
                                      "group": grp["name"], "pool": template["tags"].get("gpu-swarm:pool", "")}


def terminate_instance(state: dict, instance_id: str) -> None:
    record = state["machines"].pop(instance_id, None)
    if record:
        m = machines.Machine(record["machine"], record["index"])
        machines.terminate(m)
        fake_imds.unregister(fake_imds.RECORDS, m.address)
    state["credentials"] = {k: v for k, v in state["credentials"].items() if v.get("instance") != instance_id}


def instance_credentials(profile: str | None, instance_id: str) -> dict | None:
    """A fixed instance's (a manager's) role credentials, for its IMDS record; None without a profile."""
    if not profile:
        return None
    with STORE.changing() as state:
        role_name = state["profiles"].get(profile)
        return credentials(state, role_name, instance_id) if role_name else None


def group_machines() -> list[dict]:
    """The machines of every group, as `localswarm status` lists nodes."""
    return list(STORE.read()["machines"].values())
