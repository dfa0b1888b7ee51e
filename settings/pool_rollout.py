"""A GPU pool's `rollout` key: how many of its nodes a roll of new node software drains at once.

    rollout: {maxUnavailable: 2}        # two nodes at a time
    rollout: {maxUnavailable: "25%"}    # a quarter of the pool, rounded down, at least one

The pool rolls in waves of that many nodes (components/node_rollout.py's RollWaves): each
wave is drained, upgraded and admitted side by side, and the next starts once every node of
the wave is back. Without the key a pool rolls 10 % at a time, so a pool of up to 19 nodes
rolls one by one and a pool of 1,000 in 10 waves (README "Rolling a pool").
"""
from __future__ import annotations

import re
from typing import Any, Callable

from settings.reader import ROLLOUT_DEFAULTS, integer, suggest

MAX_NODES = 1000  # a pool's count (settings/config_checks.py)
_PERCENT_RE = re.compile(r"\s*(\d+)\s*%\s*")
_FIX = (f'use a whole number of nodes from 1 to {MAX_NODES} (e.g. 2), or a share of the pool from "1%" '
        f'to "100%" (e.g. "10%", rounded down, at least one node)')


def read_rollout(value: Any, error: Callable[[str, str], None]) -> int | str | None:
    """The pool's maxUnavailable as given: a number of nodes, or a share such as "10%"; None when a
    problem was reported. wave_size() turns it into nodes once the pool's count is known."""
    if value is None or value == {}:
        value = {}
    if not isinstance(value, dict):
        error("rollout", f'expected an object such as {{maxUnavailable: 2}} or {{maxUnavailable: "10%"}}, '
                         f"found {value!r}")
        return None
    for unknown in sorted(set(value) - set(ROLLOUT_DEFAULTS)):
        error(f"rollout.{unknown}", "is not a rollout setting" + suggest(unknown, ROLLOUT_DEFAULTS))
        return None
    raw = value.get("maxUnavailable", ROLLOUT_DEFAULTS["maxUnavailable"])
    percent = _PERCENT_RE.fullmatch(raw) if isinstance(raw, str) else None
    if percent:
        share = int(percent[1])
        if not 1 <= share <= 100:
            error("rollout.maxUnavailable", f"{raw!r} is not a share of the pool; {_FIX}")
            return None
        return f"{share}%"
    if isinstance(raw, str) and "%" in raw:
        error("rollout.maxUnavailable", f"{raw!r} is not a share of the pool; {_FIX}")
        return None
    problems: list[str] = []
    nodes = integer(raw, None, 1, MAX_NODES, problems.append)
    if problems or nodes is None:
        error("rollout.maxUnavailable", f"{raw!r}: {_FIX}" if raw not in (None, "") else f"is empty; {_FIX}")
        return None
    return nodes


def wave_size(max_unavailable: int | str, count: int) -> int:
    """Nodes drained at once in a pool of `count` nodes: a share rounds down (as Kubernetes rounds
    maxUnavailable), and at least one node rolls at a time, or a roll would never end."""
    if isinstance(max_unavailable, str):
        max_unavailable = count * int(max_unavailable.rstrip("%")) // 100
    return max(1, min(max_unavailable, count))
