"""What the providers do when an input changes: update in place, or replace. One place, with sources.

The program's day-2 promises rest on these facts, and the plan tests (tests/test_plan.py)
use them to tell, from two runs of the program under mocks, which change would replace
which resource.
"""
from __future__ import annotations

# aws.ec2.Instance (pulumi-aws 7.x, bridged from the Terraform AWS provider's aws_instance,
# internal/service/ec2/ec2_instance.go): the arguments marked ForceNew. A change to any of
# them replaces the instance. instance_type is not among them: the provider stops the
# instance, changes the type and starts it again (a ForceNewIf replaces it only when the new
# type has another CPU architecture, which settings refuse). vpc_security_group_ids,
# metadata_options, tags and the root volume's size and type are updated in place.
INSTANCE_FORCE_NEW = frozenset({
    "ami", "associatePublicIpAddress", "availabilityZone", "cpuOptions", "ebsBlockDevices",
    "ebsOptimized", "enclaveOptions", "ephemeralBlockDevices", "hibernation", "hostId",
    "instanceMarketOptions", "ipv6Addresses", "keyName", "launchTemplate", "placementGroup",
    "placementPartitionNumber", "privateDnsNameOptions", "privateIp", "rootBlockDevice.encrypted",
    "rootBlockDevice.kmsKeyId", "securityGroups", "subnetId", "tenancy",
})
# The same schema's CustomizeDiff: user data replaces the instance only when
# user_data_replace_on_change is true; otherwise the provider stops the instance, writes
# the new user data and starts it again.
INSTANCE_USER_DATA = frozenset({"userData", "userDataBase64"})

# Inputs that only matter when an instance is created, which the node pools tell Pulumi to
# ignore on running nodes (ResourceOptions.ignore_changes): a new "latest" AMI, a rotated
# SSH key pair, a new zone list or new user data reach new and replaced nodes only, and
# never replace or reboot a running one.
INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES = ("ami", "keyName", "subnetId", "userData", "userDataBase64")

# pulumi-command 1.x (remote.Command, remote.CopyToRemote): only `triggers` replaces a
# command (pulumi-command#855). Any other change, a new connection included, is an update,
# and an update of a Command without an `update` script runs `create` again.
# CopyToRemote copies again on an update only when the asset or remote path changed
# (provider/pkg/provider/remote/copyController.go), so a node software copy carries the
# instance ID in its triggers: a replaced instance gets its copy.
COMMAND_FORCE_NEW = frozenset({"triggers"})

# aws.ec2.KeyPair (Terraform's aws_key_pair): every argument is ForceNew. A new public key
# makes a new key pair, which running nodes ignore (keyName, above).
KEY_PAIR_FORCE_NEW = frozenset({"publicKey", "keyName", "keyNamePrefix"})

KNOWN_TYPES = ("aws:ec2/instance:Instance", "aws:ec2/keyPair:KeyPair", "command:remote:Command",
               "command:remote:CopyToRemote")


def replaced_by(typ: str, old: dict, new: dict) -> set[str]:
    """The inputs whose change from `old` to `new` would replace a resource of type `typ`."""
    if typ == "aws:ec2/instance:Instance":
        forcing = set(INSTANCE_FORCE_NEW)
        if new.get("userDataReplaceOnChange"):
            forcing |= INSTANCE_USER_DATA
    elif typ == "aws:ec2/keyPair:KeyPair":
        forcing = set(KEY_PAIR_FORCE_NEW)
    elif typ.startswith("command:remote:"):
        forcing = set(COMMAND_FORCE_NEW)
    else:
        raise ValueError(f"no replacement facts recorded for {typ}")
    return {path for path in forcing if _at(old, path) != _at(new, path)}


def _at(inputs: dict, path: str):
    value = inputs
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
