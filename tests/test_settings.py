"""Every bad stack setting fails before anything is created, with a message naming the key and the fix."""
import json
import runpy

import pulumi
import pytest
import yaml

import settings
from pulumi.runtime.sync_await import _sync_await
from settings import DEFAULTS, SettingsError, load_settings
from tests.conftest import (
    ARM_AMI, CUSTOM_AMI, DEEP_LEARNING_AMI, REPO, UBUNTU_AMI, VPC, stack_config, use_mocks,
)

T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}
P5 = {"name": "training", "instanceType": "p5.48xlarge", "count": 1}


def pools(*entries):
    return list(entries)


BAD = [
    # (id, overrides on the dev stack (None removes a key), secret keys, fragments of the message)
    ("ssh-cidrs-missing", {"allowedSshCidrs": None}, (),
     ["gpu-swarm:allowedSshCidrs: required", "pulumi config set --path 'allowedSshCidrs[0]'"]),
    ("ssh-from-anywhere", {"allowedSshCidrs": ["0.0.0.0/0"]}, (),
     ["gpu-swarm:allowedSshCidrs: 0.0.0.0/0 opens SSH to the internet; "
      "set gpu-swarm:allowSshFromAnywhere true to accept that"]),
    ("ssh-from-anywhere-ipv6", {"allowedSshCidrs": ["::/0"]}, (),
     ["gpu-swarm:allowedSshCidrs: ::/0 opens SSH to the internet", "allowSshFromAnywhere true"]),
    ("ssh-huge-range", {"allowedSshCidrs": ["0.0.0.0/4"]}, (),
     ["gpu-swarm:allowedSshCidrs: 0.0.0.0/4 opens SSH to a large part of the internet", "narrow it"]),
    ("ssh-not-a-cidr", {"allowedSshCidrs": ["my-laptop"]}, (),
     ["gpu-swarm:allowedSshCidrs: 'my-laptop' is not a CIDR", "203.0.113.7/32"]),
    ("ssh-host-bits", {"allowedSshCidrs": ["203.0.113.7/24"]}, (),
     ["gpu-swarm:allowedSshCidrs: 203.0.113.7/24 has host bits set; write 203.0.113.0/24"]),
    ("ssh-cidrs-not-a-list", {"allowedSshCidrs": "203.0.113.7/32"}, (),
     ["gpu-swarm:allowedSshCidrs: expected a list", "--path 'allowedSshCidrs[0]'"]),
    ("anywhere-not-bool", {"allowSshFromAnywhere": "yes"}, (),
     ["gpu-swarm:allowSshFromAnywhere: expected true or false, found 'yes'"]),
    ("managers-even", {"managerCount": "2"}, (),
     ["gpu-swarm:managerCount: 2 managers survive no more manager failures than 1", "use 1, 3, 5 or 7"]),
    ("managers-too-many", {"managerCount": "9"}, (), ["gpu-swarm:managerCount: 9 is not a supported", "use 1, 3, 5 or 7"]),
    ("managers-not-a-number", {"managerCount": "three"}, (), ["gpu-swarm:managerCount: expected a whole number, found 'three'"]),
    ("manager-type-malformed", {"managerInstanceType": "m7i-large"}, (),
     ["gpu-swarm:managerInstanceType: 'm7i-large' is not an EC2 instance type; write it like g6e.12xlarge"]),
    ("manager-type-unknown", {"managerInstanceType": "m9z.large"}, (),
     ["gpu-swarm:managerInstanceType: AWS does not describe 'm9z.large'", "check the name and the region"]),
    ("manager-type-arm", {"managerInstanceType": "m7g.large"}, (),
     ["gpu-swarm:managerInstanceType: m7g.large is arm64", "choose an x86_64 type"]),
    ("manager-volume-small", {"managerRootVolumeGiB": "10"}, (),
     ["gpu-swarm:managerRootVolumeGiB: 10 is out of range; use a number from 20"]),
    ("pools-missing", {"gpuPools": None}, (), ["gpu-swarm:gpuPools: required: add at least one GPU pool", "--path 'gpuPools[0].name'"]),
    ("pools-empty", {"gpuPools": []}, (), ["gpu-swarm:gpuPools: required"]),
    ("pool-not-an-object", {"gpuPools": ["g4dn.xlarge"]}, (),
     ["gpu-swarm:gpuPools[0]: expected an object with name, instanceType and count"]),
    ("pool-name-invalid", {"gpuPools": pools({**T4, "name": "GPU_1"})}, (),
     ["gpu-swarm:gpuPools[0].name: 'GPU_1' is not a valid pool name", "lowercase letters"]),
    ("pool-name-duplicate", {"gpuPools": pools(T4, {**T4})}, (),
     ["gpu-swarm:gpuPools[1].name: 't4' is used by two pools; pool names must be unique"]),
    ("pool-name-reserved", {"gpuPools": pools({**T4, "name": "managers"})}, (),
     ["gpu-swarm:gpuPools[0].name: 'managers' is the managers' own pool label; choose another name"]),
    ("pool-unknown-field", {"gpuPools": pools({**T4, "instancetype": "g5.xlarge"})}, (),
     ["gpu-swarm:gpuPools[0].instancetype: is not a pool setting; did you mean instanceType?"]),
    ("pool-type-missing", {"gpuPools": pools({"name": "t4", "count": 1})}, (),
     ["gpu-swarm:gpuPools[0].instanceType: required", "e.g. g6.xlarge"]),
    ("pool-type-cpu", {"gpuPools": pools({**T4, "instanceType": "m7i.xlarge"})}, (),
     ["gpu-swarm:gpuPools[0].instanceType: m7i.xlarge has no NVIDIA GPU; choose an NVIDIA GPU type"]),
    ("pool-type-amd", {"gpuPools": pools({**T4, "instanceType": "g4ad.xlarge"})}, (),
     ["gpu-swarm:gpuPools[0].instanceType: g4ad.xlarge has AMD Radeon Pro V520, not an NVIDIA GPU"]),
    ("pool-type-arm", {"gpuPools": pools({**T4, "instanceType": "g5g.xlarge"})}, (),
     ["gpu-swarm:gpuPools[0].instanceType: g5g.xlarge is arm64", "choose an x86_64 type"]),
    ("pool-count-negative", {"gpuPools": pools({**T4, "count": -1})}, (),
     ["gpu-swarm:gpuPools[0].count: -1 is out of range; use a number from 0 to 1000"]),
    ("pool-count-missing", {"gpuPools": pools({"name": "t4", "instanceType": "g4dn.xlarge"})}, (),
     ["gpu-swarm:gpuPools[0].count: required: how many nodes the pool has"]),
    ("spot-price-without-spot", {"gpuPools": pools({**T4, "spotMaxPrice": "0.30"})}, (),
     ["gpu-swarm:gpuPools[0].spotMaxPrice: applies to spot nodes only; set gpuPools[0].spot true or remove it"]),
    ("spot-price-not-a-price", {"gpuPools": pools({**T4, "spot": True, "spotMaxPrice": "cheap"})}, (),
     ["gpu-swarm:gpuPools[0].spotMaxPrice: 'cheap' is not a price", "US dollars per hour"]),
    ("spot-not-bool", {"gpuPools": pools({**T4, "spot": "sometimes"})}, (),
     ["gpu-swarm:gpuPools[0].spot: expected true or false"]),
    ("root-volume-small", {"gpuPools": pools({**T4, "rootVolumeGiB": 20})}, (),
     ["gpu-swarm:gpuPools[0].rootVolumeGiB: 20 is out of range; use a number from 50", "200 is the default"]),
    ("root-volume-below-dlami", {"image": "deep-learning", "gpuPools": pools({**T4, "rootVolumeGiB": 60})}, (),
     ["gpu-swarm:gpuPools[0].rootVolumeGiB: 60 GiB is smaller than the deep-learning image's 75 GiB snapshot",
      "use at least 75"]),
    ("volta-on-the-deep-learning-ami", {"image": "deep-learning", "gpuPools": pools(
        {"name": "v100", "instanceType": "p3.2xlarge", "count": 1, "rootVolumeGiB": 100})}, (),
     ["gpu-swarm:gpuPools[0].instanceType: p3.2xlarge's GPUs need NVIDIA's proprietary kernel module",
      "set image ubuntu"]),
    ("image-unknown", {"image": "debian"}, (),
     ["gpu-swarm:image: 'debian' is not an image choice; use ubuntu", "deep-learning", "custom (with amiId)"]),
    ("custom-without-ami", {"image": "custom"}, (), ["gpu-swarm:amiId: required when gpu-swarm:image is custom"]),
    ("ami-malformed", {"image": "custom", "amiId": "ami-123"}, (),
     ["gpu-swarm:amiId: 'ami-123' is not an AMI id; expected ami- and 8 or 17 hex digits"]),
    ("ami-without-custom", {"amiId": CUSTOM_AMI}, (),
     ["gpu-swarm:amiId: is only used when gpu-swarm:image is custom", "remove amiId or set image custom"]),
    ("ami-unknown", {"image": "custom", "amiId": "ami-00000000000000000"}, (),
     ["gpu-swarm:amiId: AWS does not describe ami-00000000000000000", "check the id and the region"]),
    ("ami-arm", {"image": "custom", "amiId": ARM_AMI}, (), [f"gpu-swarm:amiId: {ARM_AMI} is arm64", "x86_64 image"]),
    ("kind-invalid", {"gpuKind": "NVIDIA GPU"}, (), ["gpu-swarm:gpuKind: invalid GPU resource kind 'NVIDIA GPU'", "NVIDIA-GPU"]),
    ("vpc-cidr-public", {"vpcCidr": "8.8.0.0/16"}, (), ["gpu-swarm:vpcCidr: 8.8.0.0/16 does not fit", "private IPv4 range"]),
    ("vpc-cidr-too-small", {"vpcCidr": "10.42.0.0/24"}, (), ["gpu-swarm:vpcCidr: 10.42.0.0/24 does not fit", "/16 to /22"]),
    ("vpc-cidr-host-bits", {"vpcCidr": "10.42.0.1/16"}, (), ["gpu-swarm:vpcCidr: '10.42.0.1/16' is not a network"]),
    ("subnets-without-vpc", {"subnetIds": ["subnet-0aaaaaaaaaaaaaaaa"]}, (),
     ["gpu-swarm:subnetIds: needs gpu-swarm:vpcId", "remove subnetIds to create a VPC"]),
    ("vpc-without-subnets", {"vpcId": VPC}, (), ["gpu-swarm:subnetIds: required with gpu-swarm:vpcId", "public subnets"]),
    ("vpc-id-malformed", {"vpcId": "my-vpc", "subnetIds": ["subnet-0aaaaaaaaaaaaaaaa"]}, (),
     ["gpu-swarm:vpcId: 'my-vpc' is not a VPC id"]),
    ("vpc-with-cidr", {"vpcId": VPC, "subnetIds": ["subnet-0aaaaaaaaaaaaaaaa"], "vpcCidr": "10.1.0.0/16"}, (),
     ["gpu-swarm:vpcCidr: applies only to a VPC this program creates"]),
    ("subnet-other-vpc", {"vpcId": VPC, "subnetIds": ["subnet-0eeeeeeeeeeeeeeee"]}, (),
     [f"gpu-swarm:subnetIds: subnet-0eeeeeeeeeeeeeeee is in vpc-0fff0000fff000011, not in gpu-swarm:vpcId {VPC}"]),
    ("subnet-unknown", {"vpcId": VPC, "subnetIds": ["subnet-0123456789abcdef0"]}, (),
     ["gpu-swarm:subnetIds: subnet-0123456789abcdef0: AWS does not describe it"]),
    ("subnet-zone-lacks-type", {"vpcId": VPC, "subnetIds": ["subnet-0bbbbbbbbbbbbbbbb"], "gpuPools": pools(P5)}, (),
     ["gpu-swarm:subnetIds: subnet-0bbbbbbbbbbbbbbbb is in us-east-1b, which does not offer p5.48xlarge; "
      "use subnets in us-east-1a, us-east-1c"]),
    ("no-common-zone", {"gpuPools": pools(P5, {"name": "a100", "instanceType": "p4d.24xlarge", "count": 1})}, (),
     ["gpu-swarm:gpuPools: no availability zone of this region offers all of t3.medium, p5.48xlarge, p4d.24xlarge",
      "p4d.24xlarge: us-east-1b", "or name zones in gpu-swarm:availabilityZones: each pool then uses those"]),
    ("zone-lacks-type", {"availabilityZones": ["us-east-1b"], "gpuPools": pools(P5)}, (),
     ["gpu-swarm:availabilityZones: us-east-1b does not offer p5.48xlarge"]),
    ("zone-unknown", {"availabilityZones": ["us-east-1e"]}, (),
     ["gpu-swarm:availabilityZones: us-east-1e is not an available zone of this region"]),
    ("stack-file-missing", {"stacks": [{"name": "train", "file": "stacks/train.yml"}]}, (),
     ["gpu-swarm:stacks[0].file: stacks/train.yml does not exist"]),
    ("stack-file-outside", {"stacks": [{"name": "train", "file": "/etc/passwd"}]}, (),
     ["gpu-swarm:stacks[0].file: '/etc/passwd': give a path inside the project directory"]),
    ("stack-name-invalid", {"stacks": [{"name": "Smoke Test", "file": "stacks/gpu-smoke.yml"}]}, (),
     ["gpu-swarm:stacks[0].name: 'Smoke Test' is not a stack name"]),
    ("stack-name-duplicate", {"stacks": [{"name": "s", "file": "stacks/gpu-smoke.yml"}] * 2}, (),
     ["gpu-swarm:stacks[1].name: 's' is deployed twice"]),
    ("stack-unknown-field", {"stacks": [{"name": "s", "path": "stacks/gpu-smoke.yml"}]}, (),
     ["gpu-swarm:stacks[0].path: is not a stack setting; known keys: file, name",
      "gpu-swarm:stacks[0].file: required: the compose file"]),
    ("stack-wait-zero", {"stacks": [{"name": "s", "file": "stacks/gpu-smoke.yml", "waitSeconds": 0}]}, (),
     ["gpu-swarm:stacks[0].waitSeconds: 0 is out of range; use a number from 1 to 86400"]),
    ("stack-wait-text", {"stacks": [{"name": "s", "file": "stacks/gpu-smoke.yml", "waitSeconds": "ten"}]}, (),
     ["gpu-swarm:stacks[0].waitSeconds: expected a whole number, found 'ten'"]),
    ("tag-reserved-prefix", {"tags": {"aws:owner": "me"}}, (), ["gpu-swarm:tags: 'aws:owner': the aws: prefix is reserved"]),
    ("tag-name", {"tags": {"Name": "x"}}, (), ["gpu-swarm:tags: 'Name' is set by gpu-swarm on every resource"]),
    ("tag-not-text", {"tags": {"team": {"a": 1}}}, (), ["gpu-swarm:tags: 'team': tag values must be text"]),
    ("tags-not-an-object", {"tags": '["a"]'}, (), ["gpu-swarm:tags: expected an object", "--path 'tags.team'"]),
    ("tags-over-what-a-node-takes", {"tags": {f"k{i:02d}": "v" for i in range(47)}}, (),
     ["gpu-swarm:tags: 47 tags (47 here, 0 from aws:defaultTags)", "aws.ec2.Instance would refuse them",
      "keep at most 46 in all"]),
    ("tag-character-s3-refuses", {"tags": {"cost,center": "42"}}, (),
     ["gpu-swarm:tags: 'cost,center': the node software's S3 bucket takes only letters"]),
    ("stop-spot-in-a-placement-group", {"gpuPools": pools({"name": "p", "instanceType": "p4d.24xlarge", "count": 1,
                                                          "marketType": "spot", "interruption": "stop",
                                                          "placement": "cluster"})}, (),
     ["gpu-swarm:gpuPools[0].placement: EC2 launches no spot instance that stops on interruption in a placement "
      "group; remove placement, or set interruption terminate"]),
    ("ssh-user-invalid", {"sshUser": "Ubuntu!"}, (), ["gpu-swarm:sshUser: 'Ubuntu!' is not a Linux user name"]),
    ("public-key-alone", {"sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB me@host"}, (),
     ["gpu-swarm:sshPrivateKey: sshPublicKey and sshPrivateKey come as a pair", "generate a key"]),
    ("public-key-malformed", {"sshPublicKey": "not a key", "sshPrivateKey": "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----"},
     ("gpu-swarm:sshPrivateKey",), ["gpu-swarm:sshPublicKey: expected one OpenSSH public key line"]),
    ("private-key-plain-text", {"sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB me@host",
                                "sshPrivateKey": "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----"}, (),
     ["gpu-swarm:sshPrivateKey: is stored in plain text; set it as a secret: pulumi config set --secret sshPrivateKey"]),
    ("imds-hop-limit", {"imdsHopLimit": "0"}, (), ["gpu-swarm:imdsHopLimit: 0 is out of range; use a number from 1 to 64"]),
    ("overlay-pool-malformed", {"overlayAddressPool": "10.200.0.1/16"}, (),
     ["gpu-swarm:overlayAddressPool: '10.200.0.1/16' is not a network such as 10.200.0.0/16"]),
    ("overlay-pool-public", {"overlayAddressPool": "8.8.0.0/16"}, (),
     ["gpu-swarm:overlayAddressPool: 8.8.0.0/16 does not fit: use a private IPv4 range from /8 to /20"]),
    ("overlay-pool-too-small", {"overlayAddressPool": "10.200.0.0/24"}, (),
     ["gpu-swarm:overlayAddressPool: 10.200.0.0/24 does not fit", "each overlay network takes a /24"]),
    ("overlay-pool-docker-bridges", {"overlayAddressPool": "172.16.0.0/16"}, (),
     ["gpu-swarm:overlayAddressPool: 172.16.0.0/16 overlaps 172.16.0.0/12, where Docker puts its own bridge"]),
    ("overlay-pool-in-created-vpc", {"vpcCidr": "10.200.0.0/16"}, (),
     ["gpu-swarm:overlayAddressPool: 10.200.0.0/16 overlaps 10.200.0.0/16 of gpu-swarm:vpcCidr",
      "Choose a range outside the VPC, e.g. 10.199.0.0/16"]),
    ("overlay-pool-in-existing-vpc", {"vpcId": VPC, "subnetIds": ["subnet-0aaaaaaaaaaaaaaaa"],
                                      "overlayAddressPool": "10.1.0.0/16"}, (),
     [f"gpu-swarm:overlayAddressPool: 10.1.0.0/16 overlaps 10.1.0.0/16 of the VPC {VPC}"]),
    ("authorized-key-malformed", {"sshAuthorizedKeys": ["ssh-ed25519 AAAA ok@x", "my key"]}, (),
     ["gpu-swarm:sshAuthorizedKeys[1]: expected one OpenSSH public key line"]),
    ("authorized-keys-not-a-list", {"sshAuthorizedKeys": "ssh-ed25519 AAAA ok@x"}, (),
     ["gpu-swarm:sshAuthorizedKeys: expected a list"]),
    ("sharing-too-few", {"gpuPools": pools({**T4, "sharing": {"slotsPerGpu": 1}})}, (),
     ["gpu-swarm:gpuPools[0].sharing.slotsPerGpu: 1 is out of range; use a number from 2 to 48"]),
    ("sharing-too-many", {"gpuPools": pools({**T4, "sharing": {"slotsPerGpu": 64}})}, (),
     ["gpu-swarm:gpuPools[0].sharing.slotsPerGpu: 64 is out of range"]),
    ("sharing-not-an-object", {"gpuPools": pools({**T4, "sharing": 4})}, (),
     ["gpu-swarm:gpuPools[0].sharing: expected an object such as {slotsPerGpu: 4}"]),
    ("sharing-unknown-key", {"gpuPools": pools({**T4, "sharing": {"slotsPerGPU": 4}})}, (),
     ["gpu-swarm:gpuPools[0].sharing.slotsPerGPU: is not a sharing setting; did you mean slotsPerGpu?"]),
    ("rollout-zero", {"gpuPools": pools({**T4, "rollout": {"maxUnavailable": 0}})}, (),
     ["gpu-swarm:gpuPools[0].rollout.maxUnavailable: 0: use a whole number of nodes from 1 to 1000 (e.g. 2), "
      'or a share of the pool from "1%" to "100%"']),
    ("rollout-share-over-100", {"gpuPools": pools({**T4, "rollout": {"maxUnavailable": "150%"}})}, (),
     ["gpu-swarm:gpuPools[0].rollout.maxUnavailable: '150%' is not a share of the pool; use a whole number"]),
    ("rollout-share-not-a-number", {"gpuPools": pools({**T4, "rollout": {"maxUnavailable": "half%"}})}, (),
     ["gpu-swarm:gpuPools[0].rollout.maxUnavailable: 'half%' is not a share of the pool"]),
    ("rollout-fraction", {"gpuPools": pools({**T4, "rollout": {"maxUnavailable": 1.5}})}, (),
     ["gpu-swarm:gpuPools[0].rollout.maxUnavailable: 1.5: use a whole number of nodes"]),
    ("rollout-not-an-object", {"gpuPools": pools({**T4, "rollout": 2})}, (),
     ["gpu-swarm:gpuPools[0].rollout: expected an object such as {maxUnavailable: 2}"]),
    ("rollout-unknown-key", {"gpuPools": pools({**T4, "rollout": {"maxSurge": 1}})}, (),
     ["gpu-swarm:gpuPools[0].rollout.maxSurge: is not a rollout setting; known keys: maxUnavailable"]),
    ("shared-kind-same-as-kind", {"sharedGpuKind": "NVIDIA-GPU"}, (),
     ["gpu-swarm:sharedGpuKind: 'NVIDIA-GPU' is also gpu-swarm:gpuKind", "NVIDIA-GPU-SHARED"]),
    ("shared-kind-invalid", {"sharedGpuKind": "GPU SLOT"}, (),
     ["gpu-swarm:sharedGpuKind: invalid GPU resource kind 'GPU SLOT'"]),
    ("health-not-an-object", {"health": [79]}, (),
     ["gpu-swarm:health: expected an object", "--path 'health.ignoreXids[0]'"]),
    ("health-unknown-key", {"health": {"ignoredXids": [94]}}, (),
     ["gpu-swarm:health.ignoredXids: is not a health setting; did you mean ignoreXids?"]),
    ("health-xid-not-a-number", {"health": {"ignoreXids": ["79a"]}}, (),
     ["gpu-swarm:health.ignoreXids[0]: expected a whole number, found '79a' (an XID)"]),
    ("health-xids-not-a-list", {"health": {"criticalXids": 79}}, (),
     ["gpu-swarm:health.criticalXids: expected a list of XIDs such as [94, 95], found 79"]),
    ("health-xid-in-both", {"health": {"ignoreXids": [94, 95], "criticalXids": [95]}}, (),
     ["gpu-swarm:health: XID 95 is in both ignoreXids and criticalXids"]),
    ("health-interval-zero", {"health": {"checkIntervalSeconds": 0}}, (),
     ["gpu-swarm:health.checkIntervalSeconds: 0 is out of range; use a number from 1 to 3600"]),
    ("health-percent-too-big", {"health": {"maxDrainedPercent": 150}}, (),
     ["gpu-swarm:health.maxDrainedPercent: 150 is out of range; use a number from 1 to 100"]),
    ("health-inventory-not-bool", {"health": {"inventoryEachUp": "sometimes"}}, (),
     ["gpu-swarm:health.inventoryEachUp: expected true or false, found 'sometimes'"]),
    ("unknown-key", {"allowedSshCidr": '["203.0.113.7/32"]'}, (),
     ["gpu-swarm:allowedSshCidr: is not a setting of this program; did you mean allowedSshCidrs?"]),
]


@pytest.mark.parametrize("overrides,secret_keys,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_settings_name_the_key_and_the_fix(overrides, secret_keys, fragments):
    use_mocks(stack_config("dev", **overrides), secret_keys)
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value)
    assert message.startswith("the gpu-swarm stack configuration has ")
    assert "nothing was created" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_the_providers_default_tags_count_and_the_bundle_takes_none_of_the_stacks():
    """aws:defaultTags reach every resource (tags_all), S3 objects too: ten of them and the program's own are 11."""
    config = stack_config("dev", tags={"team": "ml"})
    use_mocks({**config, "aws:defaultTags": json.dumps({"tags": {f"d{i}": "v" for i in range(10)}})})
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert "aws:defaultTags has 10 tags" in str(err.value) and "aws.s3.BucketObjectv2" in str(err.value)
    use_mocks({**config, "aws:defaultTags": json.dumps({"tags": {f"d{i}": "v" for i in range(9)}})})
    assert load_settings().tag_map == {"team": "ml"}


def test_volta_runs_on_plain_ubuntu_with_the_proprietary_module():
    """The advice for a V100 pool on the Deep Learning AMI, followed: image ubuntu, whose 580 drives it."""
    use_mocks(stack_config("dev", image="ubuntu", gpuPools=[
        {"name": "v100", "instanceType": "p3.2xlarge", "count": 1, "rootVolumeGiB": 100}]))
    assert load_settings().gpu_pools[0].gpu_model == "V100"


def test_bad_ids_are_distinct():
    assert len({b[0] for b in BAD}) == len(BAD) >= 20


def test_missing_region_is_reported(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    config = stack_config("dev")
    del config["aws:region"]
    use_mocks(config)
    with pytest.raises(SettingsError, match="aws:region: not set; run pulumi config set aws:region"):
        load_settings()


def test_bad_stack_file_content_is_reported_with_its_problems(tmp_path, monkeypatch):
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "train.yml").write_text(
        "services:\n  train:\n    image: trainer:1\n    deploy:\n      resources:\n        reservations:\n"
        "          generic_resources:\n            - discrete_resource_spec:\n              kind: NVIDIA-GPU\n"
        "              value: 1\n"
    )
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    use_mocks(stack_config("dev", stacks=[{"name": "train", "file": "stacks/train.yml"}]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert "gpu-swarm:stacks[0].file: stacks/train.yml: services.train" in str(err.value)
    assert "sit beside `discrete_resource_spec`" in str(err.value)


def test_stack_asking_more_gpus_than_any_node_has_is_refused(tmp_path, monkeypatch):
    (tmp_path / "big.yml").write_text(
        "services:\n  big:\n    image: trainer:1\n    deploy:\n      resources:\n        reservations:\n"
        "          generic_resources:\n            - discrete_resource_spec:\n                kind: NVIDIA-GPU\n"
        "                value: 2\n"
    )
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    use_mocks(stack_config("dev", stacks=[{"name": "big", "file": "big.yml"}]))
    with pytest.raises(SettingsError, match="2 GPUs per replica, but the largest node pool has 1 per node"):
        load_settings()


def test_every_problem_is_reported_at_once():
    use_mocks(stack_config(
        "dev", allowedSshCidrs=["0.0.0.0/0"], managerCount="4", imdsHopLimit="99",
        gpuPools=pools({**T4, "instanceType": "m7i.xlarge"}, {**T4, "name": "t4b", "rootVolumeGiB": 10}),
    ))
    with pytest.raises(SettingsError) as err:
        load_settings()
    keys = {p.split(": ", 1)[0] for p in err.value.problems}
    assert keys == {
        "gpu-swarm:allowedSshCidrs", "gpu-swarm:managerCount", "gpu-swarm:imdsHopLimit",
        "gpu-swarm:gpuPools[0].instanceType", "gpu-swarm:gpuPools[1].rootVolumeGiB",
    }


def test_a_bad_setting_stops_the_program_before_any_resource():
    monitor = use_mocks(stack_config("dev", managerCount="2"))

    @pulumi.runtime.test
    def program():
        runpy.run_path(str(REPO / "__main__.py"), run_name="__main__")

    with pytest.raises(SettingsError):
        program()
    assert [r.type for r in monitor.requests.values() if r.type != "pulumi:pulumi:Stack"] == []


# ---------------------------------------------------------------- good inputs


def test_dev_stack_file_parses():
    use_mocks(stack_config("dev"), stack="dev")
    s = load_settings()
    assert s.cluster_name == "gpu-swarm-dev"
    assert s.allowed_ssh_cidrs == ("203.0.113.7/32",)
    assert (s.managers.count, s.managers.instance_type) == (1, "t3.medium")
    (pool,) = s.gpu_pools
    assert (pool.name, pool.instance_type, pool.count, pool.gpus_per_node, pool.gpu_model) == ("t4", "g4dn.xlarge", 1, 1, "T4")
    assert pool.root_volume_gib == 200 and not pool.spot
    assert s.image == "ubuntu" and s.manager_ami_id == s.gpu_ami_id == UBUNTU_AMI and s.ami_from_ssm
    assert s.gpu_kind == "NVIDIA-GPU" and s.imds_hop_limit == 1 and s.ssh_user == "ubuntu"
    assert [(st.name, st.file, st.wait_seconds) for st in s.stacks] == [("gpu-smoke", "stacks/gpu-smoke.yml", 600)]
    assert s.stacks[0].info.gpu_services[0].gpus == 1
    assert s.network.vpc_cidr == "10.42.0.0/16" and s.network.vpc_id is None
    assert s.ssh_private_key is None and s.tag_map == {"environment": "dev"}


def test_prod_stack_file_parses():
    use_mocks(stack_config("prod"), stack="prod")
    s = load_settings()
    assert s.managers.count == 3
    assert [(p.name, p.gpus_per_node, p.spot) for p in s.gpu_pools] == [("training", 8, False), ("inference", 4, True)]
    assert s.max_gpus_per_node == 8
    assert s.gpu_pools[0].root_volume_gib == 500
    # The Deep Learning AMI is for the GPU nodes; the managers stay on Ubuntu.
    assert (s.manager_ami_id, s.gpu_ami_id) == (UBUNTU_AMI, DEEP_LEARNING_AMI)
    # p5.48xlarge is offered in two zones only, so every subnet sits in one of them.
    assert s.network.availability_zones == ("us-east-1a", "us-east-1c")


def test_subnets_keep_their_cidr_when_zones_change():
    use_mocks(stack_config("dev"))
    all_zones = load_settings().network
    use_mocks(stack_config("dev", availabilityZones=["us-east-1c"]))
    one_zone = load_settings().network
    assert one_zone.subnet_cidrs == (dict(zip(all_zones.availability_zones, all_zones.subnet_cidrs))["us-east-1c"],)


def test_existing_vpc_and_subnets():
    use_mocks(stack_config("prod", vpcId=VPC, subnetIds=["subnet-0cccccccccccccccc", "subnet-0aaaaaaaaaaaaaaaa"]))
    net = load_settings().network
    assert net.vpc_id == VPC and net.vpc_cidr is None
    assert net.subnet_ids == ("subnet-0cccccccccccccccc", "subnet-0aaaaaaaaaaaaaaaa")
    assert net.availability_zones == ("us-east-1c", "us-east-1a")


def test_custom_ami_keeps_nodes_replaceable_on_ami_change():
    use_mocks(stack_config("dev", image="custom", amiId=CUSTOM_AMI))
    s = load_settings()
    assert (s.manager_ami_id, s.gpu_ami_id, s.ami_from_ssm) == (UBUNTU_AMI, CUSTOM_AMI, False)


def test_supplied_key_pair_stays_secret():
    private = "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----\n"
    use_mocks(
        stack_config("dev", sshPublicKey="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB me@host", sshPrivateKey=private),
        secret_keys=("gpu-swarm:sshPrivateKey",),
    )
    s = load_settings()
    assert s.ssh_public_key.startswith("ssh-ed25519 ")
    assert _sync_await(s.ssh_private_key.is_secret())


def test_address_alone_means_its_own_network_and_duplicates_collapse():
    use_mocks(stack_config("dev", allowedSshCidrs=["203.0.113.7", "203.0.113.7/32", "2001:db8::/48"]))
    assert load_settings().allowed_ssh_cidrs == ("203.0.113.7/32", "2001:db8::/48")


def test_anywhere_is_accepted_when_asked_for():
    use_mocks(stack_config("dev", allowedSshCidrs=["0.0.0.0/0"], allowSshFromAnywhere="true"))
    assert load_settings().allowed_ssh_cidrs == ("0.0.0.0/0",)


# ---------------------------------------------------------------- Pulumi.yaml declares what settings/ reads


def test_project_file_declares_every_key_with_the_same_default():
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    declared = project["config"]
    assert set(declared) == set(DEFAULTS)
    for name, default in DEFAULTS.items():
        decl = declared[name]
        assert decl.get("description", "").strip(), name
        if default is None:
            assert "default" not in decl, f"{name} is required: a default would hide a missing value"
        else:
            assert decl["default"] == default, name


def test_project_file_passes_the_cli_rules():
    """The checks `pulumi` applies to project config (sdk/go/common/workspace/project.go)."""
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert project["name"] == "gpu-swarm"
    assert project["runtime"] == {"name": "python", "options": {"toolchain": "pip", "virtualenv": ".venv"}}
    python_types = {"string": str, "integer": int, "boolean": bool, "array": list}
    for name, decl in project["config"].items():
        assert set(decl) <= {"type", "items", "description", "default", "secret"}, name
        if "type" not in decl:
            continue  # untyped: objects, which the CLI's schema cannot type
        assert decl["type"] in python_types, name
        if decl["type"] == "array":
            assert decl["items"]["type"] in ("string", "integer", "boolean"), name
        if "default" in decl:
            assert isinstance(decl["default"], python_types[decl["type"]]), name
        # A secret key with a plain default fails the CLI's "must be encrypted" check.
        assert not (decl.get("secret") and "default" in decl), name


SHARED_STACK = """services:
  infer:
    image: vllm/vllm-openai
    deploy:
      replicas: 8
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec:
                kind: NVIDIA-GPU-SHARED
                value: 1
"""


def test_a_shared_pool_reads_its_slots_and_stacks_may_reserve_one(tmp_path, monkeypatch):
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "infer.yml").write_text(SHARED_STACK)
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "sharing": {"slotsPerGpu": 4}}),
                           stacks=[{"name": "infer", "file": "stacks/infer.yml"}]))
    s = load_settings()
    (pool,) = s.gpu_pools
    assert pool.slots_per_gpu == 4 and s.shared_gpu_kind == "NVIDIA-GPU-SHARED"
    assert s.shares_gpus and s.max_whole_gpus_per_node == 0
    assert s.stacks[0].info.gpu_services[0].slots == 1


def test_a_shared_kind_reservation_without_a_shared_pool_is_refused(tmp_path, monkeypatch):
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "infer.yml").write_text(SHARED_STACK)
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    use_mocks(stack_config("dev", stacks=[{"name": "infer", "file": "stacks/infer.yml"}]))
    with pytest.raises(SettingsError, match="is 'NVIDIA-GPU-SHARED', but this cluster's nodes advertise 'NVIDIA-GPU'"):
        load_settings()


def test_whole_gpu_reservations_need_a_pool_that_does_not_share(tmp_path, monkeypatch):
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "sharing": {"slotsPerGpu": 2}})))
    with pytest.raises(SettingsError, match="every pool shares its GPUs"):
        load_settings()


@pytest.mark.parametrize("count, rollout, nodes", [
    (4, None, 1), (20, None, 2), (1000, None, 100),  # the default, 10 %: one by one up to 19 nodes
    (4, {"maxUnavailable": 2}, 2), (4, {"maxUnavailable": "2"}, 2),  # pulumi config set --path gives a string
    (9, {"maxUnavailable": "25%"}, 2), (3, {"maxUnavailable": "25%"}, 1),  # rounded down, at least one
    (3, {"maxUnavailable": 10}, 3), (0, None, 1),
])
def test_a_pools_rollout_drains_at_most_max_unavailable_nodes_at_once(count, rollout, nodes):
    use_mocks(stack_config("dev", gpuPools=pools({**T4, "count": count, **({"rollout": rollout} if rollout else {})})))
    (pool,) = load_settings().gpu_pools
    assert pool.max_unavailable == nodes


def test_health_defaults_and_settings_reach_the_node_env():
    use_mocks(stack_config("dev"))
    health = load_settings().health
    assert health == settings.Health() and health.inventory_each_up is True
    assert health.node_env() == {"HEALTH_IGNORE_XIDS": "", "HEALTH_CRITICAL_XIDS": "", "HEALTH_INTERVAL_SECONDS": "10",
                                 "HEALTH_RECOVERY_SECONDS": "300", "HEALTH_MAX_DRAINED_PERCENT": "50"}
    use_mocks(stack_config("dev", health={"ignoreXids": [95, 94, 94], "criticalXids": ["43"], "checkIntervalSeconds": 5,
                                          "recoverySeconds": 60, "maxDrainedPercent": 25, "inventoryEachUp": False}))
    health = load_settings().health
    assert (health.ignore_xids, health.critical_xids, health.inventory_each_up) == ((94, 95), (43,), False)
    assert health.node_env() == {"HEALTH_IGNORE_XIDS": "94,95", "HEALTH_CRITICAL_XIDS": "43",
                                 "HEALTH_INTERVAL_SECONDS": "5", "HEALTH_RECOVERY_SECONDS": "60",
                                 "HEALTH_MAX_DRAINED_PERCENT": "25"}
