"""The fake account's EC2 Auto Scaling groups: what the group API and the group itself do, with the documents followed.

One model for the unit tests (tests/conftest.py's mocks keep the groups in fake_account.ACCOUNT) and
the rehearsal (localswarm/fake_aws_api.py serves it to the scaler, and launches and terminates the
rehearsal's machines through the callbacks converge() gets). A group is a plain dict, so the rehearsal
keeps it in a JSON file:
    {"name", "arn", "min", "max", "desired", "template": {"id", "version"}, "subnets", "protect": bool,
     "suspended": [...], "tags": {...}, "instances": {id: {"lifecycle", "protected", "zone"}}, "launched": n}
docs/reference/aws-behaviour.md lists each behaviour with the test that holds this file to it.
"""
from __future__ import annotations

import hashlib
import uuid
from typing import Callable

from localswarm.fake_account import ACCOUNT_ID, AwsError

REGION = "us-east-1"
# The tag Amazon EC2 Auto Scaling puts on every instance it launches (EC2 Auto Scaling User Guide, "Tag Auto
# Scaling groups and instances": aws:autoscaling:groupName).
GROUP_TAG = "aws:autoscaling:groupName"
LIVE = ("Pending", "InService")


def group_arn(name: str, region: str = REGION) -> str:
    """arn:aws:autoscaling:<region>:<account>:autoScalingGroup:<uuid>:autoScalingGroupName/<name> (Service
    Authorization Reference, Amazon EC2 Auto Scaling, resource type autoScalingGroup)."""
    return (f"arn:aws:autoscaling:{region}:{ACCOUNT_ID}:autoScalingGroup:{uuid.uuid5(uuid.NAMESPACE_DNS, name)}:"
            f"autoScalingGroupName/{name}")


def _validation(message: str) -> AwsError:
    return AwsError(f"ValidationError: {message}")


def create_group(groups: dict, name: str, inputs: dict) -> dict:
    """CreateAutoScalingGroup (the provider's Create of aws.autoscaling.Group): desired capacity defaults to the
    minimum (EC2 Auto Scaling API reference, CreateAutoScalingGroup, DesiredCapacity: "the default is the minimum
    size of the group"); it must lie between min and max."""
    low, high = int(inputs.get("minSize", 0)), int(inputs.get("maxSize", 0))
    desired = inputs.get("desiredCapacity")
    desired = low if desired in (None, "") else int(desired)
    if not low <= desired <= high:
        raise _validation(f"Desired capacity:{desired} must be between the specified min size:{low} and max size:{high}")
    if name in groups:
        raise AwsError(f"AlreadyExists: AutoScalingGroup by this name already exists - A group with the name {name} "
                       "already exists")
    template = inputs.get("launchTemplate") or {}
    groups[name] = {"name": name, "arn": group_arn(name), "min": low, "max": high, "desired": desired,
                    "template": {"id": template.get("id"), "version": template.get("version")},
                    "subnets": list(inputs.get("vpcZoneIdentifiers") or []),
                    "protect": bool(inputs.get("protectFromScaleIn")),
                    "suspended": list(inputs.get("suspendedProcesses") or []),
                    "tags": {t["key"]: t["value"] for t in inputs.get("tags") or [] if t.get("propagateAtLaunch")},
                    "instances": {}, "launched": 0}
    return groups[name]


def update_group(groups: dict, name: str, inputs: dict) -> dict:
    """UpdateAutoScalingGroup with min and max but no desired capacity (the program ignores it): a new min above
    the group's size raises the desired capacity to it, a new max below lowers it (API reference,
    UpdateAutoScalingGroup)."""
    group = groups[name]
    group["min"], group["max"] = int(inputs.get("minSize", group["min"])), int(inputs.get("maxSize", group["max"]))
    if group["min"] > group["max"]:
        raise _validation(f"Max bound, {group['max']}, must be greater than or equal to min bound, {group['min']}")
    group["desired"] = min(max(group["desired"], group["min"]), group["max"])
    template = inputs.get("launchTemplate") or {}
    group["template"] = {"id": template.get("id"), "version": template.get("version")}
    group["suspended"] = list(inputs.get("suspendedProcesses") or [])
    group["protect"] = bool(inputs.get("protectFromScaleIn"))
    return group


def set_desired_capacity(groups: dict, name: str, desired: int) -> None:
    """SetDesiredCapacity: refused outside [min, max], in the words of its ValidationError (as
    kubernetes/autoscaler#943 quotes it)."""
    group = _group(groups, name)
    if desired > group["max"]:
        raise _validation(f"New SetDesiredCapacity value {desired} is above max value {group['max']} for the "
                          "AutoScalingGroup.")
    if desired < group["min"]:
        raise _validation(f"New SetDesiredCapacity value {desired} is below min value {group['min']} for the "
                          "AutoScalingGroup.")
    group["desired"] = desired


def terminate_instance(groups: dict, instance_id: str, decrement: bool) -> dict:
    """TerminateInstanceInAutoScalingGroup: the instance goes (scale-in protection does not stop it: EC2 Auto
    Scaling User Guide, "Use instance scale-in protection"); with the decrement, the desired capacity goes
    down by one, refused when it already equals the minimum (the ValidationError buildkite/elastic-ci-stack-for-aws
    #1261 quotes); without it, the group launches a replacement."""
    group = next((g for g in groups.values() if instance_id in g["instances"]), None)
    if group is None:
        raise _validation(f"Instance Id not found - No managed instance found for instance ID: {instance_id}")
    if decrement and group["desired"] <= group["min"]:
        raise _validation(f"Currently, desiredSize equals minSize ({group['min']}). Terminating instance without "
                          "replacement will violate group's min size constraint. Either set "
                          "shouldDecrementDesiredCapacity flag to false or lower group's min size.")
    group["instances"][instance_id]["lifecycle"] = "Terminating"
    if decrement:
        group["desired"] -= 1
    return {"ActivityId": str(uuid.uuid4()), "AutoScalingGroupName": group["name"],
            "Description": f"Terminating EC2 instance: {instance_id}", "StatusCode": "InProgress"}


def reclaim(groups: dict, instance_id: str) -> None:
    """EC2 takes a spot instance back: it is gone, and the group, whose desired capacity is unchanged, launches
    another at its next converge (EC2 Auto Scaling User Guide, "Auto Scaling groups": a group "maintains this
    number of instances", and one that is unhealthy, as a terminated one is, is replaced)."""
    for group in groups.values():
        if instance_id in group["instances"]:
            group["instances"][instance_id]["lifecycle"] = "Terminating"


def describe(groups: dict, names: list[str]) -> list[dict]:
    """DescribeAutoScalingGroups' members, in the API's shape; names it does not know are left out (AWS answers
    an empty list for them, not an error)."""
    out = []
    for name in names or sorted(groups):
        g = groups.get(name)
        if g is None:
            continue
        out.append({"AutoScalingGroupName": name, "AutoScalingGroupARN": g["arn"], "MinSize": g["min"],
                    "MaxSize": g["max"], "DesiredCapacity": g["desired"],
                    "Instances": [{"InstanceId": i, "LifecycleState": rec["lifecycle"], "HealthStatus": "Healthy",
                                   "AvailabilityZone": rec.get("zone", ""), "ProtectedFromScaleIn": rec["protected"]}
                                  for i, rec in sorted(g["instances"].items())]})
    return out


def converge(groups: dict, name: str, launch: Callable[[dict, str], None], terminate: Callable[[str], None]) -> list:
    """What the group does by itself until it holds its desired capacity: instances marked Terminating are
    terminated and leave it; while it has fewer live instances than desired it launches more (Pending, then
    InService once `launch` returned); while it has more, it terminates unprotected ones, newest first, and
    none that is protected from scale-in ("Could not scale to desired capacity because all remaining instances
    are protected from scale-in", the User Guide's words). Returns what it did, as (action, instance id)."""
    group, done = groups[name], []
    for instance_id, rec in list(group["instances"].items()):
        if rec["lifecycle"] == "Terminating":
            terminate(instance_id)
            del group["instances"][instance_id]
            done.append(("terminated", instance_id))
    live = [i for i, rec in group["instances"].items() if rec["lifecycle"] in LIVE]
    while len(live) < group["desired"]:
        group["launched"] += 1
        seed = f"{name}/{group['launched']}"
        instance_id = f"i-{hashlib.sha1(seed.encode()).hexdigest()[:17]}"
        group["instances"][instance_id] = {"lifecycle": "Pending", "protected": group["protect"],
                                           "zone": ""}
        launch(group, instance_id)
        group["instances"][instance_id]["lifecycle"] = "InService"
        live.append(instance_id)
        done.append(("launched", instance_id))
    for instance_id in sorted(live, reverse=True)[:max(0, len(live) - group["desired"])]:
        if group["instances"][instance_id]["protected"]:
            continue
        terminate(instance_id)
        del group["instances"][instance_id]
        done.append(("terminated", instance_id))
    return done


def delete_group(groups: dict, name: str, terminate: Callable[[str], None]) -> None:
    """DeleteAutoScalingGroup with ForceDelete (the provider's force_delete): its instances are terminated with it."""
    for instance_id in list((groups.get(name) or {}).get("instances", {})):
        terminate(instance_id)
    groups.pop(name, None)


def _group(groups: dict, name: str) -> dict:
    if name not in groups:
        raise _validation(f"AutoScalingGroup name not found - AutoScalingGroup '{name}' not found")
    return groups[name]
