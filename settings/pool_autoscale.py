"""A GPU pool's `autoscale` key: an elastic pool, which grows when GPU tasks wait and shrinks when it is idle.

    autoscale: {max: 4}                              # from 0 nodes, idle nodes go after 10 minutes
    autoscale: {min: 1, max: 8, idleMinutes: 30}

An elastic pool is an EC2 Auto Scaling group (components/elastic_pool.py) whose size the scaler on the
swarm leader sets (node/swarm_scaler.py). It takes no `count`: the group starts at `min` and the scaler
decides the rest, so a `count` beside it would be a second answer to "how many", one that every
`pulumi up` would have to either force on the group (undoing the scaler) or ignore (a setting that
does nothing). Refused together, the question has one owner.

Refused with it, each for its reason (the message says which):
- `marketType: capacity-block`: a Capacity Block is a fixed number of instances bought for fixed
  dates; there is nothing to scale, and a node removed early is paid for anyway.
- `interruption: stop`: it needs a persistent spot request, and an Auto Scaling group makes one-time
  requests only (AWS CloudFormation, AWS::EC2::LaunchTemplate SpotOptions: "If you are using Spot
  Instances with an Auto Scaling group, use one-time requests"); the group replaces a reclaimed node.
- `efa`: not built yet; a multi-node training job needs its nodes all at once, which a fixed count gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from settings.values import integer, suggest

MAX_NODES = 1000  # as a fixed pool's count
# The key's defaults (None: required); settings/reader.py's POOL_DEFAULTS names the key, Pulumi.yaml documents it.
AUTOSCALE_DEFAULTS: dict[str, Any] = {"min": 0, "max": None, "idleMinutes": 10}
MAX_IDLE_MINUTES = 7 * 24 * 60


@dataclass(frozen=True)
class Autoscale:
    min: int
    max: int
    idle_minutes: int


def read_autoscale(value: Any, entry: dict, error: Callable[[str, str], None]) -> Autoscale | None:
    """The pool's Autoscale from its config entry; None when the key is absent or a problem was reported
    (error is then called). `entry` is the whole pool entry: count and the capacity keys are checked against it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        error("autoscale", f"expected an object such as {{max: 4}} or {{min: 0, max: 4, idleMinutes: 10}}, "
                           f"found {value!r}")
        return None
    ok = True
    for unknown in sorted(set(value) - set(AUTOSCALE_DEFAULTS)):
        error(f"autoscale.{unknown}", "is not an autoscale setting" + suggest(unknown, AUTOSCALE_DEFAULTS))
        ok = False
    if "count" in entry:
        error("count", "an elastic pool (autoscale) takes no count: it starts at autoscale.min and the scaler on the "
                       "swarm leader sets its size; remove count, or remove autoscale for a pool of fixed size")
        ok = False
    if "max" not in value:
        error("autoscale.max", f"required: the most nodes the pool may grow to (1 to {MAX_NODES}); the preview checks "
                               "it against the account's quotas as it checks a count")
        ok = False
    low = integer(value.get("min"), AUTOSCALE_DEFAULTS["min"], 0, MAX_NODES,
                  lambda m: error("autoscale.min", m + " (the nodes the pool keeps when idle; 0 is allowed)"))
    high = integer(value.get("max"), None, 1, MAX_NODES,
                   lambda m: error("autoscale.max", m + " (the most nodes the pool may grow to)"))
    idle = integer(value.get("idleMinutes"), AUTOSCALE_DEFAULTS["idleMinutes"], 1, MAX_IDLE_MINUTES,
                   lambda m: error("autoscale.idleMinutes", m + " (how long a node holds no GPU task before it goes)"))
    if low is None or high is None or idle is None:
        return None
    if low > high:
        error("autoscale.min", f"{low} is more than autoscale.max {high}; make min at most max")
        ok = False
    market = str(entry.get("marketType") or "").strip()
    if market == "capacity-block":
        error("autoscale", "a Capacity Block holds a fixed number of instances for fixed dates, paid whether they "
                           "run or not: there is nothing to scale. Remove autoscale and set count to the block's size")
        ok = False
    if str(entry.get("interruption") or "").strip() == "stop":
        error("interruption", "stop needs a persistent spot request, and an Auto Scaling group makes one-time "
                              "requests only: an elastic pool's reclaimed node is replaced by the group. Remove "
                              "interruption (terminate), or remove autoscale for a pool whose nodes resume")
        ok = False
    if entry.get("efa") in (True, "true", "True"):
        error("efa", "elastic EFA pools are not offered: a multi-node training job needs all of its nodes at once, "
                     "which a fixed count gives. Remove autoscale and set count, or remove efa")
        ok = False
    return Autoscale(low, high, idle) if ok else None
