"""Day 2 on a real swarm: what `pulumi up` does after the first, with the scripts the program sends.

Each scenario changes a running rehearsal as a later `pulumi up` changes a cluster, through
localswarm.converge (the Pulumi graph's steps in order), and then checks that there is one
swarm with the expected members and GPUs.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from localswarm.nodes import REGISTRY, STATE_ROOT, Node, docker, run_script
from swarm import formation
from tests.rehearsal_tools import (advertised, cli, cli_json, manager, node_of, node_update, rehearsal_up,
                                   running_pairs, status, tasks_of, wait_for)

pytestmark = pytest.mark.integration


def swarm_members(view: dict) -> dict[str, tuple[str, str]]:
    return {n["name"]: (n["role"], n["state"]) for n in view["nodes"]}


def cluster_ids(names: list[str], engine) -> set[str]:
    """The swarm each node is in, by its certificate, as join_swarm reads it."""
    ids = set()
    for name in names:
        root = STATE_ROOT / name / "docker" / "swarm" / "certificates" / "swarm-node.crt"
        out = docker(Node(name, int(name.split("-")[1]), "worker"), engine, "info", "--format",
                     "{{.Swarm.LocalNodeState}}").stdout.strip()
        assert out == "active", f"{name} is {out}"
        subject = subprocess.run(["openssl", "x509", "-noout", "-subject", "-in", str(root)],
                                 capture_output=True, text=True, check=True).stdout
        ids.add(subject.split("O = ")[1].split(",")[0])
    return ids



@pytest.fixture(scope="module")
def three_managers(engine):
    yield from rehearsal_up("--nodes", "5", "--managers", "3", "--gpus-per-node", "1")


def test_a_second_pulumi_up_changes_nothing(three_managers, engine):
    before = json.loads((STATE_ROOT / "state.json").read_text())["cluster_id"]
    first = cli_json("converge")
    again = cli_json("converge")
    assert first["cluster_id"] == again["cluster_id"] == before
    assert first["node_ids"] == again["node_ids"]
    view = again["view"]
    assert len(running_pairs(view, "smoke_gpu")) == 5
    assert {n["availability"] for n in view["nodes"]} == {"active"}


def test_replacing_the_first_manager_joins_the_swarm_the_others_hold(three_managers, engine):
    before = status()
    gpus_before = {n: g for n, g in advertised(before).items() if n != "node-1"}
    cluster = json.loads((STATE_ROOT / "state.json").read_text())["cluster_id"]
    result = cli_json("node", "replace", "node-1")
    assert result["cluster_id"] == cluster  # no second swarm
    new = next(name for name in result["node_ids"] if name not in ("node-2", "node-3", "node-4", "node-5"))
    view = wait_for(lambda v: all(n["state"] == "ready" for n in v["nodes"]), 60, "every member ready")
    assert set(swarm_members(view)) == {new, "node-2", "node-3", "node-4", "node-5"}  # node-1 removed
    assert node_of(view, new)["role"] == "manager"
    assert sum(n["role"] == "manager" for n in view["nodes"]) == 3
    assert cluster_ids([new, "node-2", "node-3", "node-4", "node-5"], engine) == {cluster}
    for name, gpus in gpus_before.items():
        assert advertised(view)[name] == gpus
    wait_for(lambda v: len(running_pairs(v, "smoke_gpu")) == 5, 90, "the smoke tasks on the five GPUs")


def test_rolling_new_software_drains_one_node_per_pool_at_a_time(three_managers, engine):
    result = cli_json("roll")
    assert result["peak_drained_per_pool"] == {"managers": 1, "rehearsal": 1}
    # The new release changes no node's daemon.json, so no engine restarts (no leader change either).
    assert result["engines_restarted"] == []
    view = wait_for(lambda v: {n["availability"] for n in v["nodes"]} == {"active"}
                    and len(running_pairs(v, "smoke_gpu")) == 5, 90, "every node active again")
    assert not any(n["drained_by"] or n["maintenance"] for n in view["nodes"])


def test_an_operator_drain_survives_a_roll(three_managers, engine):
    node_update(engine, "node-5", "--availability", "drain")
    cli_json("roll")
    view = status()
    assert node_of(view, "node-5")["availability"] == "drain"  # the program gives back only what it took
    node_update(engine, "node-5", "--availability", "active")


def test_scaling_down_drains_the_node_and_removes_it(three_managers, engine):
    view = wait_for(lambda v: len(running_pairs(v, "smoke_gpu")) == 5, 60, "5 smoke tasks running")
    cli_json("node", "remove", "node-5")
    view = wait_for(lambda v: "node-5" not in swarm_members(v) and len(running_pairs(v, "smoke_gpu")) == 4,
                    90, "node-5 gone and its task on another GPU")
    assert all(n != "node-5" for n, _ in running_pairs(view, "smoke_gpu"))


def test_removing_a_stack_removes_it_from_the_swarm(three_managers, engine):
    cli_json("stacks")  # the program lists no stack any more
    lead = manager()
    assert docker(lead, engine, "stack", "ls", "--format", "{{.Name}}").stdout.strip() == ""
    assert docker(lead, engine, "config", "ls", "-q", "--filter", "name=gpu-swarm.stack.").stdout.strip() == ""
    # A stack someone deployed by hand is not the program's to remove.
    hand = "services:\n  web:\n    image: " + REGISTRY + "/gpu-swarm/standin:1\n"
    run_script(lead, engine, "docker stack deploy --detach=true -c - handmade >/dev/null", stdin=hand)
    cli_json("converge")
    assert "handmade" in docker(lead, engine, "stack", "ls", "--format", "{{.Name}}").stdout


def test_destroy_leaves_no_swarm(three_managers, engine):
    """With no stack and no GPU node left, every node can leave: what a graceful destroy would do."""
    state = json.loads((STATE_ROOT / "state.json").read_text())
    nodes = [Node(**n) for n in state["nodes"]]
    for node in [n for n in nodes if n.role == "worker"] + [n for n in nodes if n.role == "manager"][::-1]:
        assert run_script(node, engine, formation.leave_swarm()).strip() == "left the swarm"
        assert run_script(node, engine, formation.leave_swarm()).strip() == "not in a swarm"


def test_replacing_the_only_manager_makes_a_new_swarm_and_every_node_moves_to_it(engine):
    cli("down")
    try:
        cli_json("up", "--nodes", "3", "--gpus-per-node", "1")
        old = json.loads((STATE_ROOT / "state.json").read_text())["cluster_id"]
        result = cli_json("node", "replace", "node-1")
        assert result["cluster_id"] != old  # nobody was left to hold the old swarm
        names = list(result["node_ids"])
        assert cluster_ids(names, engine) == {result["cluster_id"]}  # the workers left the dead swarm
        view = wait_for(lambda v: len(running_pairs(v, "smoke_gpu")) == 3, 90, "the stack redeployed and running")
        assert set(swarm_members(view)) == set(names)
        assert len(tasks_of(view, "smoke_gpu")) == 4
    finally:
        cli("down")
