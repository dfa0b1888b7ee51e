"""A Capacity Block's end: the node's watcher drains it before AWS starts terminating the block's instances.

AWS begins to terminate them 30 minutes before the block ends (EC2 User Guide, "Monitor Capacity Blocks using
EventBridge"). The watcher (node/gpu_health.py, real process) reads the end from health.env and reports
`reclaim` from 40 minutes before it, which the reconciler drains at once, as for a spot notice; it shows it,
as degraded, from an hour before that. No IMDS is needed for it: the end came from the program's preview.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from tests.test_gpu_health import health, node  # noqa: F401 (the watcher's fixture)


def _rfc3339(seconds_from_now: float) -> str:
    return datetime.fromtimestamp(time.time() + seconds_from_now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("ends_in_min, condition", [
    (24 * 60, "healthy"), (105, "healthy"), (95, "degraded"), (45, "degraded"), (35, "reclaim"), (10, "reclaim"),
    (-5, "reclaim"),
])
def test_the_node_drains_ten_minutes_before_aws_begins_to_terminate_the_block(node, ends_in_min, condition):  # noqa: F811
    end = _rfc3339(ends_in_min * 60)
    report, log = node.once("--no-maintenance", env={"HEALTH_CAPACITY_BLOCK_END": end})
    assert report["condition"] == condition, report
    if condition != "healthy":
        assert report["reason"] == f"capacity_block_ends_at_{end}"
        assert node.labels()["gpu-swarm.condition"] == condition
    assert "its Capacity Block's end" in log


def test_the_blocks_drain_needs_no_imds(node):  # noqa: F811
    """The metadata service not answering (it never does here: NO_IMDS) holds no drain back."""
    report, _ = node.once(env={"HEALTH_CAPACITY_BLOCK_END": _rfc3339(20 * 60)})
    assert report["condition"] == "reclaim"


def test_a_bad_end_is_refused_naming_the_form(node):  # noqa: F811
    done = node.cli("--once", env={"HEALTH_CAPACITY_BLOCK_END": "next tuesday"})
    assert done.returncode == 2 and "is not a time such as 2026-12-04T11:30:00Z" in done.stderr


def test_the_lead_is_aws_termination_plus_ten_minutes():
    sources = health.Imds.__init__.__globals__
    assert sources["CAPACITY_BLOCK_TERMINATION_S"] == 30 * 60
    assert sources["CAPACITY_BLOCK_DRAIN_S"] == 40 * 60
