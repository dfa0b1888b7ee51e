"""The rehearsal's resource handlers refuse what AWS and the provider refuse (localswarm/local_cloud.py)."""
from __future__ import annotations

import pytest
from pulumi.runtime import mocks as pulumi_mocks

from localswarm.fake_account import AwsError
from localswarm.local_cloud import LocalCloud

PARAMETER = "aws:ssm/parameter:Parameter"
URN = "urn:pulumi:dev::gpu-swarm::gpu-swarm:index:Cluster$aws:ssm/parameter:Parameter::gpu-swarm-t4-image"
IMAGE = {"name": "/gpu-swarm/dev/t4/ami-id", "type": "String", "dataType": "aws:ec2:image",
         "insecureValue": "ami-0d1e2a3b4c5d6e7f8"}


def create(cloud: LocalCloud, inputs: dict) -> tuple[str, dict]:
    cloud.options.urn = URN
    return cloud.new_resource(pulumi_mocks.MockResourceArgs(PARAMETER, "gpu-swarm-t4-image", inputs, custom=True))


@pytest.fixture
def cloud():
    return LocalCloud(previous={}, region="us-east-1", say=lambda _: None, clock=lambda: 0.0)


def test_a_parameter_made_again_before_its_original_goes_is_refused_as_ssm_refuses_it(cloud):
    """A replacement made first (Pulumi's default) is a PutParameter without overwrite of a name that exists."""
    create(cloud, IMAGE)
    with pytest.raises(AwsError, match=r"PutParameter.*ParameterAlreadyExists"):
        create(cloud, {**IMAGE, "insecureValue": "ami-0d1e2a3b4c5d6e7f9"})


def test_a_parameter_made_after_its_original_went_or_with_overwrite_is_made(cloud):
    rid, _ = create(cloud, IMAGE)
    assert create(cloud, {**IMAGE, "overwrite": True})[1]["insecureValue"] == IMAGE["insecureValue"]
    cloud.current.pop(URN)  # deleted first: delete_before_replace
    assert create(cloud, {**IMAGE, "insecureValue": "ami-0d1e2a3b4c5d6e7f9"})[1]["insecureValue"].endswith("f9")
