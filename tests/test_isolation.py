"""The post-join GPU check on the fast rehearsal: it proves each node's GPUs, and a node whose engine lost
its runtime guard fails it and is drained.

What a task sees and holds (isolation, slots, a GPU never held twice) is tested on a swarm that Pulumi's
own CLI made, in tests/test_sharing_rehearsal.py. The leak drill stays here: on the CLI's machines an
engine restarted with the guard taken out of its daemon.json still ran the guard as its default runtime
(`docker info`, 2026-12-03), so that drill needs another way to lose the guard there. Two of the three
nodes share their GPUs (4 slots each); node-1 has whole GPUs.
"""
from __future__ import annotations

import json

import pytest

from localswarm import changes
from localswarm.host import RehearsalError
from localswarm.nodes import STATE_ROOT, Node, restart_dockerd
from tests.rehearsal_tools import cli_json, node_of, node_update, rehearsal_up, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shared(engine):
    yield from rehearsal_up("--nodes", "3", "--gpus-per-node", "2", "--slots-per-gpu", "4", "--shared-nodes", "2")


def test_every_node_proved_its_gpus_when_it_joined(shared, engine):
    again = cli_json("converge")
    assert set(again["checks"]) == {"node-1", "node-2", "node-3"}
    assert all(check and check["verified"] for check in again["checks"].values())
    assert {n["availability"] for n in again["view"]["nodes"]} == {"active"}


def test_a_node_whose_runtime_lets_gpus_leak_fails_its_check_and_is_drained(shared, engine):
    node = Node("node-2", 2, "worker", "shared")
    daemon_json = STATE_ROOT / "node-2" / "daemon.json"
    guarded = daemon_json.read_text()
    config = json.loads(guarded)
    del config["default-runtime"], config["runtimes"]["gpu-swarm"]  # as if the guard were lost
    daemon_json.write_text(json.dumps(config))
    restart_dockerd(node, engine)
    node_update(engine, "node-2", "--label-rm", "gpu-swarm.gpus-verified")
    try:
        with pytest.raises(RehearsalError) as err:
            changes.converge_again(progress=lambda _: None)
        assert "failed its GPU check, so it was drained" in str(err.value)
        assert '"unreserved_saw": ["GPU 0: every GPU of the node (NVIDIA_VISIBLE_DEVICES=all, no guard)' in str(err.value)
        view = wait_for(lambda v: node_of(v, "node-2")["availability"] == "drain", 30, "node-2 drained")
        assert node_of(view, "node-2")["drained_by"] == "gpu-check"
    finally:
        daemon_json.write_text(guarded)
        restart_dockerd(node, engine)
    result = cli_json("converge")  # fixed: the node is given back, and nothing leaks any more
    check = result["checks"]["node-2"]
    # Its slots may already be taken again by the tasks that waited for them: that is no evidence.
    assert check["verified"] in (True, None) and check["unreserved_saw"] == []
    view = wait_for(lambda v: node_of(v, "node-2")["availability"] == "active", 30, "node-2 active again")
    assert not node_of(view, "node-2")["drained_by"]
