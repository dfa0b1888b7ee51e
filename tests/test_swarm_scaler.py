"""The scaler's rounds (node/swarm_scaler.py): what it does to the swarm and to AWS for each decision of scale_plan.

The swarm is a stand-in that answers what `docker node inspect` and the Engine API's /tasks would and records each
`docker node update` and `rm`; AWS is the rehearsal's endpoints with the scaler role's policy (tests/test_aws_api.py's
Cloud), reached by the node's own client. The pure decisions are tests/test_scale_plan.py's; these check that each
is carried out, logged with its reason, and published in the leader's status label, and that a non-leader does nothing.
"""
from __future__ import annotations

import json
import time

import pytest

from swarm.node_module import load
from tests.test_aws_api import GROUP, Cloud
from tests.test_scale_plan import node, on, pending

scaler_module = load("swarm_scaler.py", "swarm_scaler_under_test")
POOL = {"name": "t4", "group": GROUP, "min": 0, "max": 2, "idleSeconds": 600, "kind": "NVIDIA-GPU", "units": 1,
        "labels": {"gpu-swarm.pool": "t4"}, "release": "a" * 64, "gpuKinds": ["NVIDIA-GPU"]}
LEADER = "leaderaaaaaaaaaaaaaaaaaaa"


class FakeSwarm:
    def __init__(self, leader=True):
        self.leader, self.node_list, self.task_list, self.updates, self.removed = leader, [], [], [], []

    def is_leader(self):
        return self.leader

    def nodes(self):
        return self.node_list

    def tasks(self):
        return self.task_list

    def update(self, args):
        self.updates.append(tuple(args))

    def remove(self, args):
        self.removed.append(tuple(args))

    def self_id(self):
        return LEADER


@pytest.fixture
def cloud():
    c = Cloud()
    yield c
    c.close()


def make(cloud, swarm, tmp_path, now=1_800_000_000, client=None):
    client = client or cloud.as_instance("scaler")
    lines = []
    scaler = scaler_module.Scaler(swarm, lambda region: client, str(tmp_path), lines.append, clock=lambda: now)
    pools = [scaler_module.scale_plan.Pool.from_json(POOL)]
    return scaler, pools, lines


def test_a_waiting_gpu_task_grows_the_group_and_the_decision_is_logged_and_published(cloud, tmp_path):
    swarm = FakeSwarm()
    swarm.task_list = [pending(1), pending(2)]
    scaler, pools, lines = make(cloud, swarm, tmp_path)
    report = scaler.round("us-east-1", pools)
    assert report["errors"] == [] and [a["kind"] for a in report["actions"]] == ["scale-out"]
    assert cloud.state["groups"][GROUP]["desired"] == 2 and len(cloud.launched) == 2
    assert any("pool t4: desired capacity 2: 2 pending GPU task(s)" in line for line in lines)
    label = next(u for u in swarm.updates if u[-1] == LEADER)
    status = json.loads(label[1].split("=", 1)[1])["t4"]
    assert (status["desired"], status["booting"], status["waiting"]) == (2, 2, 2)
    assert status["last"].startswith("1800000000 scale-out: 2 pending GPU task(s)")
    # The next round sees the two instances booting: it adds nothing and publishes nothing new.
    swarm.updates.clear()
    again = scaler.round("us-east-1", pools)
    assert again["actions"] == [] and cloud.state["groups"][GROUP]["desired"] == 2 and not swarm.updates


def test_a_drained_idle_node_is_terminated_with_a_decrement_and_then_forgotten(cloud, tmp_path):
    swarm = FakeSwarm()
    scaler, pools, lines = make(cloud, swarm, tmp_path)
    client = cloud.as_instance("scaler")
    client.set_desired_capacity(GROUP, 1)
    instance = cloud.launched[0]
    draining = node(1, availability="drain", instance=instance,
                    labels={"gpu-swarm.autoscale": "remove:draining:1799999990"})
    swarm.node_list = [draining]
    report = scaler.round("us-east-1", pools)
    assert [a["kind"] for a in report["actions"]] == ["terminate"], report
    assert cloud.state["groups"][GROUP]["desired"] == 0 and instance not in cloud.state["groups"][GROUP]["instances"]
    assert ("--label-add", "gpu-swarm.autoscale=remove:terminating:1800000000", draining["ID"]) in swarm.updates
    assert any(f"instance {instance} terminated and the group shrinks" in line for line in lines)
    draining["Status"]["State"] = "down"
    draining["Spec"]["Labels"]["gpu-swarm.autoscale"] = "remove:terminating:1800000000"
    assert [a["kind"] for a in scaler.round("us-east-1", pools)["actions"]] == ["forget"]
    assert swarm.removed == [("--force", draining["ID"])]


def test_a_node_that_joined_is_admitted_by_the_pools_script_in_the_background(cloud, tmp_path):
    swarm = FakeSwarm()
    scaler, pools, lines = make(cloud, swarm, tmp_path)
    cloud.as_instance("scaler").set_desired_capacity(GROUP, 1)
    (tmp_path / "t4.admit.sh").write_text('sleep 1; echo "admitted $1" >>"$(dirname "$0")/admits"; '
                                          'echo \'{"resources": [], "check": {"verified": true}}\'\n')
    joined = node(1, availability="drain", admitted=False, instance=cloud.launched[0])
    swarm.node_list = [joined]
    assert [a["kind"] for a in scaler.round("us-east-1", pools)["actions"]] == ["admit"]
    # While its admit runs, the next round leaves the node alone.
    assert scaler.round("us-east-1", pools)["actions"] == []
    for thread in scaler.admitting.values():
        thread.join(timeout=30)
    assert (tmp_path / "admits").read_text() == f"admitted {joined['ID']}\n"
    assert any("admitted: {\"resources\": [], \"check\": {\"verified\": true}}" in line for line in lines)


def test_a_group_at_its_min_refuses_the_decrement_and_the_node_is_given_back(cloud, tmp_path):
    swarm = FakeSwarm()
    client = cloud.as_instance("scaler")
    terminate = client.terminate_instance

    def raced(instance, decrement):  # an operator raises the group's min between the scaler's read and its call
        cloud.state["groups"][GROUP]["min"] = 1
        return terminate(instance, decrement)
    client.terminate_instance = raced
    scaler, pools, lines = make(cloud, swarm, tmp_path, client=client)
    client.set_desired_capacity(GROUP, 1)
    draining = node(1, availability="drain", instance=cloud.launched[0],
                    labels={"gpu-swarm.autoscale": "remove:draining:1799999990", "gpu-swarm.drained-by": "autoscale"})
    swarm.node_list = [draining]
    scaler.round("us-east-1", pools)
    assert cloud.launched[0] in cloud.state["groups"][GROUP]["instances"]  # not terminated
    assert ("--availability", "active", "--label-rm", "gpu-swarm.autoscale", "--label-rm", "gpu-swarm.drained-by",
            draining["ID"]) in swarm.updates
    assert any("given back: the group refused to shrink below its min" in line for line in lines)


def test_a_manager_that_is_not_the_leader_does_nothing(cloud, tmp_path):
    swarm = FakeSwarm(leader=False)
    swarm.task_list = [pending(1)]
    scaler, pools, _ = make(cloud, swarm, tmp_path)
    report = scaler.round("us-east-1", pools)
    assert report == {"leader": False, "actions": [], "errors": [], "reports": []}
    assert cloud.state["groups"][GROUP]["desired"] == 0 and not swarm.updates


def test_aws_errors_are_reported_and_the_next_round_goes_on(cloud, tmp_path):
    swarm = FakeSwarm()
    swarm.task_list = [pending(1), on(2, 1)]
    scaler, pools, _ = make(cloud, swarm, tmp_path)
    cloud.state["roles"]["scaler"]["policies"] = {}  # the role lost its policy
    report = scaler.round("us-east-1", pools)
    assert report["errors"] and "AccessDenied" in report["errors"][0]
    assert not swarm.updates


def test_the_pools_file_is_read_each_round_and_none_means_idle(tmp_path):
    assert scaler_module.read_pools(str(tmp_path / "pools.json")) == ("", [])
    (tmp_path / "pools.json").write_text(json.dumps({"region": "us-east-1", "pools": [POOL]}))
    region, pools = scaler_module.read_pools(str(tmp_path / "pools.json"))
    assert region == "us-east-1" and pools[0].group == GROUP and pools[0].idle_s == 600
    assert time.time()  # the file is read again at each round: nothing to restart when the program changes it
