"""A roll of new node software through a pool of 4 in waves, by Pulumi's own CLI on the rehearsal's machines.

A stack of its own (its own lane, beside tests/test_pulumi_up.py, whose life it needs nothing of): the
first up makes the pool of 4 with rollout.maxUnavailable 2, and one up at `--parallel 1` rolls it.
"""
from __future__ import annotations

import time

import pytest

from localswarm import pulumi_cli
from tests.rehearsal_tools import cli, require_engine
from tests.test_pulumi_up import config_set, inventory, ran, status, up

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pool_of_4():
    require_engine()
    cli("down")
    config_set("gpuPools[0].count", "4")
    config_set("gpuPools[0].rollout.maxUnavailable", "2")
    yield up()
    cli("down")


def test_a_pool_of_4_with_max_unavailable_2_rolls_in_2_waves_even_one_command_at_a_time(pool_of_4):
    """A pool of 4 nodes with rollout.maxUnavailable 2: new node software rolls at
    `--parallel 1`: wave 1's cordons run only once both of wave 0's nodes are admitted, and the swarm
    never sees more than 2 of the pool drained."""
    assert sorted(n for n in inventory() if "-t4-" in n) == [f"gpu-swarm-dev-t4-{i}" for i in range(4)]
    started = time.monotonic()
    up("--parallel", "1", rehearsal=("--bump-node-software",))
    seconds = round(time.monotonic() - started, 1)
    order = ran()  # in the order they finished
    for node in range(4):
        assert {f"gpu-swarm-rollout-t4-{node}-{step}" for step in ("cordon", "upgrade", "admit")} <= set(order), node
    first_wave_in = max(order.index(f"gpu-swarm-rollout-t4-{n}-admit") for n in (0, 1))
    assert all(order.index(f"gpu-swarm-rollout-t4-{n}-cordon") > first_wave_in for n in (2, 3)), order
    peak = pulumi_cli.last_run()["peak_drained_per_pool"]
    assert 1 <= peak.get("t4", 0) <= 2, peak
    assert all(n["availability"] == "active" for n in status()["nodes"])
    took = {c["name"]: c["seconds"] for c in pulumi_cli.last_run()["commands"]}
    per_node = [sum(took[f"gpu-swarm-rollout-t4-{n}-{s}"] for s in ("cordon", "upgrade", "admit")) for n in range(4)]
    print(f"roll of 4 GPU nodes in 2 waves at --parallel 1: {seconds} s; per node (cordon + upgrade + admit): "
          f"{', '.join(f'{s:.1f}' for s in per_node)} s; peak drained {peak}")  # the README's roll times (pytest -s)
