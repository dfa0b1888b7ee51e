"""The fake AWS account: what the program's resources make in it, and what EC2 and S3 refuse or do by themselves.

One model for the unit tests (tests/conftest.py's mocks) and the rehearsal (localswarm/local_cloud.py).
Each behaviour carries the document it follows; docs/reference/aws-behaviour.md lists them with the test
that holds this file to each. Two levels are kept apart, as they are on AWS: what an EC2 or S3 API call
does (launch, terminate, the clock), and what the pinned provider's Create, Read and Delete do with those
calls (provider_delete, provider_read).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

ACCOUNT_ID = "123456789012"
INSTANCE = "aws:ec2/instance:Instance"
SPOT_REQUEST = "aws:ec2/spotInstanceRequest:SpotInstanceRequest"

# EC2 tag limits (EC2 User Guide, "Tag restrictions"): 50 tags per resource, keys up to 128 and values up to
# 256 Unicode characters, the aws: prefix reserved. S3 objects (S3 User Guide, "Categorizing your storage
# using tags"): up to 10 tags per object, the same lengths. Buckets take 50.
TAG_LIMITS = {"ec2": 50, "s3-object": 10, "s3-bucket": 50}
TAG_KEY_CHARS, TAG_VALUE_CHARS = 128, 256
# A persistent request's ValidUntil when none is given: "Default: 7 days from the current date" (EC2 API
# reference, SpotMarketOptions and LaunchTemplateSpotMarketOptionsRequest).
DEFAULT_REQUEST_DAYS = 7
# What an instance launched without metadata options gets: HttpTokens optional (IMDSv1 answers) and a hop
# limit of 1, unless the AMI or the account's defaults say otherwise (EC2 User Guide, "Configure the
# instance metadata options for new instances", order of precedence). The fake's AMIs and account set none.
DEFAULT_METADATA = {"httpTokens": "optional", "httpPutResponseHopLimit": 1, "httpEndpoint": "enabled"}


class AwsError(Exception):
    """An error as the provider reports AWS's answer: the operation, then AWS's code and message."""


@dataclass
class Account:
    """What exists in the fake account besides the catalogue: what earlier runs of the program made."""

    subnets: dict = field(default_factory=dict)  # id -> {"vpcId", "availabilityZone", "tags"}
    # id -> {"state", "tags", "privateIp", "publicIp", "interfaces", "eni", "elasticIp", "lostPublicIp",
    #        "metadataOptions", "rootVolumeTags", "placementGroup", "launchTemplate", "subnetId",
    #        "securityGroupIds", "spotRequest", "tracked"}
    instances: dict = field(default_factory=dict)
    launch_templates: dict = field(default_factory=dict)  # id -> how many network interfaces it gives
    addresses: dict = field(default_factory=dict)  # Elastic IP allocation id -> its address
    # id -> {"state" (active, open, disabled, cancelled), "type" (persistent, one-time), "instance",
    #        "validUntil", "status"}
    spot_requests: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)  # "bucket/key" -> {"tags"}
    parameters: dict = field(default_factory=dict)  # SSM parameter name -> (its value, the generation it was made in)
    groups: dict = field(default_factory=dict)  # Auto Scaling group name -> its record (localswarm/fake_groups.py)
    roles: dict = field(default_factory=dict)  # IAM role name -> {"policies": {policy name: its document}}
    profiles: dict = field(default_factory=dict)  # instance profile name -> its role's name
    quotas: dict = field(default_factory=dict)  # quota code -> value, over DEFAULT_QUOTA
    denied: set = field(default_factory=set)  # IAM actions the operator's credentials may not call
    generations: dict = field(default_factory=dict)  # resource name -> times replaced (its id changes)
    now: datetime = field(default_factory=lambda: datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc))

    @property
    def quotas_readable(self) -> bool:
        return "servicequotas:GetServiceQuota" not in self.denied

    @quotas_readable.setter
    def quotas_readable(self, readable: bool) -> None:
        (self.denied.discard if readable else self.denied.add)("servicequotas:GetServiceQuota")

    def require(self, action: str, operation: str) -> None:
        """AccessDenied, in the words IAM uses, when the credentials lack `action`."""
        if action in self.denied:
            raise AwsError(f"{operation}: AccessDenied: User: arn:aws:iam::{ACCOUNT_ID}:user/operator is not "
                           f"authorized to perform: {action} because no identity-based policy allows the {action} "
                           "action")

    def stop(self, tag_name: str) -> str:
        """Stop the instance whose Name tag is tag_name (a spot reclaim, an operator): its id.

        A persistent request whose instance stops is `disabled` (EC2 User Guide, "Spot request status")."""
        found = next(i for i, inst in self.instances.items() if inst["tags"].get("Name") == tag_name)
        self.instances[found]["state"] = "stopped"
        request = self.spot_requests.get(self.instances[found].get("spotRequest") or "")
        if request and request["state"] == "active":
            request["state"] = "disabled"
        return found

    def start(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        request = self.spot_requests.get(inst.get("spotRequest") or "")
        if request and request["state"] == "cancelled":
            # "You can only start a Spot Instance if ... launched from a persistent request" that is not
            # cancelled; a cancelled request's stopped instance is terminated (EC2 User Guide, "Stop a Spot Instance").
            raise AwsError(f"starting EC2 Instance ({instance_id}): IncorrectSpotRequestState")
        inst["state"] = "running"
        if request and request["state"] == "disabled":
            request["state"] = "active"

    def stop_and_start(self, tag_name: str) -> str:
        """Stop and start it again: it keeps its Elastic IP, but loses an automatic public address, and
        DescribeInstances then reports no public IP (terraform-provider-aws#33775)."""
        found = self.stop(tag_name)
        self.start(found)
        inst = self.instances[found]
        if not inst.get("elasticIp"):
            inst["publicIp"], inst["lostPublicIp"] = None, True
        return found

    def replace(self, name: str) -> None:
        """The next run makes a new instance for resource `name` (pulumi up --replace): a new id."""
        self.generations[name] = self.generations.get(name, 0) + 1

    def advance(self, days: float) -> None:
        """Time passes. A persistent request whose ValidUntil passes is cancelled by EC2; its running instance
        runs on (status request-canceled-and-instance-running), and a stopped one is terminated
        (instance-terminated-by-service) (EC2 User Guide, "Spot request status"). An open request, whose
        instance was terminated, launches a new one: nothing tracks it, and it has none of the tags
        RunInstances gave the first (EC2 User Guide, "Terminate a Spot Instance")."""
        self.now += timedelta(days=days)
        for request_id, request in self.spot_requests.items():
            if request["type"] != "persistent" or request["state"] == "cancelled":
                continue
            if request["validUntil"] <= self.now:
                request["state"] = "cancelled"
                inst = self.instances.get(request["instance"])
                if inst and inst["state"] == "stopped":
                    inst["state"], request["status"] = "terminated", "instance-terminated-by-service"
                else:
                    request["status"] = "request-canceled-and-instance-running"
            elif request["state"] == "open":
                instance_id = f"i-{_digest(f'{request_id}/{self.now.isoformat()}')}"
                self.instances[instance_id] = {**_record(instance_id, {}, "running"), "tracked": False,
                                               "spotRequest": request_id}
                request.update(state="active", instance=instance_id)

    def live_spot_requests(self) -> list[str]:
        """Persistent requests not cancelled: AWS keeps (or starts again) an instance for each."""
        return sorted(i for i, r in self.spot_requests.items() if r["type"] == "persistent" and r["state"] != "cancelled")

    def running(self) -> list[str]:
        """Instances that bill: running or starting, tracked by the program's state or not."""
        return sorted(i for i, inst in self.instances.items() if inst["state"] in ("pending", "running"))


ACCOUNT = Account()


def reset_account() -> Account:
    """A fresh account for a fresh stack; the object stays the same, so every importer sees it."""
    fresh = Account()
    for name in fresh.__dataclass_fields__:
        setattr(ACCOUNT, name, getattr(fresh, name))
    return ACCOUNT


def _digest(text: str, n: int = 17) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def _record(instance_id: str, inputs: dict, state: str) -> dict:
    return {"state": state, "tags": {}, "privateIp": None, "publicIp": None, "interfaces": 1,
            "eni": f"eni-{_digest(instance_id)}", "elasticIp": None, "lostPublicIp": False,
            "metadataOptions": dict(DEFAULT_METADATA), "rootVolumeTags": {}, "placementGroup": None,
            "launchTemplate": None, "subnetId": None, "securityGroupIds": [], "spotRequest": None, "tracked": True}


def check_tags(tags: dict | None, limit: str, operation: str) -> None:
    """What EC2 and S3 refuse of a resource's tags (TAG_LIMITS), in the words of their errors."""
    tags = tags or {}
    if len(tags) > TAG_LIMITS[limit]:
        if limit == "s3-object":  # S3 error InvalidTag
            raise AwsError(f"{operation}: InvalidTag: Object tags cannot be greater than {TAG_LIMITS[limit]}")
        raise AwsError(f"{operation}: TagLimitExceeded: The maximum number of Tags for a resource has been reached "
                       f"({len(tags)} > {TAG_LIMITS[limit]})")
    for key, value in tags.items():
        if key.lower().startswith("aws:"):
            raise AwsError(f"{operation}: InvalidParameterValue: Tag keys starting with 'aws:' are reserved for "
                           "internal use")
        if len(key) > TAG_KEY_CHARS or len(str(value)) > TAG_VALUE_CHARS:
            raise AwsError(f"{operation}: InvalidParameterValue: a tag key exceeds {TAG_KEY_CHARS} or its value "
                           f"{TAG_VALUE_CHARS} characters ({key[:40]})")


def _spot(inputs: dict) -> dict:
    market = inputs.get("instanceMarketOptions") or {}
    return (market.get("spotOptions") or {}) if market.get("marketType") == "spot" else {}


def instance_lifecycle(inputs: dict, *, legacy_request: bool = False) -> str | None:
    """DescribeInstances' InstanceLifecycle, which the provider's instance_lifecycle reads: "spot" for any spot
    instance, "capacity-block" for one in a Capacity Block, none on demand (EC2 API reference, Instance and
    InstanceLifecycleType: spot, scheduled, capacity-block)."""
    market = (inputs.get("instanceMarketOptions") or {}).get("marketType")
    return "spot" if legacy_request else market if market in ("spot", "capacity-block") else None


def as_launched(name: str, inputs: dict, *, legacy_request: bool = False) -> dict:
    """What EC2 makes of a launch's arguments, or its refusal: the instance's metadata options, root volume
    tags, placement group, template, subnet and groups, and its spot request's type and end.

    legacy_request: launched by RequestSpotInstances, whose launch specification has no metadata options, no
    root volume tags, and no launch template, and to which the provider passes the placement group only for
    a `terminate` request (terraform-provider-aws ec2_spot_instance_request.go; #25896, #35883)."""
    spot = _spot(inputs)
    if legacy_request:
        spot = {"spotInstanceType": inputs.get("spotType") or "persistent",
                "instanceInterruptionBehavior": inputs.get("instanceInterruptionBehavior") or "terminate",
                "validUntil": inputs.get("validUntil")}
    persistent = spot.get("spotInstanceType") == "persistent"
    stops = spot.get("instanceInterruptionBehavior") in ("stop", "hibernate")
    group = inputs.get("placementGroup")
    if legacy_request and stops:
        group = None
    elif group and spot and stops:
        # "You can't launch a Spot Instance that is configured to stop or hibernate on interruption in a
        # placement group" (EC2 User Guide, "Placement groups", rules and limitations).
        raise AwsError(f"creating EC2 Instance ({name}): InvalidParameterCombination: Spot Instances that stop or "
                       "hibernate on interruption cannot be launched in a placement group")
    if persistent and not stops:
        raise AwsError(f"creating EC2 Instance ({name}): InvalidParameterCombination: persistent Spot Instance "
                       "requests are supported only when the interruption behavior is stop or hibernate")
    if spot.get("validUntil") and not persistent:
        raise AwsError(f"creating EC2 Instance ({name}): InvalidParameterCombination: The parameter validUntil "
                       "cannot be specified when the SpotRequestType is set to 'one-time'")
    check_tags(inputs.get("tags"), "ec2", f"creating EC2 Instance ({name})")
    root = inputs.get("rootBlockDevice") or {}
    check_tags(root.get("tags"), "ec2", f"creating EC2 Instance ({name}) root volume")
    template = None if legacy_request else (inputs.get("launchTemplate") or {}).get("id")
    given = spot.get("validUntil")
    return {
        "metadataOptions": {**DEFAULT_METADATA, **({} if legacy_request else inputs.get("metadataOptions") or {})},
        "rootVolumeTags": {} if legacy_request else dict(root.get("tags") or {}),
        "placementGroup": group, "launchTemplate": template,
        # Without a template's interfaces, a launch with no subnet lands in the default VPC.
        "subnetId": inputs.get("subnetId") or ("from-template" if template else "default-vpc"),
        "securityGroupIds": list(inputs.get("vpcSecurityGroupIds") or (["from-template"] if template else [])),
        "persistent": persistent,
        "validUntil": (datetime.fromisoformat(given.replace("Z", "+00:00")) if given
                       else ACCOUNT.now + timedelta(days=DEFAULT_REQUEST_DAYS)) if persistent else None,
    }


def launch(name: str, inputs: dict, *, legacy_request: bool = False) -> tuple[str, dict]:
    """RunInstances for the resource `name` (the provider's Create of aws.ec2.Instance): its id and what the
    provider reports.

    Addresses follow the name, so two runs of the program (the plan tests) agree; a name that was replaced
    (Account.replace) gets a new id. An instance launched from a template with several network interfaces has
    several, and no automatic public address. legacy_request: see as_launched."""
    made = as_launched(name, inputs, legacy_request=legacy_request)
    generation = ACCOUNT.generations.get(name, 0)
    instance_id = f"i-{_digest(name if not generation else f'{name}#{generation}')}"
    n = int(_digest(name, 8), 16)
    state = dict(inputs)
    state["privateIp"] = f"10.42.{n // 250 % 250}.{n % 250 + 4}"
    interfaces = ACCOUNT.launch_templates.get(made["launchTemplate"], 1)
    if inputs.get("associatePublicIpAddress") and interfaces == 1:
        state["publicIp"] = f"54.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
    state["primaryNetworkInterfaceId"] = f"eni-{_digest(instance_id)}"
    known = ACCOUNT.instances.get(instance_id, {})
    # An instance that exists keeps the market it was launched on (instanceMarketOptions is kept by running
    # nodes: the engine's update never relaunches it); a new one takes its launch's.
    lifecycle = known["lifecycle"] if "lifecycle" in known else instance_lifecycle(inputs, legacy_request=legacy_request)
    if lifecycle:
        state["instanceLifecycle"] = lifecycle
    record = _record(instance_id, inputs, known.get("state", "running"))
    record.update(
        tags={} if legacy_request else dict(inputs.get("tags") or {}),
        privateIp=state["privateIp"], publicIp=state.get("publicIp"), interfaces=interfaces,
        eni=state["primaryNetworkInterfaceId"], elasticIp=known.get("elasticIp"),
        lostPublicIp=known.get("lostPublicIp", False), lifecycle=lifecycle,
        **{k: made[k] for k in ("metadataOptions", "rootVolumeTags", "placementGroup", "launchTemplate", "subnetId",
                                "securityGroupIds")})
    if record["elasticIp"]:
        record["publicIp"] = record["elasticIp"]
    elif record["lostPublicIp"]:
        record["publicIp"] = None
    ACCOUNT.instances[instance_id] = record
    if made["persistent"] and not legacy_request:  # RunInstances makes the request that keeps the instance
        request_id = known.get("spotRequest") or f"sir-{_digest(instance_id, 8)}"
        ACCOUNT.spot_requests.setdefault(request_id, {"state": "active", "type": "persistent", "instance": instance_id,
                                                      "validUntil": made["validUntil"], "status": ""})
        record["spotRequest"] = request_id
        state["spotInstanceRequestId"] = request_id
    return instance_id, state


def request_spot(name: str, inputs: dict) -> tuple[str, dict]:
    """RequestSpotInstances (aws.ec2.SpotInstanceRequest, wait_for_fulfillment): the request and its instance.

    Ids follow the name, as launch's do; a replaced request (Account.replace: the engine made a new one) has
    new ones. The request's tags stay on the request (its instance gets none)."""
    generation = ACCOUNT.generations.get(name, 0)
    request_id = f"sir-{_digest(name if not generation else f'{name}#{generation}', 8)}"
    instance_id, state = launch(f"{name}/{request_id}", inputs, legacy_request=True)
    until = as_launched(name, inputs, legacy_request=True)["validUntil"]
    ACCOUNT.spot_requests[request_id] = {"state": "active", "type": inputs.get("spotType") or "persistent",
                                         "instance": instance_id, "validUntil": until, "status": ""}
    ACCOUNT.instances[instance_id]["spotRequest"] = request_id
    return request_id, {**state, "spotInstanceId": instance_id, "spotRequestState": "active",
                        "spotBidStatus": "fulfilled"}


def terminate(instance_id: str) -> None:
    """TerminateInstances. An instance of a persistent request leaves its request `open`, and EC2 launches
    another for it (EC2 User Guide, "Terminate a Spot Instance"; terraform-provider-aws#38142)."""
    inst = ACCOUNT.instances.get(instance_id)
    if not inst:
        return
    inst["state"] = "terminated"
    request = ACCOUNT.spot_requests.get(inst.get("spotRequest") or "")
    if request and request["type"] == "persistent" and request["state"] != "cancelled":
        request["state"] = "open"


def cancel_spot_request(request_id: str) -> None:
    """CancelSpotInstanceRequests: a running instance runs on; a stopped one of a `disabled` request is
    terminated by the Spot service (EC2 User Guide, "Cancel a Spot Instance request")."""
    request = ACCOUNT.spot_requests[request_id]
    inst = ACCOUNT.instances.get(request["instance"])
    request["state"] = "cancelled"
    if inst and inst["state"] == "stopped":
        inst["state"], request["status"] = "terminated", "instance-terminated-by-service"


def provider_delete(typ: str, resource_id: str) -> None:
    """What the provider's Delete does to the account (pulumi destroy, or the old half of a replacement).

    aws.ec2.Instance: the request of a persistent spot instance is cancelled, then the instance terminated
    (components/provider_facts.py, terraform-provider-aws resourceInstanceDelete). aws.ec2.SpotInstanceRequest:
    the request is cancelled, then its instance terminated."""
    if typ == INSTANCE and resource_id in ACCOUNT.instances:
        request = ACCOUNT.instances[resource_id].get("spotRequest")
        if request in ACCOUNT.spot_requests:
            cancel_spot_request(request)
        terminate(resource_id)
    elif typ == SPOT_REQUEST and resource_id in ACCOUNT.spot_requests:
        cancel_spot_request(resource_id)
        terminate(ACCOUNT.spot_requests[resource_id]["instance"])


def provider_read(typ: str, resource_id: str, inputs: dict) -> dict | None:
    """What a refresh reads back for a resource; None when the provider's Read finds it gone (the engine then
    drops it from the state, and the next `up` creates it again).

    aws.ec2.SpotInstanceRequest: a request that is cancelled or closed is gone (findSpotInstanceRequestByID
    answers NotFound for those states), though its instance may run on. aws.ec2.Instance: a terminated
    instance is gone; its request's state is not looked at (findSpotInstanceRequest: any state). A worker that
    was stopped and started reads associatePublicIpAddress false (terraform-provider-aws#33775)."""
    if typ == SPOT_REQUEST:
        request = ACCOUNT.spot_requests.get(resource_id)
        if request is None or request["state"] in ("cancelled", "closed"):
            return None
        resource_id, typ = request["instance"], INSTANCE
    inst = ACCOUNT.instances.get(resource_id) if typ == INSTANCE else None
    if typ == INSTANCE and inst and inst["state"] == "terminated":
        return None
    if inst and inst.get("lostPublicIp") and "associatePublicIpAddress" in inputs:
        return {**inputs, "associatePublicIpAddress": False}
    return inputs


def allocate_address(name: str, inputs: dict) -> tuple[str, dict]:
    """AllocateAddress: an address that follows the name, so two runs agree."""
    check_tags(inputs.get("tags"), "ec2", f"creating EC2 EIP ({name})")
    n = int(_digest(name, 8), 16)
    allocation = f"eipalloc-{_digest(name)}"
    ACCOUNT.addresses[allocation] = f"3.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
    return allocation, {**inputs, "publicIp": ACCOUNT.addresses[allocation], "allocationId": allocation}


def launch_template(name: str, inputs: dict) -> tuple[str, dict]:
    check_tags(inputs.get("tags"), "ec2", f"creating EC2 Launch Template ({name})")
    template_id = f"lt-{_digest(name)}"
    ACCOUNT.launch_templates[template_id] = max(1, len(inputs.get("networkInterfaces") or []))
    return template_id, {**inputs, "latestVersion": 1}


def tag(inputs: dict) -> None:
    """CreateTags on an instance (aws.ec2.Tag)."""
    inst = ACCOUNT.instances.get(inputs.get("resourceId"))
    if inst is not None:
        check_tags({**inst["tags"], inputs["key"]: inputs["value"]}, "ec2", f"creating EC2 Tag ({inputs['key']})")
        inst["tags"][inputs["key"]] = inputs["value"]


def ssm_parameter(resource: str, inputs: dict) -> dict:
    """aws.ssm.Parameter as a second `up` finds it: a pool's image (insecureValue) made in an earlier run of the same
    resource keeps its value (the program's ignore_changes on value: no update, the state's outputs), a replaced
    one (Account.replace) takes the new; a SecureString (an elastic pool's join) takes each run's value. A data
    type of aws:ec2:image must name an image (SSM checks it: ParameterValidationError)."""
    check_tags(inputs.get("tags"), "ec2", f"creating SSM Parameter ({inputs.get('name')})")
    if inputs.get("dataType") == "aws:ec2:image" and not str(inputs.get("insecureValue", "")).startswith("ami-"):
        raise AwsError(f"creating SSM Parameter ({inputs.get('name')}): ParameterValidationError")
    arn = f"arn:aws:ssm:us-east-1:{ACCOUNT_ID}:parameter{inputs['name']}"
    if "insecureValue" not in inputs:
        ACCOUNT.parameters[inputs["name"]] = (inputs.get("value"), ACCOUNT.generations.get(resource, 0))
        return {**inputs, "arn": arn}
    generation = ACCOUNT.generations.get(resource, 0)
    kept = ACCOUNT.parameters.get(inputs["name"])
    if kept is None or kept[1] != generation:
        kept = ACCOUNT.parameters[inputs["name"]] = (inputs["insecureValue"], generation)
    return {**inputs, "insecureValue": kept[0], "value": kept[0], "arn": arn}


def put_object(bucket: str, key: str, tags: dict | None) -> None:
    """PutObject with its tags in x-amz-tagging (the provider sends them so): S3 takes at most 10."""
    check_tags(tags, "s3-object", f"uploading S3 Object ({bucket}/{key})")
    ACCOUNT.objects[f"{bucket}/{key}"] = {"tags": dict(tags or {})}


def associate_address(inputs: dict) -> str:
    """AssociateAddress, as EC2 answers it. By instance id only for an instance with one network interface."""
    if inputs.get("instanceId"):
        instance_id = inputs["instanceId"]
        inst = ACCOUNT.instances.get(instance_id)
        if inst and inst["interfaces"] > 1:
            raise AwsError(f"associating EC2 EIP ({inputs.get('allocationId')}): operation error EC2: "
                           f"AssociateAddress, https response error StatusCode: 400, api error InvalidInstanceID: "
                           f"There are multiple interfaces attached to instance '{instance_id}'. Please specify an "
                           "interface ID for the operation instead.")
    else:
        instance_id = next((i for i, inst in ACCOUNT.instances.items() if inst["eni"] == inputs.get("networkInterfaceId")),
                           None)
        if instance_id is None:
            raise AwsError(f"associating EC2 EIP ({inputs.get('allocationId')}): InvalidNetworkInterfaceID.NotFound: "
                           f"The networkInterface ID '{inputs.get('networkInterfaceId')}' does not exist")
    public_ip = ACCOUNT.addresses.get(inputs.get("allocationId"))
    if public_ip is None:
        raise AwsError(f"associating EC2 EIP: InvalidAllocationID.NotFound: {inputs.get('allocationId')}")
    if instance_id in ACCOUNT.instances:
        ACCOUNT.instances[instance_id].update(elasticIp=public_ip, publicIp=public_ip)
    return public_ip
