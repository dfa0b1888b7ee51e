"""What the providers do when an input changes: update in place, or replace. One place, with sources.

The program's day-2 promises rest on these facts, and the plan tests (tests/test_plan.py)
use them to tell, from two runs of the program under mocks, which change would replace
which resource. tests/test_provider_facts.py keeps them honest: it reads every input of
aws.ec2.Instance from the pulumi-aws SDK that requirements.txt pins (the SDK is generated from
the provider's schema) and fails when one is not classified below, or when the installed
pulumi-aws is not the version these facts were checked against.
"""
from __future__ import annotations

import copy

# The pulumi-aws release whose aws.ec2.Instance these facts describe (requirements.txt pins it).
# It bridges a terraform-provider-aws 6.x recent enough that its SDK has cpuOptions.nestedVirtualization,
# placementGroupId and secondaryNetworkInterfaces (6.3x, early 2026): after #46568 below.
PULUMI_AWS_VERSION = "7.51.1"

# aws.ec2.Instance, bridged from the Terraform AWS provider's aws_instance
# (internal/service/ec2/ec2_instance.go): the arguments marked ForceNew. A change to any of
# them replaces the instance. Since hashicorp/terraform-provider-aws#46568 (February 2026; 6.35
# has it, see #46821), cpu_options' core_count, threads_per_core and nested_virtualization change
# in place (ModifyInstanceCpuOptions, with a stop and start); amd_sev_snp still replaces.
# instance_type is not ForceNew: the provider stops the instance, changes the type and starts it
# (a ForceNewIf replaces it only for another CPU architecture, which settings refuse).
# private_dns_name_options changes in place (ModifyPrivateDnsNameOptions). Checked against the
# schema of the last source that could be read here, plus the PRs since; placementGroupId,
# secondaryNetworkInterfaces, primaryNetworkInterface and region are new in 6.x and counted as
# replacing (they are launch-time choices), so a plan test errs towards showing a replacement,
# never towards hiding one.
INSTANCE_FORCE_NEW = frozenset({
    "ami", "associatePublicIpAddress", "availabilityZone", "cpuOptions.amdSevSnp", "ebsBlockDevices",
    "ebsOptimized", "enablePrimaryIpv6", "enclaveOptions", "ephemeralBlockDevices", "hibernation", "hostId",
    "instanceMarketOptions", "ipv6AddressCount", "ipv6Addresses", "keyName", "launchTemplate", "networkInterfaces",
    "placementGroup", "placementGroupId", "placementPartitionNumber", "primaryNetworkInterface", "privateIp",
    "region", "rootBlockDevice.encrypted", "rootBlockDevice.kmsKeyId", "secondaryNetworkInterfaces",
    "securityGroups", "subnetId", "tenancy",
})
# Every other input of aws.ec2.Instance: updated in place, some with a stop and start (the instance
# type, cpuOptions, capacityReservationSpecification, user data). tests/test_provider_facts.py
# checks that the two sets cover the SDK's inputs exactly.
INSTANCE_UPDATED_IN_PLACE = frozenset({
    "capacityReservationSpecification", "cpuOptions.coreCount", "cpuOptions.nestedVirtualization",
    "cpuOptions.threadsPerCore", "creditSpecification", "disableApiStop", "disableApiTermination", "forceDestroy",
    "getPasswordData", "hostResourceGroupArn", "iamInstanceProfile", "instanceInitiatedShutdownBehavior",
    "instanceType", "maintenanceOptions", "metadataOptions", "monitoring", "privateDnsNameOptions",
    "rootBlockDevice.deleteOnTermination", "rootBlockDevice.deviceName", "rootBlockDevice.iops",
    "rootBlockDevice.tags", "rootBlockDevice.tagsAll", "rootBlockDevice.throughput", "rootBlockDevice.volumeId",
    "rootBlockDevice.volumeSize", "rootBlockDevice.volumeType", "secondaryPrivateIps", "sourceDestCheck", "tags",
    "userData", "userDataBase64", "userDataReplaceOnChange", "volumeTags", "vpcSecurityGroupIds",
})
# The same schema's CustomizeDiff: user data replaces the instance only when
# user_data_replace_on_change is true; otherwise the provider stops the instance, writes
# the new user data and starts it again.
INSTANCE_USER_DATA = frozenset({"userData", "userDataBase64"})

# Inputs that only matter when an instance is created, which the node pools tell Pulumi to
# ignore on running nodes (ResourceOptions.ignore_changes): a new "latest" AMI, a rotated SSH
# key pair, a new zone list, new user data, another market (spot, interruption), reservation,
# placement group or EFA template version reach new and replaced nodes only, and never replace,
# stop or reboot a running one. To move a running node, replace it (pulumi up --replace).
# associatePublicIpAddress: a worker that was stopped and started has lost its automatic public
# address, and the provider's read then reports false (terraform-provider-aws#33775, open), which
# against the program's true would replace the node and its disk on the next `pulumi up`.
# launchTemplate.version, not launchTemplate: a new version of a pool's EFA template reaches new nodes
# only, but a node launched without the template (efa turned on) or with another one is replaced, as its
# EFA interfaces exist only from launch; kept whole, the roll installed EFA on nodes that have none.
INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES = (
    "ami", "keyName", "subnetId", "userData", "userDataBase64", "launchTemplate.version", "placementGroup",
    "capacityReservationSpecification", "instanceMarketOptions", "associatePublicIpAddress",
)

# aws.ec2.Instance's delete, for an instance of a persistent spot request (interruption: stop): the
# provider cancels the request, then terminates the instance (resourceInstanceDelete,
# CancelSpotInstanceRequests before terminateInstance, in terraform-provider-aws 6.45's source; before the
# fix of #38142 the check never matched and the request launched another instance). pulumi-aws 7.51.1
# bridges 6.45 or later: its SDK has the resources new in 6.45 (aws.observabilityadmin.TelemetryEvaluation,
# aws.securityhub.AggregatorV2). A failed cancel fails the delete before the terminate, so no instance is
# left without its request being ended. localswarm/fake_aws.py delete() does the same.

# pulumi-command 1.x (remote.Command, remote.CopyToRemote): only `triggers` replaces a
# command (pulumi-command#855). Any other change, a new connection included, is an update,
# and an update of a Command runs its `update` script, or `create` again when it has none.
# CopyToRemote copies again on an update only when the asset or remote path changed
# (provider/pkg/provider/remote/copyController.go), so a node software copy carries the
# instance ID in its triggers: a replaced instance gets its copy.
COMMAND_FORCE_NEW = frozenset({"triggers"})

# aws.ec2.KeyPair (Terraform's aws_key_pair): every argument is ForceNew. A new public key
# makes a new key pair, which running nodes ignore (keyName, above).
KEY_PAIR_FORCE_NEW = frozenset({"publicKey", "keyName", "keyNamePrefix"})

# aws.ec2.EipAssociation (aws_eip_association): every argument is ForceNew, so a replaced
# instance (a new primary network interface) gets a new association of the same Elastic IP
# (node_pool.py deletes the old first). Moving from instanceId to networkInterfaceId replaces
# each association once: the address goes and comes back, the same address.
EIP_ASSOCIATION_FORCE_NEW = frozenset({"allocationId", "allowReassociation", "instanceId", "networkInterfaceId",
                                       "privateIpAddress", "publicIp"})

KNOWN_TYPES = ("aws:ec2/instance:Instance", "aws:ec2/keyPair:KeyPair", "aws:ec2/eipAssociation:EipAssociation",
               "command:remote:Command", "command:remote:CopyToRemote")


def replaced_by(typ: str, old: dict, new: dict) -> set[str]:
    """The inputs whose change from `old` to `new` would replace a resource of type `typ`."""
    if typ == "aws:ec2/instance:Instance":
        forcing = set(INSTANCE_FORCE_NEW)
        if new.get("userDataReplaceOnChange"):
            forcing |= INSTANCE_USER_DATA
    elif typ == "aws:ec2/keyPair:KeyPair":
        forcing = set(KEY_PAIR_FORCE_NEW)
    elif typ == "aws:ec2/eipAssociation:EipAssociation":
        forcing = set(EIP_ASSOCIATION_FORCE_NEW)
    elif typ.startswith("command:remote:"):
        forcing = set(COMMAND_FORCE_NEW)
    else:
        raise ValueError(f"no replacement facts recorded for {typ}")
    return {path for path in forcing if _at(old, path) != _at(new, path)}


def as_diffed(old: dict, new: dict, ignored) -> dict:
    """`new` as the engine diffs it against `old` under ignore_changes: each ignored path (a top-level
    input or a dotted one such as launchTemplate.version) takes its old value, or is left out where the
    old inputs have none."""
    out = copy.deepcopy(new)
    for path in ignored:
        *parents, leaf = path.split(".")
        src, dst = old, out
        for part in parents:
            src = src.get(part) if isinstance(src, dict) else None
            dst = dst.get(part) if isinstance(dst, dict) else None
        if not isinstance(dst, dict):
            continue
        if isinstance(src, dict) and leaf in src:
            dst[leaf] = copy.deepcopy(src[leaf])
        else:
            dst.pop(leaf, None)
    return out


def _at(inputs: dict, path: str):
    value = inputs
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
