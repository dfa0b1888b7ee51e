"""A Capacity Block's life, through Pulumi's own CLI on the rehearsal's machines: bought, extended, ending, ended.

A stack of its own (its own lane): the dev stack's GPU pool is one p5.48xlarge node in the fake AWS's
Capacity Block (us-east-1c), set as a user sets it (`pulumi config set --path`). Between the ups AWS
moves the block as it does (localswarm/aws_moves.py): nothing of the program or the stack changes, and
the program finds the block's new dates through its own lookup (aws.ec2.get_capacity_block_reservation).
- extended: AWS keeps the reservation id and moves its end (EC2 User Guide, "Extend Capacity Blocks");
  the next up rewrites the node's health settings, its watcher restarts with the new end, no node drains;
- ending: AWS begins to terminate the block's instances 30 minutes before its end (EC2 User Guide,
  "Capacity Blocks"; tests/test_capacity_block_end.py has the watcher's thresholds). After the next up,
  the node's own watcher reports `reclaim` from 40 minutes before, and the manager's reconciler drains it;
- ended: AWS has terminated the instance and shows the block `expired`. The preview says what to do; done
  as it says (count 0), the up passes, and the node's swarm entry and instance are gone.
The watcher and reconciler are the ones the machines' user data installed; nothing here starts them.
"""
from __future__ import annotations

import re

import pytest

from localswarm import aws_moves, fake_aws, machines, pulumi_cli
from node.contract import CAPACITY_BLOCK_END_ENV, HEALTH_ENV_PATH
from tests.rehearsal_tools import cli, diagnostics, pulumi, require_engine, tasks_of, until
from tests.test_pulumi_up import config_set, inventory, machine, ran, records, status, stepped, up

pytestmark = pytest.mark.integration
BLOCK = fake_aws.BLOCK_RESERVATION  # p5.48xlarge, 2 instances, in us-east-1c
NODE = "gpu-swarm-dev-t4-0"  # the dev stack's pool keeps its name; its type and market are the block's
LABEL_WAIT_S = 60  # a label reaches the manager on swarmkit's 20 s node-update tick


def block_end_on_node() -> str:
    """The block's end as the node's watcher reads it (health.env, which the program writes)."""
    text = machines.run(machine(NODE), ["cat", HEALTH_ENV_PATH], check=True).stdout
    (end,) = re.findall(rf"^{CAPACITY_BLOCK_END_ENV}=(\S+)$", text, re.M)
    return end


@pytest.fixture(scope="module")
def block():
    require_engine()
    cli("down")
    # Two days left: the dates are AWS's, relative to now, so that the run never depends on today's date.
    aws_moves.move_block(BLOCK, state="active", endDate=aws_moves.rfc3339(2 * 86400))
    config_set("availabilityZones[0]", "us-east-1a")
    config_set("availabilityZones[1]", "us-east-1c")  # the block's zone
    config_set("gpuPools[0].instanceType", "p5.48xlarge")
    config_set("gpuPools[0].marketType", "capacity-block")
    config_set("gpuPools[0].capacityReservation", BLOCK)
    yield up()
    cli("down")


def test_the_node_runs_in_its_block_and_its_watcher_knows_the_end(block):
    (instance,) = [r for r in pulumi_cli.exported("dev") if r["urn"].endswith("::gpu-swarm-t4-0")
                   and r["type"] == "aws:ec2/instance:Instance"]
    spec = instance["inputs"]["capacityReservationSpecification"]["capacityReservationTarget"]
    assert spec == {"capacityReservationId": BLOCK} and instance["inputs"]["instanceMarketOptions"] == {
        "marketType": "capacity-block"}
    node = inventory()[NODE]
    assert node["health"]["state"] == "ready" and len(node["gpusAdvertised"]) == 8 and node["gpusVerified"] is True
    assert block_end_on_node() == fake_aws_end()


def fake_aws_end() -> str:
    return aws_moves.recorded(BLOCK)["endDate"]


def test_an_extended_block_restarts_its_nodes_watcher_with_the_new_end_and_drains_nothing(block):
    before = records()[NODE]["machine"]
    aws_moves.move_block(BLOCK, endDate=aws_moves.rfc3339(9 * 86400))  # AWS extended it by a week
    again = up()
    assert stepped(again.stdout, "updated") == {"gpu-swarm-boot-t4-0-health", "gpu-swarm-health-read"}
    assert set(ran()) == {"gpu-swarm-boot-t4-0-health", "gpu-swarm-health-read"}
    assert pulumi_cli.last_run()["peak_drained_per_pool"].get("t4", 0) == 0
    assert block_end_on_node() == fake_aws_end() and records()[NODE]["machine"] == before
    assert all(n["availability"] == "active" for n in status()["nodes"])


def test_near_its_end_the_node_drains_itself_before_aws_terminates_it(block):
    aws_moves.move_block(BLOCK, endDate=aws_moves.rfc3339(35 * 60))  # AWS terminates from 30 min before
    up()
    assert block_end_on_node() == fake_aws_end()

    seen = []

    def drained():
        seen[:] = [next(n for n in status()["nodes"] if n["name"] == NODE)]
        return seen[0] if seen[0]["availability"] == "drain" and seen[0]["condition"] == "reclaim" else None

    try:
        node = until(drained, LABEL_WAIT_S + 30, f"{NODE} drained by its watcher")
    except AssertionError as e:
        raise AssertionError(f"{e}; the node as last seen: {seen}") from None
    assert node["drained_by"] == "health", node
    assert node["condition_reason"] == f"capacity_block_ends_at_{fake_aws_end()}", node
    tasks = tasks_of(status(), "gpu-smoke_gpu")
    assert tasks and not [t for t in tasks if t["state"] == "running"]  # no other node has GPUs


def test_once_ended_the_preview_says_what_to_do_and_done_so_the_up_passes(block):
    machines.terminate(machine(NODE))  # AWS terminated the block's instance
    aws_moves.move_block(BLOCK, state="expired", endDate=aws_moves.rfc3339(-60))
    refused = pulumi("preview")
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"{BLOCK} is expired" in said, diagnostics(refused)
    assert "Set the pool's count to 0" in said
    config_set("gpuPools[0].count", "0")  # as the preview says
    done = up()
    # The refresh (Pulumi.yaml's refresh: always) read the instance gone; the node's commands go with the pool.
    assert {"gpu-swarm-member-t4-0-join", "gpu-swarm-rollout-t4-0-admit"} <= stepped(done.stdout, "deleted")
    assert not [r for r in pulumi_cli.exported("dev") if "t4-0" in r["urn"].rsplit("::", 1)[1]]
    assert [n["name"] for n in status()["nodes"]] == ["gpu-swarm-dev-manager-0"]  # its swarm entry is gone
    assert NODE not in records()
