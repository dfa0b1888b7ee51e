"""The operator policy (components/operator_policy.py, docs/reference/operator-policy.md) covers every AWS call the
program makes, and a preview whose credentials lack one says which, never another reason.

The program runs under mocks with stacks that between them register every resource type and ask every data
source it has: the dev and prod stacks, a spot `stop` pool with EFA, a Capacity Block, an existing VPC with its
own subnets, a custom AMI, an elastic pool. A type or data source with no row in the policy's table fails here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components import operator_policy
from localswarm import fake_aws
from settings import SettingsError, load_settings
from tests.conftest import CUSTOM_AMI, run_program, stack_config, use_mocks

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "reference" / "operator-policy.md"
T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}
STACKS = [
    ("dev", stack_config("dev")),
    ("prod", stack_config("prod")),
    ("stop-efa-block", stack_config("dev", gpuPools=[
        {"name": "train", "instanceType": "g6e.12xlarge", "count": 1, "marketType": "spot", "interruption": "stop",
         "efa": True},
        {"name": "block", "instanceType": "p5.48xlarge", "count": 1, "marketType": "capacity-block",
         "capacityReservation": fake_aws.BLOCK_RESERVATION}])),
    ("existing-vpc-custom-ami", stack_config("dev", vpcId=fake_aws.VPC, image="custom", amiId=CUSTOM_AMI,
                                             subnetIds=["subnet-0aaaaaaaaaaaaaaaa", "subnet-0cccccccccccccccc"],
                                             gpuPools=[T4])),
    ("elastic", stack_config("dev", gpuPools=[{"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"max": 2}}])),
]


@pytest.fixture(scope="module")
def used() -> tuple[set[str], set[str]]:
    """(AWS resource types registered or read, data sources asked) over every stack above."""
    types, lookups = set(), set()
    for _, config in STACKS:
        run = run_program(config, stack="prod")
        types |= {r.type for r in [*run.monitor.requests.values(), *run.monitor.reads.values()]
                  if r.type.startswith("aws:")}
        lookups |= run.monitor.invokes
    return types, lookups


def test_every_resource_type_the_program_registers_has_its_actions_in_the_policy(used):
    types, _ = used
    assert types - set(operator_policy.RESOURCES) == set()
    assert {"aws:ec2/instance:Instance", "aws:ec2/launchTemplate:LaunchTemplate",
            "aws:ec2/capacityReservation:CapacityReservation", "aws:autoscaling/group:Group",
            "aws:iam/rolePolicy:RolePolicy"} <= types  # the stacks reach the rare ones


def test_every_data_source_the_program_asks_has_its_actions_in_the_policy(used):
    _, lookups = used
    assert {t for t in lookups if t.startswith("aws:")} - set(operator_policy.LOOKUPS) == set()
    assert set(fake_aws.ANSWERS) <= set(operator_policy.LOOKUPS)
    assert {"aws:ec2/getVpc:getVpc", "aws:ec2/getSubnet:getSubnet",
            "aws:ec2/getCapacityBlockReservation:getCapacityBlockReservation"} <= lookups


def test_the_policy_is_iam_json_with_actions_of_iams_form():
    doc = operator_policy.policy()
    assert doc["Version"] == "2012-10-17" and doc["Statement"]
    for action in operator_policy.actions():
        assert re.fullmatch(r"[a-z0-9-]+:[A-Z][A-Za-z0-9]+", action), action
    spot = [s for s in doc["Statement"] if s["Action"] == "iam:CreateServiceLinkedRole"]
    assert spot and spot[0]["Condition"] == {"StringLike": {"iam:AWSServiceName": "spot.amazonaws.com"}}
    # Cloud Control's prefix is cloudformation: there is no cloudcontrol: action.
    assert "cloudformation:GetResource" in operator_policy.actions()
    assert not [a for a in operator_policy.actions() if a.startswith("cloudcontrol:")]


def test_the_docs_publish_the_policy_the_table_makes():
    text = DOC.read_text()
    published = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    assert published == operator_policy.policy(), "run python -m components.operator_policy and paste its output"


# The lookups the preview's checks ask (the others are the program's own, whose AccessDenied reaches the operator
# in the provider's words, which name the action, and the cost table's, which warn: tests/test_cost.py).
AT_PREVIEW = sorted(set(operator_policy.LOOKUPS) - {"aws:ec2/getVpcEndpoint:getVpcEndpoint",
                                                    "aws:ec2/getRouteTables:getRouteTables",
                                                    "aws:ec2/getInstances:getInstances",
                                                    "aws:pricing/getProduct:getProduct",
                                                    "aws:ec2/getSpotPrice:getSpotPrice"})


@pytest.mark.parametrize("token", AT_PREVIEW)
def test_a_preview_whose_credentials_lack_a_lookups_action_names_that_action(token):
    """Never a wrong reason: a reservation Cloud Control may not read is not one that has ended."""
    action = operator_policy.LOOKUPS[token][0]
    config = next(c for name, c in STACKS if name == ("existing-vpc-custom-ami" if "Vpc" in token or "Subnet:" in token
                                                       else "stop-efa-block" if "CapacityBlock" in token else "prod"))
    use_mocks(config, stack="prod")
    fake_aws.ACCOUNT.denied.add(action)
    if token == "aws:servicequotas/getServiceQuota:getServiceQuota":
        load_settings()  # unread quotas warn and go on (tests/test_quotas.py)
        return

    with pytest.raises(SettingsError) as err:
        load_settings()
    text = str(err.value)
    assert f"may not call {action}" in text and "docs/reference/operator-policy.md" in text, text
    assert "expired or was cancelled" not in text and "check the id" not in text
