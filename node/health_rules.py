#!/usr/bin/env python3
"""The GPU health watcher's rules, as pure functions: what an XID or ECC error means, how GPU
states make one node condition, when a fault counts as recovered, the labels that say so.

gpu_health.py feeds them NVML events, periodic checks and spot notices. Stdlib only.
"""
from __future__ import annotations

import json
import re

from contract import CONDITION_GPU_LABEL, CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL
from daemon_json import set_labels
from gpu_resources import SLOT_RE

RANK = {"healthy": 0, "degraded": 1, "unhealthy": 2, "reclaim": 3}  # conditions, best to worst
OK = ("healthy", "ok")
# XIDs that an application causes (illegal address, MMU fault, ...): the Kubernetes device
# plugin ignores the same ones by default; draining a node for a user's bug helps nobody.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
_REASON_BAD = re.compile(r"[^A-Za-z0-9._:/-]")


def ignored_xids(ignore=frozenset(), critical=frozenset()) -> frozenset[int]:
    """The XIDs that say nothing about the GPU: the defaults, plus ignore, minus critical."""
    return (DEFAULT_IGNORED_XIDS | frozenset(ignore)) - frozenset(critical)


def classify_xid(xid: int, ignored: frozenset[int]) -> str:
    return "healthy" if xid in ignored else "unhealthy"


def classify_event(kind: str, xid: int | None, ignored: frozenset[int]) -> str:
    """The condition an event puts its GPU in; kind is xid, ecc_double or ecc_single."""
    if kind == "xid":
        return classify_xid(xid, ignored)
    return "unhealthy" if kind == "ecc_double" else "degraded"  # a corrected error only warns


def node_condition(gpus: dict[str, tuple[str, str]], spot: tuple[str, str] = OK) -> tuple[str, str, str]:
    """(condition, reason, gpu): the worst of the GPUs and the spot state. Among equally
    bad GPUs the first in daemon.json's order names the reason, so labels do not flap."""
    best = (*OK, "-")
    for uuid, (condition, reason) in gpus.items():
        if RANK[condition] > RANK[best[0]]:
            best = (condition, reason, uuid)
    return (spot[0], spot[1], "-") if RANK[spot[0]] > RANK[best[0]] else best


def event_cleared(event_at: float, ok_since: float | None, now: float, recovery_seconds: float) -> bool:
    """An event's state clears once checks have passed without a break for recovery_seconds
    since the event: the check cannot see an XID, which may well come again in a minute."""
    return ok_since is not None and now - max(event_at, ok_since) >= recovery_seconds


def watched_uuids(config: dict, kind: str, shared_kind: str | None = None) -> list[str]:
    """The GPUs daemon.json advertises as kind, or as slots (GPU-x-s3) of shared_kind."""
    uuids = []
    for entry in config.get("node-generic-resources", []):
        name, _, value = entry.partition("=")
        slot = SLOT_RE.fullmatch(value) if shared_kind and name == shared_kind else None
        uuid = value if name == kind else slot["gpu"] if slot else ""
        if uuid and uuid not in uuids:
            uuids.append(uuid)
    return uuids


def condition_labels(condition: str, reason: str, gpu: str, since: float) -> dict[str, str]:
    """Our labels; the reason keeps only [A-Za-z0-9._:/-] (others become _), at most 120 chars."""
    reason = _REASON_BAD.sub("_", reason.strip())[:120] or "-"
    return {CONDITION_LABEL: condition, CONDITION_REASON_LABEL: reason, CONDITION_GPU_LABEL: gpu or "-",
            CONDITION_SINCE_LABEL: str(int(since))}


def merge_labels(config: dict, labels: dict[str, str]) -> dict:
    """config with our labels (all that start with CONDITION_LABEL) set; every other key and label kept, in order."""
    new = json.loads(json.dumps(config))  # a deep copy that keeps key order
    new["labels"] = set_labels(new.get("labels", []), CONDITION_LABEL, labels)
    return new


class Tracker:
    """Per GPU: the worst event not recovered from, the last check, since when checks pass.
    Times are passed in, so tests drive the clock; the state file keeps events (and the
    checks' run) across a restart or a --once run."""

    def __init__(self, recovery_seconds: float, log=print):
        self.recovery, self.log = recovery_seconds, log
        self.events: dict[str, dict] = {}
        self.checks: dict[str, tuple[str, str]] = {}
        self.ok_since: dict[str, float] = {}
        self.saved: str | None = None  # the state file as last written, to write on change only

    def event(self, uuid: str, condition: str, reason: str, now: float) -> bool:
        """Record an event; True when it is news (not the state it already had)."""
        old = self.events.get(uuid)
        if old and RANK[old["condition"]] > RANK[condition]:
            condition, reason = old["condition"], old["reason"]  # a milder event must not hide a worse one
        self.events[uuid] = {"condition": condition, "reason": reason, "at": now}
        return not old or (old["condition"], old["reason"]) != (condition, reason)

    def check(self, uuid: str, condition: str, reason: str, now: float) -> None:
        self.checks[uuid] = (condition, reason)
        if condition == "healthy":
            self.ok_since.setdefault(uuid, now)
        else:
            self.ok_since.pop(uuid, None)

    def states(self, uuids: list[str], now: float) -> dict[str, tuple[str, str]]:
        out = {}
        for uuid in uuids:
            state, event = self.checks.get(uuid, OK), self.events.get(uuid)
            if event and event_cleared(event["at"], self.ok_since.get(uuid), now, self.recovery):
                self.log(f"{uuid}: {event['reason']} cleared: checks passed for {self.recovery:g}s since the event")
                del self.events[uuid]
            elif event and RANK[event["condition"]] > RANK[state[0]]:
                state = (event["condition"], event["reason"])
            out[uuid] = state
        return out

    def state(self) -> str:
        return json.dumps({"events": self.events, "ok_since": self.ok_since}, sort_keys=True)

    def load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            events = {u: {"condition": e["condition"], "reason": str(e["reason"]), "at": float(e["at"])}
                      for u, e in data["events"].items() if e["condition"] in RANK}
            ok_since = {u: float(t) for u, t in data["ok_since"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            self.log(f"{path} is unusable ({e!r}); starting without remembered events")
            return
        self.events, self.ok_since = events, ok_since
        self.saved = self.state()


def record_event(tracker: Tracker, uuid: str, kind: str, xid: int | None, ignored, now: float, log) -> None:
    what = f"xid {xid}" if kind == "xid" else f"{kind[4:]}-bit ECC error"
    condition = classify_event(kind, xid, ignored)
    if condition == "healthy":
        log(f"{uuid}: {what} ignored (an application's error, not the GPU's)")
    elif tracker.event(uuid, condition, f"{'xid_' + str(xid) if kind == 'xid' else kind}_on_{uuid}", now):
        log(f"{uuid}: {what}: {condition}")


