"""Checks of the cluster-wide swarm settings: the overlay address pool, the kind of shared GPU
slots, and GPU health (which XIDs count, how often the watcher looks)."""
from __future__ import annotations

import ipaddress
from typing import Any

from settings.model import Health
from settings.reader import HEALTH_DEFAULTS, Reader, boolean, integer, suggest
from swarm.gpu_kind import default_shared_kind, validate_kind

DOCKER_LOCAL_POOLS = ("172.16.0.0/12", "192.168.0.0/16")


def read_overlay_pool(r: Reader) -> str | None:
    """The range swarm overlay networks come from: private IPv4, room for 16+ /24s, off Docker's own."""
    text = r.string("overlayAddressPool")
    try:
        pool = ipaddress.ip_network(text, strict=True)
    except ValueError:
        r.error("overlayAddressPool", f"{text!r} is not a network such as 10.200.0.0/16 (host bits must be zero)")
        return None
    if pool.version != 4 or not pool.is_private or not 8 <= pool.prefixlen <= 20:
        r.error("overlayAddressPool", f"{pool} does not fit: use a private IPv4 range from /8 to /20 "
                                      "(each overlay network takes a /24 of it), e.g. 10.200.0.0/16")
        return None
    for local in DOCKER_LOCAL_POOLS:
        if pool.overlaps(ipaddress.ip_network(local)):
            r.error("overlayAddressPool", f"{pool} overlaps {local}, where Docker puts its own bridge networks "
                                          "on every node; choose a range in 10.0.0.0/8 outside the VPC")
            return None
    return str(pool)


def read_shared_kind(r: Reader, kind: str | None) -> str | None:
    """The kind of shared GPUs' slots: sharedGpuKind, or <gpuKind>-SHARED."""
    text = r.string("sharedGpuKind")
    if not kind:
        return None
    if not text:
        return default_shared_kind(kind)
    try:
        validate_kind(text)
    except ValueError as exc:
        r.error("sharedGpuKind", str(exc))
        return None
    if text == kind:
        r.error("sharedGpuKind", f"{text!r} is also gpu-swarm:gpuKind; a GPU is advertised whole or as slots, "
                                 f"never both, so give the slots their own kind such as {kind}-SHARED")
        return None
    return text


# The XIDs NVIDIA documents go up to about 160; room for new ones, none for nonsense.
MAX_XID = 1023


def read_health(r: Reader) -> Health | None:
    """health: {ignoreXids, criticalXids, checkIntervalSeconds, recoverySeconds, maxDrainedPercent, inventoryEachUp}."""
    raw = r.json("health", dict, "pulumi config set --path 'health.ignoreXids[0]' 94")
    if raw is None:
        return None  # reported
    bad = len(r.problems)
    for unknown in sorted(set(raw) - set(HEALTH_DEFAULTS)):
        r.error(f"health.{unknown}", "is not a health setting" + suggest(unknown, HEALTH_DEFAULTS))
    values = {**HEALTH_DEFAULTS, **raw}
    xids = {name: _xids(r, name, values[name]) for name in ("ignoreXids", "criticalXids")}
    both = sorted(set(xids["ignoreXids"]) & set(xids["criticalXids"]))
    if both:
        r.error("health", f"XID {', '.join(map(str, both))} is in both ignoreXids and criticalXids; keep each in one")

    def number(name: str, low: int, high: int, what: str) -> int:
        return integer(values[name], HEALTH_DEFAULTS[name], low, high,
                       lambda m: r.error(f"health.{name}", f"{m} ({what})")) or 0

    health = Health(
        ignore_xids=xids["ignoreXids"], critical_xids=xids["criticalXids"],
        check_interval_s=number("checkIntervalSeconds", 1, 3600, "seconds between the watcher's checks"),
        recovery_s=number("recoverySeconds", 0, 86400, "how long checks must pass after an event before the node "
                                                       "is healthy again"),
        max_drained_percent=number("maxDrainedPercent", 1, 100, "the most nodes drained for faults at once"),
        inventory_each_up=boolean(values["inventoryEachUp"], True, lambda m: r.error("health.inventoryEachUp", m)),
    )
    return None if len(r.problems) > bad else health


def _xids(r: Reader, name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        r.error(f"health.{name}", f"expected a list of XIDs such as [94, 95], found {value!r}")
        return ()
    xids = []
    for i, item in enumerate(value):
        number = integer(item, None, 1, MAX_XID, lambda m: r.error(f"health.{name}[{i}]", f"{m} (an XID)"))
        if number is not None and number not in xids:
            xids.append(number)
    return tuple(sorted(xids))
