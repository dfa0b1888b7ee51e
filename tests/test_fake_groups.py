"""The fake account's Auto Scaling groups (localswarm/fake_groups.py) do what the documents it cites say a group does.

A fake that answered otherwise than AWS would make the scaler's tests prove nothing, so the fake itself is held here
(docs/reference/aws-behaviour.md lists each behaviour with its source).
"""
from __future__ import annotations

import pytest

from localswarm import fake_groups
from localswarm.fake_account import AwsError


def group(desired=None, protect=True, low=0, high=3):
    groups: dict = {}
    inputs = {"minSize": low, "maxSize": high, "protectFromScaleIn": protect}
    if desired is not None:
        inputs["desiredCapacity"] = desired
    fake_groups.create_group(groups, "g", inputs)
    return groups


class Launches:
    def __init__(self):
        self.launched, self.terminated = [], []

    def converge(self, groups):
        return fake_groups.converge(groups, "g", lambda g, i: self.launched.append(i), self.terminated.append)


def test_a_new_group_starts_at_its_min_and_refuses_a_desired_capacity_outside_its_bounds():
    assert group(low=1)["g"]["desired"] == 1
    with pytest.raises(AwsError, match="Desired capacity:5 must be between the specified min size:0 and max size:3"):
        group(desired=5)
    groups = group()
    with pytest.raises(AwsError, match="New SetDesiredCapacity value 4 is above max value 3"):
        fake_groups.set_desired_capacity(groups, "g", 4)


def test_a_group_launches_what_it_lacks_and_replaces_a_reclaimed_instance():
    groups, aws = group(), Launches()
    fake_groups.set_desired_capacity(groups, "g", 2)
    aws.converge(groups)
    assert len(aws.launched) == 2 and set(groups["g"]["instances"]) == set(aws.launched)
    assert all(rec["lifecycle"] == "InService" and rec["protected"] for rec in groups["g"]["instances"].values())
    gone = aws.launched[0]
    fake_groups.reclaim(groups, gone)
    aws.converge(groups)
    assert aws.terminated == [gone] and len(aws.launched) == 3 and gone not in groups["g"]["instances"]
    assert groups["g"]["desired"] == 2  # the reclaim left the desired capacity: the group made it good


def test_protected_instances_stay_when_the_desired_capacity_drops_but_a_named_one_goes():
    groups, aws = group(), Launches()
    fake_groups.set_desired_capacity(groups, "g", 2)
    aws.converge(groups)
    fake_groups.update_group(groups, "g", {"minSize": 0, "maxSize": 1, "protectFromScaleIn": True})
    assert groups["g"]["desired"] == 1  # a max below the desired capacity lowers it
    aws.converge(groups)
    assert aws.terminated == [] and len(groups["g"]["instances"]) == 2  # protected from the scale-in
    fake_groups.terminate_instance(groups, aws.launched[1], decrement=True)
    aws.converge(groups)
    assert aws.terminated == [aws.launched[1]] and groups["g"]["desired"] == 0


def test_an_unprotected_group_scales_in_by_itself_and_a_delete_takes_its_instances():
    groups, aws = group(protect=False), Launches()
    fake_groups.set_desired_capacity(groups, "g", 2)
    aws.converge(groups)
    fake_groups.set_desired_capacity(groups, "g", 1)
    aws.converge(groups)
    assert len(aws.terminated) == 1 and len(groups["g"]["instances"]) == 1
    fake_groups.delete_group(groups, "g", aws.terminated.append)
    assert "g" not in groups and len(aws.terminated) == 2


def test_terminating_an_instance_of_no_group_is_refused():
    with pytest.raises(AwsError, match="No managed instance found for instance ID: i-0nothing"):
        fake_groups.terminate_instance(group(), "i-0nothing", decrement=False)
